"""Every op under `torch.compile(fullgraph=True, dynamic=True)`: no graph break, one compile for
three batch sizes, results equal to eager."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import torch_ops  # noqa: F401

from . import samples

HQ, HKV, D, BS, NB = 4, 2, 16, 4, 64


def _paged(n):
    seq_lens = torch.randint(1, 12, (n,), dtype=torch.int32)
    k, v, _ = samples.paged_cache(NB, BS, HKV, D, "bf16")
    return k, v, samples.block_tables_for(seq_lens.tolist(), BS, NB, max_blocks=4), seq_lens


def paged_decode(n):
    k, v, bt, sl = _paged(n)
    return (torch.randn(n, HQ, D, dtype=torch.bfloat16), k, v, bt, sl), {}


def paged_prefill(n):
    k, v, bt, sl = _paged(n)
    q_lens = torch.minimum(sl, torch.randint(1, 4, (n,), dtype=torch.int32))
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), q_lens.cumsum(0).to(torch.int32)])
    return (torch.randn(int(cu[-1]), HQ, D, dtype=torch.bfloat16), k, v, bt, cu, sl), {}


def context_attention(n):
    lens = torch.randint(1, 6, (n,))
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).to(torch.int32)])
    t = int(cu[-1])
    q, k, v = torch.randn(t, HQ, D).half(), torch.randn(t, HKV, D).half(), torch.randn(t, HKV, D).half()
    return (q, k, v, cu, cu), {"causal": True}


def kv_cache_write(n):
    k_cache, v_cache, _ = samples.paged_cache(NB, BS, HKV, D, "bf16")
    key, value = torch.randn(n, HKV, D, dtype=torch.bfloat16), torch.randn(n, HKV, D, dtype=torch.bfloat16)
    return (key, value, k_cache, v_cache, torch.randperm(NB * BS)[:n].to(torch.int32)), {}


def merge_states(n):
    return (torch.randn(n, HQ, D), torch.randn(n, HQ), torch.randn(n, HQ, D), torch.randn(n, HQ)), {}


def cache_attention(n):
    args, kwargs = samples.cache_attention("offset")
    seqlens = torch.randint(1, 4, (n,))
    start_pos = torch.randint(0, 5, (n,))
    kvlens = start_pos + seqlens
    t = int(seqlens.sum())
    cache = torch.randn(16 * n, 2, 2, HKV, 16, dtype=torch.float16)
    args = (torch.randn(t, 4, 16, dtype=torch.float16), torch.randn(t, HKV, 16, dtype=torch.float16),
            torch.randn(t, HKV, 16, dtype=torch.float16), torch.cat([torch.zeros(1, dtype=torch.long), seqlens.cumsum(0)]),
            torch.cat([torch.zeros(1, dtype=torch.long), kvlens.cumsum(0)]), torch.arange(n) * 16, start_pos,
            torch.tensor([0]), int(seqlens.max()), int(kvlens.max()), cache, None, None)
    return args, kwargs


BUILDERS = [paged_decode, paged_prefill, context_attention, kv_cache_write, merge_states, cache_attention]


def _clone(x):
    return x.clone() if isinstance(x, torch.Tensor) else x


@pytest.mark.parametrize("build", BUILDERS, ids=[b.__name__ for b in BUILDERS])
def test_compiles_once_without_graph_breaks(build):
    op = getattr(torch.ops.attn, build.__name__)

    def fn(*args, **kwargs):
        return op(*args, **kwargs)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    # Without duck sizing, a batch size that happens to equal a head count is not unified with it.
    with torch.fx.experimental._config.patch(use_duck_shape=False):
        _run_three_sizes(fn, compiled, build)
    assert counter.frame_count == 1, f"{build.__name__} compiled {counter.frame_count} times for 3 batch sizes"


def _run_three_sizes(fn, compiled, build):
    for n in (2, 3, 5):
        args, kwargs = build(n)
        eager_args = [_clone(a) for a in args]
        expected = fn(*eager_args, **kwargs)
        got = compiled(*args, **kwargs)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        for a, b in zip(args, eager_args):  # mutated caches end up the same
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b)
