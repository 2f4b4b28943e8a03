"""`shared_prefix_attention` (cascade) against the paged ops over each sequence's full block table.

Truth is the float64 reference over `[group prefix blocks, own blocks]`; the baseline the same in
the query dtype. Runs on the vanilla backend (CPU) and the Triton kernels (interpreter on CPU,
the GPU under `-m gpu`).
"""

from __future__ import annotations

import random

import pytest
import torch

import torch_ops
from torch_ops import kv_cache, reference
from torch_ops.cascade import shared_prefix_attention
from torch_ops.testing import assert_error_ratio

UNUSED_BLOCK = 2**30 - 1


def make_cascade(device, *, groups, own_lens, q_lens, hq, hkv, d, bs, dtype=torch.bfloat16, cache_dtype=None):
    """`groups` is a list of (prefix blocks, sequences in the group); returns the cascade arguments
    and each sequence's full block table and length."""
    num_blocks = sum(p for p, _ in groups) + sum(-(-n // bs) for n in own_lens) + 1
    cache = kv_cache.PagedKVCache.allocate(num_blocks, bs, hkv, d, cache_dtype or dtype, device=device)
    kv_cache.random_(cache)
    free = torch.randperm(num_blocks).tolist()
    take = lambda n: [free.pop() for _ in range(n)]  # noqa: E731
    num_seqs = sum(n for _, n in groups)
    max_prefix = max(p for p, _ in groups)
    max_own = max(-(-n // bs) for n in own_lens)
    shared = torch.full((len(groups), max(1, max_prefix)), UNUSED_BLOCK, dtype=torch.int32)
    own = torch.full((num_seqs, max(1, max_own)), UNUSED_BLOCK, dtype=torch.int32)
    full = torch.full((num_seqs, max_prefix + max_own), UNUSED_BLOCK, dtype=torch.int32)
    cu_group, cu_q, full_lens, seq = [0], [0], [], 0
    for g, (prefix_blocks, members) in enumerate(groups):
        prefix = take(prefix_blocks)
        shared[g, :prefix_blocks] = torch.tensor(prefix, dtype=torch.int32)
        for _ in range(members):
            mine = take(-(-own_lens[seq] // bs))
            own[seq, :len(mine)] = torch.tensor(mine, dtype=torch.int32)
            full[seq, :prefix_blocks + len(mine)] = torch.tensor(prefix + mine, dtype=torch.int32)
            full_lens.append(prefix_blocks * bs + own_lens[seq])
            cu_q.append(cu_q[-1] + q_lens[seq])
            seq += 1
        cu_group.append(cu_q[-1])
    as_dev = lambda x: torch.as_tensor(x, dtype=torch.int32).to(device)  # noqa: E731
    q = torch.randn(cu_q[-1], hq, d, dtype=dtype, device=device)
    args = (q, cache, as_dev(shared), as_dev([p * bs for p, _ in groups]), as_dev(cu_group),
            as_dev(own), as_dev(own_lens), as_dev(cu_q))
    return args, as_dev(full), as_dev(full_lens)


def check_against_full(args, full, full_lens, decode, prefix_chunks=None, **options):
    q, cache, shared, shared_lens, cu_group, own, own_lens, cu_q = args
    out, lse = shared_prefix_attention(q, cache.k, cache.v, shared, shared_lens, cu_group, own, own_lens,
                                       None if decode else cu_q, prefix_chunks=prefix_chunks,
                                       **cache.scale_kwargs(), **options)
    kw = dict(cache.scale_kwargs(), **options)
    truth = reference.paged_prefill(q, cache.k, cache.v, full, cu_q, full_lens, compute_dtype=torch.float64, **kw)
    base = reference.paged_prefill(q, cache.k, cache.v, full, cu_q, full_lens, compute_dtype=q.dtype, **kw)
    assert_error_ratio(out, truth[0], base[0])
    assert_error_ratio(lse, truth[1], base[1], name="lse")


@pytest.mark.parametrize("backend", ["vanilla", "triton"])
@pytest.mark.parametrize("decode,chunks", [(True, 1), (False, 1), (True, 2)])
def test_shared_prefix_matches_full_tables(kernel_device, backend, decode, chunks):
    device = kernel_device if backend == "triton" else torch.device("cpu")
    groups = [(3, 2), (0, 1), (2, 3)]                  # a group without a shared prefix too
    own_lens = [5, 17, 9, 1, 30, 8]
    q_lens = [2] * 6 if decode else [2, 5, 3, 1, 7, 8]
    args, full, full_lens = make_cascade(device, groups=groups, own_lens=own_lens, q_lens=q_lens,
                                         hq=4, hkv=2, d=32, bs=8)
    sinks = torch.randn(4, device=device)
    with torch_ops.use_backend(backend):
        check_against_full(args, full, full_lens, decode, chunks, softcap=20.0, sinks=sinks)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_shared_prefix_gpu(cache_dtype):
    groups = [(random.randint(1, 400), random.randint(1, 16)) for _ in range(random.randint(1, 4))]
    n = sum(m for _, m in groups)
    own_lens = [random.randint(1, 300) for _ in range(n)]
    args, full, full_lens = make_cascade(torch.device("cuda"), groups=groups, own_lens=own_lens, q_lens=[1] * n,
                                         hq=32, hkv=8, d=128, bs=16, cache_dtype=cache_dtype)
    check_against_full(args, full, full_lens, decode=True)


def test_positional_options_are_refused():
    args, _, _ = make_cascade(torch.device("cpu"), groups=[(1, 1)], own_lens=[3], q_lens=[1], hq=2, hkv=1, d=16, bs=4)
    q, cache, shared, shared_lens, cu_group, own, own_lens, _ = args
    with pytest.raises(ValueError, match="window_left"):
        shared_prefix_attention(q, cache.k, cache.v, shared, shared_lens, cu_group, own, own_lens, window_left=8)
    with pytest.raises(ValueError, match="cu_group_tokens"):
        shared_prefix_attention(q, cache.k, cache.v, shared, shared_lens, cu_group[:1], own, own_lens)


def test_debug_mode_catches_groups_across_sequences(monkeypatch):
    monkeypatch.setenv("ATTN_DEBUG", "1")
    args, _, _ = make_cascade(torch.device("cpu"), groups=[(1, 2)], own_lens=[3, 4], q_lens=[2, 2],
                              hq=2, hkv=1, d=16, bs=4)
    q, cache, shared, shared_lens, _, own, own_lens, _ = args
    with pytest.raises(ValueError, match="sequence boundaries"):
        shared_prefix_attention(q, cache.k, cache.v, shared, shared_lens, torch.tensor([0, 3]), own, own_lens)
