"""Model-level backends agree with the reference one step by step (Triton through the
interpreter on CPU, on the GPU with and without CUDA graphs), and CUDA-graph decode steps equal
eager calls bit for bit while requests arrive and leave."""

import dataclasses
import random

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from torch_ops.serving.attention import BACKENDS, AttentionConfig, get_backend
from torch_ops.serving.cache_manager import KVCacheManager

from .helpers import CONFIG, build_engine, random_requests

HAS_CUDA = torch.cuda.is_available()


def fresh_rng():
    return random.Random(int(torch.randint(0, 2**31, ())))


def lockstep(backend, rng, *, device, steps_min=0, dtype=torch.bfloat16, **kw):
    """Run the reference engine and a `backend` engine on the same requests and arrivals, step
    by step. Every step's logits must agree within bf16 tolerance and the sampled tokens must be
    equal except after a near tie (top-2 margin within twice the logit difference); there the
    backend engine is given the reference's token (teacher forcing), so both keep serving the
    same sequences. With `warmup`, the backend engine is warmed up first. Returns the number of
    steps compared."""
    engines = [build_engine(b, dtype=dtype, device=device, **kw.get(b, {}), **kw["common"])
               for b in ("vanilla", backend)]
    if kw.get("warmup"):   # then every graph is captured and no block is held (prefix cache included)
        engines[1].warmup(progress=False)
        assert sorted(engines[1]._graphs) == sorted(engines[1].buckets)
        assert engines[1].kv.allocator.num_free == engines[1].kv.allocator.num_blocks
    requests = random_requests(rng, kw.get("num_requests", 6), CONFIG.vocab_size, max_prompt=12, max_new=6)
    arrivals = sorted(rng.randint(0, kw.get("spread", 4)) for _ in requests)
    copies = [[type(r)(r.id, list(r.prompt), r.max_new_tokens) for r in requests] for _ in engines]
    step = 0
    while step <= arrivals[-1] or engines[0].has_work:
        for engine, reqs in zip(engines, copies):
            for req, arrival in zip(reqs, arrivals):
                if arrival == step:
                    engine.add_request(req)
        stats = [engine.step() for engine in engines]
        step += 1
        if stats[0] is None:
            continue
        ref, got = (e.last_logits.float() for e in engines)
        diff = (ref - got).abs().max().item()
        assert diff <= 0.05 * ref.abs().max().item() + 0.02, f"step {step}: logits differ by {diff}"
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * diff
        same = ref.argmax(-1) == got.argmax(-1)
        assert bool((same | ~clear).all()), f"step {step}: a clear argmax differs"
        for ref_req, req in zip(*copies):
            req.output[:] = ref_req.output
        engines[1].outputs_changed()
    assert step >= steps_min
    return step


def test_triton_backend_matches_reference_in_the_interpreter():
    if HAS_CUDA:
        pytest.skip("covered on the GPU by test_triton_backend_matches_reference_on_gpu")
    lockstep("triton", fresh_rng(), device="cpu", num_requests=3, common=dict(max_num_tokens=8))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_backend_matches_reference_on_gpu(backend):
    if get_backend(backend).unsupported(*_probe("cuda")):
        pytest.skip(f"{backend}: " + "; ".join(get_backend(backend).unsupported(*_probe("cuda"))))
    # head dim 64: FlashInfer's paged kernels take 64, 128 or 256
    lockstep(backend, fresh_rng(), device="cuda", num_requests=12,
             common=dict(max_num_tokens=24, config=dataclasses.replace(CONFIG, head_dim=64)))


@pytest.mark.gpu
def test_cuda_graph_decode_steps_equal_eager_calls():
    """Capture decode graphs for 4 buckets, serve requests arriving and leaving for 100+ graph
    steps; after every replay, the eager call of the captured function on the same inputs must
    give the same logits bit for bit, and the engine must agree with the reference engine."""
    engine = build_engine("triton", dtype=torch.bfloat16, device="cuda", max_num_tokens=32,
                          graph_buckets=(1, 2, 4, 8), num_blocks=256)
    replays = []
    engine.capture_graphs()
    for bucket, (graph, logits, run) in list(engine._graphs.items()):
        engine._graphs[bucket] = (_Checked(graph, logits, run, replays), logits, run)
    rng = fresh_rng()
    # ~1600 generated tokens over <= 8 running requests: far more than 100 decode-only steps
    requests = random_requests(rng, 96, CONFIG.vocab_size, max_prompt=12, max_new=32)
    arrivals = sorted(rng.randint(0, 200) for _ in requests)
    from torch_ops.serving.engine import generate

    generate(engine, requests, arrivals)
    assert len(replays) >= 100 and len(set(replays)) > 1
    lockstep("triton", rng, device="cuda", steps_min=20, num_requests=16, spread=30,
             common=dict(max_num_tokens=32, num_blocks=256),
             triton=dict(graph_buckets=(1, 2, 4, 8)))


@pytest.mark.gpu
def test_warmed_up_graph_engine_matches_reference():
    """`warmup()` compiles the graphs' kernels with its workload's, captures a graph per bucket and
    leaves every block free; the engine then serves in lockstep with the reference."""
    lockstep("triton", fresh_rng(), device="cuda", steps_min=20, num_requests=16, spread=30,
             common=dict(max_num_tokens=32, num_blocks=256, prefix_caching=True),
             triton=dict(graph_buckets=(1, 2, 4, 8)), warmup=True)


class _Checked:
    """A CUDA graph whose every replay is followed by the eager call it captured."""

    def __init__(self, graph, logits, run, log):
        self.graph, self.logits, self.run, self.log = graph, logits, run, log

    def replay(self):
        from torch_ops.testing import poison_

        poison_(self.logits)
        self.graph.replay()
        replayed = self.logits.clone()
        eager = self.run()
        assert torch.equal(replayed, eager), f"replay {len(self.log)} differs from the eager call"
        self.log.append(self.logits.shape[0])


class _DeviceOps(TorchDispatchMode):
    """Records every aten op that touches a tensor on the `meta` device, with its args."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(x, torch.Tensor) and x.is_meta for x in tree_leaves((args, kwargs))):
            self.calls.append((func, args))
        return func(*args, **kwargs)


def test_prepare_touches_the_device_with_one_copy_per_step():
    """`prepare` of decode, padded, mixed and prefill steps on a cache on a stand-in device
    (`meta`): the only device work is one host-to-device copy per step (views of a batch shape
    are made once, then cached), so nothing launches, allocates or syncs on a GPU."""
    rng = fresh_rng()
    kv = KVCacheManager(1, 256, 4, 2, 8, torch.float16, device="meta")
    attention = get_backend("vanilla")(AttentionConfig(4, 2, 8), kv, max_num_seqs=16,
                                       max_num_tokens=64, max_blocks_per_seq=32)
    seqs = list(range(12))
    for s in seqs:
        kv.add(s)
        kv.append(s, rng.randint(1, 40))
    seen = set()
    for step in range(12):
        batch = rng.sample(seqs, rng.randint(1, 12))
        counts = np.ones(len(batch), dtype=np.int64) if step % 3 else np.array(
            [rng.randint(0, 4) for _ in batch])
        rows = kv.append_batch(batch, counts)
        pad_to = 16 if step % 3 == 1 else None
        shape = (pad_to or len(batch), int(counts.sum()) if pad_to is None else 16)
        with _DeviceOps() as ops:
            meta = attention.prepare(batch, counts, pad_to=pad_to, rows=rows if step % 2 else None,
                                     token_ids=[rng.randrange(100) for _ in range(int(counts.sum()))])
        device_work = [(f, a) for f, a in ops.calls if not f.is_view]
        assert [f for f, _ in device_work] == [torch.ops.aten.copy_.default], step
        dst, src = device_work[0][1][:2]
        assert dst.is_meta and src.device.type == "cpu"
        assert meta.attn.token_ids.is_meta and meta.attn.slot_mapping.is_meta
        if shape in seen:  # a known batch shape: no view is made either
            assert len(ops.calls) == 1, step
        seen.add(shape)
    assert len(seen) < 12  # some shapes came back


def _probe(device):
    kv = KVCacheManager(1, 4, 16, 2, 64, torch.bfloat16, device=device)
    return AttentionConfig(4, 2, 64), kv


def test_backend_registry_and_bad_configuration():
    assert set(BACKENDS) == {"vanilla", "triton", "flashinfer"}
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        get_backend("nope")
    cfg, kv = _probe("cpu")
    if get_backend("flashinfer").unsupported(cfg, kv):
        with pytest.raises(ValueError, match="'flashinfer' cannot serve this model"):
            get_backend("flashinfer")(cfg, kv, max_num_seqs=2, max_num_tokens=8, max_blocks_per_seq=4)
    with pytest.raises(ValueError, match="the KV cache has 2 KV heads of dim 64, the model 1 of dim 64"):
        get_backend("vanilla")(AttentionConfig(4, 1, 64), kv, max_num_seqs=2, max_num_tokens=8,
                               max_blocks_per_seq=4)
    with pytest.raises(ValueError, match="num_heads \\(4\\) must be a multiple of num_kv_heads \\(3\\)"):
        AttentionConfig(4, 3, 64)
    with pytest.raises(ValueError, match="graph_buckets need a graph-safe backend on CUDA"):
        build_engine("vanilla", graph_buckets=(1, 2))
