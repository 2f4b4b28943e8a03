"""The Triton prefill kernels (`attn::paged_prefill`, `attn::context_attention`) against the reference.

Truth is `reference.<op>(..., compute_dtype=float64)` (unrounded float64 out and lse); the baseline is
the same in the query dtype, and `assert_error_ratio` bounds our error by twice the baseline's plus
the output's rounding floor, for `out` and for `lse` (-inf must match -inf). Calls go through
`torch.ops.attn.<op>` or its `.out` overload (NaN-poisoned buffers) inside `use_backend("triton")`.

On CPU the kernels run in Triton's interpreter: a few tiny cases with 16 x 16 tiles (so that every
key loop runs: sink/leading-edge, unmasked, diagonal). The broad matrix, long sequences, CUDA-graph
replay and >2^31-element caches are marked `gpu` and use the default tile configs.
"""

from __future__ import annotations

import math
import random
import types

import pytest
import torch

import torch_ops
from torch_ops import checks, quant, kv_cache, reference
from torch_ops.kernels.triton import paged_prefill, prefill_attention as pa
from torch_ops.testing import assert_error_ratio, assert_replays_match_eager, poison_

from ... import samples

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
INT8, INT4 = torch.int8, torch.uint8
UNUSED_BLOCK = 2**30 - 1   # block-table entries past a sequence's length: reading one would fault
SMALL_TILES = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}


# ---- problem construction ----------------------------------------------------------------------


def cumsum0(lens, device, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor([0] + list(lens), dtype=torch.int64).cumsum(0).to(device=device, dtype=dtype)


def make_paged(device, *, q_lens, seq_lens, hq, hkv, d, bs, dtype=BF16, cache_dtype=None, layout="NHD",
               fp8_per_head=False, group=None, scale_dtype=FP32, index_dtype=torch.int32, num_blocks=None,
               high_block_ids=False, share_prefix=False, dv=None):
    """Random paged inputs: `(query, cache, block_tables, cu_seqlens_q, seq_lens)`, each sequence on
    a random permutation of blocks (optionally sequence 1 reusing sequence 0's first blocks). With
    `dv`, `cache.v` has head dim `dv` (a value cache of its own on the same blocks)."""
    cache_dtype = cache_dtype or dtype
    per_seq = [-(-n // bs) for n in seq_lens]
    needed = sum(per_seq) + 3
    nb = num_blocks or needed
    fp8 = cache_dtype in (E4M3, E5M2)

    def random_cache(head_dim):
        return kv_cache.random_(kv_cache.PagedKVCache.allocate(
            nb, bs, hkv, head_dim, cache_dtype, layout=layout, device=device,
            fp8_scale=torch.ones(hkv) if fp8 and fp8_per_head else None, quant_group=group, scale_dtype=scale_dtype))

    cache = random_cache(d)
    if dv is not None:
        keys, values = cache, random_cache(dv)
        cache = types.SimpleNamespace(k=keys.k, v=values.v,
                                      scale_kwargs=lambda: {"k_scale": keys.k_scale, "v_scale": values.v_scale})
    ids = torch.randperm(needed).tolist()
    if high_block_ids:
        ids = [nb - 1 - i for i in ids]
    table = torch.full((len(seq_lens), max(per_seq + [0]) + 1), UNUSED_BLOCK, dtype=torch.int64)
    for b, n in enumerate(per_seq):
        table[b, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int64)
    if share_prefix and len(seq_lens) > 1:
        shared = max(min(per_seq[0], per_seq[1]) - 1, 0)
        table[1, :shared] = table[0, :shared]
    q = torch.randn(sum(q_lens), hq, d, dtype=dtype, device=device)
    return (q, cache, table.to(device=device, dtype=index_dtype), cumsum0(q_lens, device, index_dtype),
            torch.tensor(seq_lens, dtype=index_dtype, device=device))


def make_context(device, *, q_lens, k_lens, hq, hkv, d, dtype=BF16, dv=None):
    """Random packed inputs: `(query, key, value, cu_seqlens_q, cu_seqlens_k)`; values of head dim
    `dv` (default `d`)."""
    q = torch.randn(sum(q_lens), hq, d, dtype=dtype, device=device)
    k = torch.randn(sum(k_lens), hkv, d, dtype=dtype, device=device)
    v = torch.randn(sum(k_lens), hkv, dv or d, dtype=dtype, device=device) * 2
    return q, k, v, cumsum0(q_lens, device), cumsum0(k_lens, device)


def mixed_lengths(rng: random.Random, bs: int) -> tuple[list[int], list[int]]:
    """(q_lens, seq_lens) of a decode, a chunked prefill, a full prefill, a length-0 sequence and a
    padding sequence (query rows, no keys), shuffled."""
    seqs = [(1, rng.randint(2, 3 * bs + 5)), (rng.randint(12, 24), rng.randint(30, 50)),
            (r := rng.randint(17, 30), r), (0, 0), (2, 0)]
    rng.shuffle(seqs)
    return [s[0] for s in seqs], [s[1] for s in seqs]


# ---- calls and checks --------------------------------------------------------------------------


def _out_buffers(query, dtype, out_scale=None, value_dim=None):
    """NaN-poisoned `out [T, Hq, value_dim (default D)]` and `lse [T, Hq]`."""
    out = torch.empty(*query.shape[:2], value_dim or query.shape[-1], dtype=E4M3 if out_scale is not None else dtype,
                      device=query.device)
    lse = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
    poison_(out)
    poison_(lse)
    return out, lse


def run_paged(problem, *, functional=False, **options):
    q, cache, bt, cu, sl = problem
    args = (q, cache.k, cache.v, bt, cu, sl)
    kw = dict(cache.scale_kwargs(), **options)
    with torch_ops.use_backend("triton"):
        if functional:
            return torch.ops.attn.paged_prefill(*args, **kw)
        out, lse = _out_buffers(q, q.dtype, options.get("out_scale"), checks.paged_value_dim(q, cache.k, cache.v))
        torch.ops.attn.paged_prefill.out(*args, out=out, lse=lse, **kw)
        return out, lse


def run_context(problem, *, functional=True, **options):
    q = problem[0]
    with torch_ops.use_backend("triton"):
        if functional:
            return torch.ops.attn.context_attention(*problem, **options)
        dtype = options.get("out_dtype") or (BF16 if q.dtype == E4M3 else q.dtype)
        out, lse = _out_buffers(q, dtype, options.get("out_scale"), problem[2].shape[-1])
        torch.ops.attn.context_attention.out(*problem, out=out, lse=lse, **options)
        return out, lse


def check(op: str, args: tuple, out, lse, *, baseline_dtype=None, **options) -> None:
    """Our (out, lse) against the float64 truth, with the error-ratio tolerance; rows that see no
    key must be exactly zero."""
    fn = getattr(reference, op)
    truth_o, truth_l = fn(*args, compute_dtype=torch.float64, **options)
    base_o, base_l = fn(*args, compute_dtype=baseline_dtype or args[0].dtype, **options)
    assert not torch.isnan(out.float()).any(), "out has NaN (unwritten or bad masking)"
    assert not torch.isnan(lse).any(), "lse has NaN (unwritten or bad masking)"
    out_scale = options.get("out_scale")
    if out_scale is not None:
        # FP8 output against the unquantized truth / out_scale; the floor is FP8's rounding there
        m = torch.finfo(E4M3).max
        t = (truth_o / out_scale.double()).clamp(-m, m)
        floor = 2 * (t.to(E4M3).double() - t).abs().max().item() + 1e-6 if t.numel() else 1e-6
        assert_error_ratio(out.double(), t, base_o.double(), floor=floor, name="fp8 out")
    else:
        assert_error_ratio(out, truth_o, base_o)
    assert_error_ratio(lse, truth_l, base_l, name="lse")
    empty = (truth_o == 0).all(-1)
    assert (out.float()[empty] == 0).all(), "a row that sees no key must be zeros"


def check_paged(problem, out, lse, **options) -> None:
    q, cache, bt, cu, sl = problem
    check("paged_prefill", (q, cache.k, cache.v, bt, cu, sl), out, lse, **cache.scale_kwargs(), **options)


@pytest.fixture
def small_tiles():
    """16 x 16 tiles, so that tiny CPU problems exercise every key loop of the kernel."""
    with pa.tuning(config=dict(SMALL_TILES)):
        yield


@pytest.fixture
def tiles_32():
    """32-row tiles for the work list, 16-key tiles."""
    with pa.tuning(config={"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}):
        yield


# ---- CPU (interpreter) cases: few and tiny -----------------------------------------------------


def test_paged_mixed_batch_two_launches(kernel_device, tiles_32, monkeypatch):
    # 32-row tiles for the work list, 16-row tiles for sequences of at most 16 // group tokens
    launches = []
    kernel = pa._kernel
    monkeypatch.setattr(pa, "_kernel", lambda *a, **kw: launches.append(kw["short"]) or kernel(*a, **kw))
    problem = make_paged(kernel_device, q_lens=[1, 20, 8, 0, 9, 3], seq_lens=[40, 20, 31, 5, 9, 3],
                         hq=4, hkv=2, d=32, bs=8)
    check_paged(problem, *run_paged(problem))
    assert launches == [False, True]


def test_work_list_slots():
    assert pa.work_slots(52, 7, 16, None) == (10, 0)   # T // TOK + B, shared
    assert pa.work_slots(52, 7, 16, 9) == (7, 1)       # one slot per sequence: fewer
    assert pa.work_slots(52, 7, 16, 20) == (10, 0)     # two per sequence would be more
    assert pa.work_slots(2048, 4, 32, 64) == (8, 2)    # 4 chunks of 512: 8 slots, not 68


@pytest.mark.parametrize("max_queries,slots", [(20, (18, 2)), (40, (19, 0))], ids=["slots-per-sequence", "shared-list"])
def test_paged_max_queries_leaves_longer_sequences_untouched(kernel_device, tiles_32, max_queries, slots):
    # what the `mixed` backend asks of the Triton kernel: both launches skip sequences of more than
    # max_queries queries (there the CUTLASS kernel writes), and serve the rest; the work list in
    # 16-token slots of each sequence's own (two each) or shared
    q_lens, seq_lens = [1, 20, 8, 0, 9, 3, 11, 60, 60], [40, 20, 31, 5, 9, 3, 30, 70, 64]
    assert pa.work_slots(sum(q_lens), len(q_lens), 16, max_queries) == slots
    problem = make_paged(kernel_device, q_lens=q_lens, seq_lens=seq_lens, hq=4, hkv=2, d=32, bs=8)
    q, cache, bt, cu, sl = problem
    out, lse = _out_buffers(q, q.dtype)
    paged_prefill.run(q, cache.k, cache.v, bt, cu, sl, out=out, lse=lse, max_queries=max_queries)
    rows = torch.repeat_interleave(torch.tensor(q_lens) <= max_queries, torch.tensor(q_lens)).to(kernel_device)
    assert out[~rows].isnan().all() and lse[~rows].isnan().all(), "a longer sequence's rows were written"
    truth_o, truth_l = reference.paged_prefill(q, cache.k, cache.v, bt, cu, sl, compute_dtype=torch.float64)
    base_o, base_l = reference.paged_prefill(q, cache.k, cache.v, bt, cu, sl, compute_dtype=q.dtype)
    assert_error_ratio(out[rows], truth_o[rows], base_o[rows])
    assert_error_ratio(lse[rows], truth_l[rows], base_l[rows], name="lse")


@pytest.mark.parametrize("bs,dtype,layout", [(1, FP16, "HND"), (16, BF16, "vllm")],
                         ids=["bs1-fp16-HND", "bs16-bf16-vllm"])
def test_paged_mixed_batch(kernel_device, small_tiles, bs, dtype, layout):
    rng = random.Random(torch.randint(0, 2**31, ()).item())
    q_lens, seq_lens = mixed_lengths(rng, bs)
    problem = make_paged(kernel_device, q_lens=q_lens, seq_lens=seq_lens, hq=4, hkv=2, d=64, bs=bs,
                         dtype=dtype, layout=layout)
    check_paged(problem, *run_paged(problem))


def test_paged_window_sinks_features(kernel_device, small_tiles):
    # sliding window + sink tokens (sink tiles, leading edge) with ALiBi, softcap, learned sinks,
    # scale and q_scaling; block size 8 < BLOCK_N (per-row page lookups), int64 metadata
    hq = 4
    problem = make_paged(kernel_device, q_lens=[1, 30, 0, 9], seq_lens=[37, 60, 0, 9], hq=hq, hkv=2, d=32,
                         bs=8, index_dtype=torch.int64)
    options = dict(window_left=11, sink_tokens=5, alibi_slopes=reference.alibi_slopes(hq).to(kernel_device),
                   softcap=4.0, sinks=torch.randn(hq, device=kernel_device), scale=0.3, q_scaling=1.5)
    check_paged(problem, *run_paged(problem, functional=True, **options), **options)


@pytest.mark.parametrize("cache_dtype,dtype,per_head", [(E4M3, BF16, True), (E5M2, FP16, False)],
                         ids=["e4m3-per-head-bf16", "e5m2-per-tensor-fp16"])
def test_paged_fp8_cache(kernel_device, small_tiles, cache_dtype, dtype, per_head):
    problem = make_paged(kernel_device, q_lens=[3, 1, 20], seq_lens=[19, 33, 20], hq=4, hkv=2, d=64, bs=16,
                         dtype=dtype, cache_dtype=cache_dtype, fp8_per_head=per_head)
    check_paged(problem, *run_paged(problem))


def test_context_cross_attention(kernel_device):
    # default tiles; MQA; sequence 0 has more queries than keys (its first 4 see nothing under
    # causal bottom-right alignment), sequence 3 has no keys, sequence 4 no queries
    problem = make_context(kernel_device, q_lens=[7, 2, 9, 3, 0], k_lens=[3, 9, 30, 0, 4], hq=4, hkv=1, d=32,
                           dtype=FP16)
    out, lse = run_context(problem, causal=True)
    check("context_attention", problem, out, lse, causal=True)
    assert torch.isinf(lse[:4]).all() and (out[:4] == 0).all()


def test_context_noncausal_window_gqa_chunks(kernel_device, small_tiles):
    # 20 query heads per KV head > BLOCK_M = 16: two head chunks per KV head; D = 80 padded to 128;
    # bf16 inputs, fp32 output
    problem = make_context(kernel_device, q_lens=[5, 11], k_lens=[40, 11], hq=40, hkv=2, d=80)
    options = dict(causal=False, window_left=7, out_dtype=FP32)
    out, lse = run_context(problem, functional=False, **options)
    assert out.dtype == FP32
    check("context_attention", problem, out, lse, **options)


def test_context_fp8_output(kernel_device, small_tiles):
    problem = make_context(kernel_device, q_lens=[9, 0, 20], k_lens=[9, 3, 33], hq=4, hkv=2, d=64)
    options = dict(causal=True, out_scale=torch.tensor(0.03, device=kernel_device))
    out, lse = run_context(problem, functional=False, **options)
    assert out.dtype == E4M3
    check("context_attention", problem, out, lse, **options)


def test_context_fp32(kernel_device, small_tiles):
    problem = make_context(kernel_device, q_lens=[13, 4], k_lens=[29, 4], hq=2, hkv=2, d=32, dtype=FP32)
    out, lse = run_context(problem, causal=True, softcap=6.0)
    check("context_attention", problem, out, lse, causal=True, softcap=6.0)


def test_context_fp8_inputs(kernel_device, small_tiles):
    q, k, v, cq, ck = make_context(kernel_device, q_lens=[6, 17], k_lens=[20, 17], hq=4, hkv=2, d=32)
    scales = dict(q_scale=torch.rand(4, device=kernel_device) * 0.05 + 0.01,
                  k_scale=torch.tensor(0.02, device=kernel_device),
                  v_scale=torch.rand(2, device=kernel_device) * 0.05 + 0.01)
    # quantize_fp8 saturates: a plain cast gives NaN past the e4m3 range on CUDA
    q8, k8, v8 = (quant.quantize_fp8(x, scales[f"{n}_scale"], E4M3) for n, x in zip("qkv", (q, k, v)))
    problem = (q8, k8, v8, cq, ck)
    out, lse = run_context(problem, causal=True, **scales)
    assert out.dtype == BF16
    check("context_attention", problem, out, lse, baseline_dtype=BF16, causal=True, **scales)


# d48 and d80: head dims of two power-of-two parts (`split_dims`), groups across the parts' boundary
@pytest.mark.parametrize("cache_dtype,group,scale_dtype,d", [(INT8, 16, FP32, 64), (INT4, 8, FP16, 32),
                                                             (INT4, 24, FP32, 48), (INT8, 40, FP16, 80)],
                         ids=["int8-g16-d64", "int4-g8-fp16scales-d32", "int4-g24-d48", "int8-g40-d80"])
def test_paged_int_cache(kernel_device, small_tiles, cache_dtype, group, scale_dtype, d):
    problem = make_paged(kernel_device, q_lens=[2, 1, 21], seq_lens=[19, 33, 21], hq=4, hkv=2, d=d, bs=8,
                         dtype=FP16, cache_dtype=cache_dtype, group=group, scale_dtype=scale_dtype, layout="HND")
    check_paged(problem, *run_paged(problem))


MLA_DIMS = pytest.mark.parametrize("d,dv", [(192, 128), (64, 32), (32, 16)], ids=["d192-dv128", "d64-dv32", "d32-dv16"])
CAUSAL = pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])


@MLA_DIMS
@CAUSAL
def test_context_value_head_dim(kernel_device, small_tiles, d, dv, causal):
    # D_v != D (MLA prefill): GQA, cross lengths (a sequence without keys), poisoned [T, Hq, D_v] buffers
    problem = make_context(kernel_device, q_lens=[5, 18, 3], k_lens=[21, 18, 0], hq=4, hkv=2, d=d, dv=dv)
    out, lse = run_context(problem, functional=False, causal=causal)
    assert out.shape == (26, 4, dv)
    check("context_attention", problem, out, lse, causal=causal)


@MLA_DIMS
@CAUSAL
def test_paged_value_head_dim(kernel_device, small_tiles, d, dv, causal):
    # D_v != D over a paged cache: GQA, a decode, a chunk over cached keys, a padding sequence,
    # block size 8 < BLOCK_N (per-row page lookups)
    problem = make_paged(kernel_device, q_lens=[1, 17, 2], seq_lens=[25, 30, 0], hq=4, hkv=2, d=d, bs=8,
                         dtype=FP16, dv=dv)
    out, lse = run_paged(problem, causal=causal)
    assert out.shape == (20, 4, dv)
    check_paged(problem, out, lse, causal=causal)


def test_value_head_dim_fp8_and_rope(kernel_device, small_tiles):
    # D_v != D with an FP8 cache (per-head scales), FP8 context inputs, and RoPE (query and key only)
    problem = make_paged(kernel_device, q_lens=[3, 14], seq_lens=[19, 14], hq=4, hkv=2, d=64, bs=16,
                         cache_dtype=E4M3, fp8_per_head=True, dv=32)
    check_paged(problem, *run_paged(problem))
    q, k, v, cq, ck = make_context(kernel_device, q_lens=[6, 17], k_lens=[20, 17], hq=4, hkv=2, d=64, dv=32)
    scales = {f"{n}_scale": torch.rand((), device=kernel_device) * 0.05 + 0.01 for n in "qkv"}
    fp8 = tuple(quant.quantize_fp8(x, scales[f"{n}_scale"], E4M3) for n, x in zip("qkv", (q, k, v)))
    out, lse = run_context((*fp8, cq, ck), causal=True, **scales)
    check("context_attention", (*fp8, cq, ck), out, lse, baseline_dtype=BF16, causal=True, **scales)
    self_attn = make_context(kernel_device, q_lens=[9, 14], k_lens=[9, 14], hq=4, hkv=2, d=64, dv=32)
    rope = dict(positions=torch.randint(0, 64, (23,), device=kernel_device),
                cos_sin_cache=reference.rope_cos_sin_cache(64, 16).to(kernel_device), causal=True)
    check("context_attention", self_attn, *run_context(self_attn, functional=False, **rope), **rope)


def test_unsupported_reasons():
    q = torch.randn(3, 4, 64, dtype=BF16)
    for dtype in (BF16, E4M3, E5M2, INT8, INT4):
        assert pa.unsupported(q, dtype) == []
    assert "head dim 512" in " ".join(pa.unsupported(torch.randn(3, 4, 512, dtype=BF16), BF16))
    assert pa.unsupported(q, BF16, 32) == []
    assert "value head dim 512" in " ".join(pa.unsupported(q, BF16, 512))
    from torch_ops.kernels.triton import context_attention
    big = torch.randn(3, 4, 512, dtype=BF16)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    assert context_attention.unsupported(big, big, big, cu, cu, causal=True, out=None, lse=None)


def test_config_heuristic():
    for d in (32, 64, 80, 96, 128, 256):
        for dtype in (FP16, BF16, FP32):
            for causal in (False, True):
                for paged in (False, True):
                    cfg = pa.config(d, dtype, causal, paged)
                    assert cfg["BLOCK_M"] in (16, 32, 64, 128) and cfg["BLOCK_N"] in (16, 32, 64, 128)
                    assert cfg["num_warps"] in (4, 8) and 2 <= cfg["num_stages"] <= 5
    assert pa.config(128, BF16, True, True, rows_per_seq=4)["BLOCK_M"] == 16       # a decode batch
    assert pa.config(128, BF16, True, True, rows_per_seq=4096)["BLOCK_M"] == 128
    assert pa._smaller({"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3})["num_stages"] == 2
    assert pa._smaller({"BLOCK_M": 128, "BLOCK_N": 16, "num_warps": 8, "num_stages": 2}) is None
    assert [pa.split_dims(d) for d in (48, 64, 80, 96, 112, 128, 192)] == [32, 0, 64, 64, 0, 0, 128]


# ---- GPU: the broad matrix ---------------------------------------------------------------------


def _gpu_lengths(rng: random.Random, bs: int) -> tuple[list[int], list[int]]:
    """A ragged mixed batch: decodes, chunked prefills over cached prefixes, full prefills, length-0
    and padding sequences, page-boundary lengths, one long-ish sequence; shuffled."""
    seqs = [(1, rng.randint(1, 900)), (1, bs), (1, 1), (bs, bs + 1), (rng.randint(2, 140), rng.randint(600, 1500)),
            (r := rng.randint(100, 700), r), (0, 0), (5, 0), (0, 77), (bs + 1, bs + 1),
            (1000, 1000 + rng.randint(0, 300))]
    rng.shuffle(seqs)
    return [s[0] for s in seqs], [s[1] for s in seqs]


# (head dim, block size, (Hq, Hkv), cache dtype, query dtype, extra)
PAGED_MATRIX = [
    (64, 16, (8, 8), BF16, BF16, {}),
    (64, 1, (8, 2), FP16, FP16, {"layout": "HND"}),
    (80, 16, (8, 2), BF16, BF16, {"layout": "combined_NHD"}),
    (96, 7, (12, 4), FP16, FP16, {"layout": "combined_HND"}),
    (128, 16, (32, 8), BF16, BF16, {"layout": "vllm"}),
    (128, 32, (16, 2), BF16, BF16, {"index_dtype": torch.int64}),
    (128, 64, (8, 1), FP16, FP16, {}),
    (128, 256, (8, 2), BF16, BF16, {}),
    (128, 48, (40, 1), BF16, BF16, {}),                            # 40 heads per KV head: 3 tokens x 40 per tile
    (256, 16, (8, 2), BF16, BF16, {}),
    (256, 128, (4, 4), FP16, FP16, {"layout": "HND"}),
    (128, 16, (32, 8), E4M3, BF16, {}),
    (128, 64, (16, 4), E4M3, FP16, {"fp8_per_head": True}),
    (64, 5, (8, 2), E5M2, BF16, {"fp8_per_head": True, "layout": "HND"}),
    (256, 32, (8, 1), E4M3, BF16, {}),
    (80, 1, (4, 2), E5M2, FP16, {}),
    (128, 16, (8, 2), FP32, FP32, {}),
    (128, 16, (32, 8), INT8, BF16, {"group": 32, "scale_dtype": FP16}),
    (96, 7, (8, 2), INT8, FP16, {"group": 24}),
    (128, 64, (16, 4), INT4, BF16, {"group": 32, "scale_dtype": FP16, "layout": "vllm"}),
    (256, 16, (8, 1), INT4, FP16, {"group": 128}),
    (64, 1, (4, 2), INT4, BF16, {"group": 8}),
]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d,bs,heads,cache_dtype,dtype,extra", PAGED_MATRIX,
                         ids=[f"d{c[0]}-bs{c[1]}-h{c[2][0]}x{c[2][1]}-{str(c[3])[6:]}-{str(c[4])[6:]}"
                              for c in PAGED_MATRIX])
def test_paged_matrix(kernel_device, d, bs, heads, cache_dtype, dtype, extra, causal):
    rng = random.Random(torch.randint(0, 2**31, ()).item())
    q_lens, seq_lens = _gpu_lengths(rng, bs)
    problem = make_paged(kernel_device, q_lens=q_lens, seq_lens=seq_lens, hq=heads[0], hkv=heads[1], d=d, bs=bs,
                         dtype=dtype, cache_dtype=cache_dtype, share_prefix=True, **extra)
    check_paged(problem, *run_paged(problem, causal=causal), causal=causal)


# (head dim, (Hq, Hkv), dtype, q_lens, k_lens)
CONTEXT_MATRIX = [
    (64, (16, 16), BF16, [513, 1, 0, 1000, 64], [513, 1, 5, 1000, 64]),
    (80, (8, 2), FP16, [300, 77, 1], [300, 77, 1]),
    (96, (12, 3), BF16, [129, 640, 3], [129, 640, 3]),
    (128, (32, 8), BF16, [2048, 1, 333], [2048, 1, 333]),
    (128, (8, 8), FP16, [100, 700, 5], [900, 30, 0]),              # cross-attention, a no-key sequence
    (256, (8, 2), BF16, [700, 65, 0], [700, 65, 0]),
    (256, (4, 1), FP16, [50, 300], [400, 20]),
    (128, (4, 2), FP32, [300, 17], [300, 50]),
    (64, (64, 1), BF16, [200, 3], [200, 3]),
    (64, (256, 1), FP16, [100, 1], [100, 9]),                       # 256 heads per KV head: 2 head chunks
]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d,heads,dtype,q_lens,k_lens", CONTEXT_MATRIX,
                         ids=[f"d{c[0]}-h{c[1][0]}x{c[1][1]}-{str(c[2])[6:]}-{len(c[3])}seq" for c in CONTEXT_MATRIX])
def test_context_matrix(kernel_device, d, heads, dtype, q_lens, k_lens, causal):
    problem = make_context(kernel_device, q_lens=q_lens, k_lens=k_lens, hq=heads[0], hkv=heads[1], d=d, dtype=dtype)
    out, lse = run_context(problem, functional=False, causal=causal)
    check("context_attention", problem, out, lse, causal=causal)


FEATURES = {
    **samples.FEATURES,
    "window0": lambda hq, dev: {"window_left": 0},
    "window_many_sinks": lambda hq, dev: {"window_left": 64, "sink_tokens": 300},
    "all": lambda hq, dev: dict(samples.FEATURES["all"](hq, dev), scale=0.1),
}


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [BF16, E4M3], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_paged_features(kernel_device, feature, cache_dtype):
    hq = 16
    rng = random.Random(torch.randint(0, 2**31, ()).item())
    q_lens, seq_lens = _gpu_lengths(rng, 16)
    problem = make_paged(kernel_device, q_lens=q_lens, seq_lens=seq_lens, hq=hq, hkv=4, d=128, bs=16,
                         cache_dtype=cache_dtype)
    options = FEATURES[feature](hq, kernel_device)
    check_paged(problem, *run_paged(problem, **options), **options)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("feature", ["alibi", "window_sinks", "learned_sinks", "softcap", "out_scale", "all"])
def test_context_features(kernel_device, feature, causal):
    hq = 8
    problem = make_context(kernel_device, q_lens=[700, 1, 90, 0], k_lens=[700, 300, 1200, 9], hq=hq, hkv=2, d=64)
    options = dict(FEATURES[feature](hq, kernel_device), causal=causal)
    out, lse = run_context(problem, **options)
    check("context_attention", problem, out, lse, **options)


@pytest.mark.gpu
@pytest.mark.parametrize("per_head", [False, True])
def test_context_fp8_inputs_gpu(kernel_device, per_head):
    q, k, v, cq, ck = make_context(kernel_device, q_lens=[1000, 3, 257], k_lens=[1000, 600, 257], hq=16, hkv=4, d=128)
    def scale(heads):
        if per_head:
            return torch.rand(heads, device=kernel_device) * 0.05 + 0.01
        return torch.tensor(0.02, device=kernel_device)

    scales = dict(q_scale=scale(16), k_scale=scale(4), v_scale=scale(4))
    problem = (*(quant.quantize_fp8(x, scales[f"{n}_scale"], E4M3) for n, x in zip("qkv", (q, k, v))), cq, ck)
    out, lse = run_context(problem, causal=True, **scales)
    check("context_attention", problem, out, lse, baseline_dtype=BF16, causal=True, **scales)


@pytest.mark.gpu
def test_long_sequences(kernel_device):
    # an 8k causal prefill, and a 2k chunk over a 6k cached prefix next to decodes
    problem = make_context(kernel_device, q_lens=[8192], k_lens=[8192], hq=4, hkv=1, d=128)
    out, lse = run_context(problem, causal=True)
    check("context_attention", problem, out, lse, causal=True)
    problem = make_paged(kernel_device, q_lens=[2048, 1, 1], seq_lens=[8192, 5000, 3], hq=8, hkv=2, d=128, bs=16)
    check_paged(problem, *run_paged(problem))


@pytest.mark.gpu
def test_cache_over_2g_elements(kernel_device):
    # an FP8 cache of 2.3e9 elements per tensor; the sequences live in its last blocks
    nb = (2**31 // (16 * 8 * 128)) + 4096
    problem = make_paged(kernel_device, q_lens=[300, 1], seq_lens=[1000, 77], hq=32, hkv=8, d=128, bs=16,
                         cache_dtype=E4M3, num_blocks=nb, high_block_ids=True)
    assert problem[1].k.numel() > 2**31
    check_paged(problem, *run_paged(problem))


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [BF16, E4M3], ids=["bf16", "e4m3"])
def test_cuda_graph_replay(kernel_device, cache_dtype):
    """Capture one paged_prefill call for a fixed token budget; write new lengths, cu_seqlens, block
    tables and queries into the captured tensors, replay, and compare with eager calls on the same
    inputs (same grid: bit-identical) and with the reference. The last sequence pads the budget."""
    dev = kernel_device
    B, T, hq, hkv, d, bs, max_blocks = 6, 256, 16, 4, 128, 16, 64
    nb = B * max_blocks + 8
    cache = kv_cache.PagedKVCache.allocate(nb, bs, hkv, d, cache_dtype, device=dev)
    kv_cache.random_(cache)
    q = torch.randn(T, hq, d, dtype=BF16, device=dev)
    cu = torch.zeros(B + 1, dtype=torch.int32, device=dev)
    sl = torch.zeros(B, dtype=torch.int32, device=dev)
    bt = torch.zeros(B, max_blocks, dtype=torch.int32, device=dev)
    out = torch.empty(q.shape, dtype=BF16, device=dev)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=dev)
    rng = random.Random(torch.randint(0, 2**31, ()).item())

    def fill(step):
        q_lens = [1 if rng.random() < 0.5 else rng.randint(1, 40) for _ in range(B - 1)]
        seq_lens = [ql + rng.randint(0, max_blocks * bs - ql) for ql in q_lens]
        if step == 0:
            q_lens, seq_lens = [1] * (B - 1), [2] * (B - 1)
        q_lens.append(T - sum(q_lens))     # padding rows: no keys
        seq_lens.append(0)
        cu.copy_(cumsum0(q_lens, dev))
        sl.copy_(torch.tensor(seq_lens))
        bt.copy_(torch.randperm(nb)[: B * max_blocks].view(B, max_blocks))
        q.normal_()

    def call():
        with torch_ops.use_backend("triton"):
            torch.ops.attn.paged_prefill.out(q, cache.k, cache.v, bt, cu, sl, out=out, lse=lse, **cache.scale_kwargs())

    def check_replay(g_out, g_lse):
        check_paged((q, cache, bt, cu, sl), g_out, g_lse)
        assert math.isinf(g_lse[-1, 0].item()) and (g_out[-1] == 0).all()

    assert_replays_match_eager(call, fill, (out, lse), check_replay)


# ---- RoPE (context_attention's pre-kernel) -----------------------------------------------------


def rope_options(device, d, rot, neox, t, max_position=64, cache_dtype=FP32):
    """Random positions (within the cache) and the standard cos/sin cache of width `rot`."""
    cache = reference.rope_cos_sin_cache(max_position, rot).to(device=device, dtype=cache_dtype)
    positions = torch.randint(0, max_position, (t,), dtype=torch.int32, device=device)
    return dict(positions=positions, cos_sin_cache=cache, rope_neox=neox)


@pytest.mark.parametrize("neox,rot,dtype", [(True, 32, BF16), (False, 16, FP16), (True, 8, FP32)],
                         ids=["neox-full-bf16", "gptj-partial-fp16", "neox-partial-fp32"])
def test_context_rope(kernel_device, small_tiles, neox, rot, dtype):
    lens = [9, 0, 21]
    problem = make_context(kernel_device, q_lens=lens, k_lens=lens, hq=4, hkv=2, d=32, dtype=dtype)
    options = dict(causal=True, **rope_options(kernel_device, 32, rot, neox, sum(lens)))
    out, lse = run_context(problem, functional=False, **options)
    check("context_attention", problem, out, lse, **options)


def test_rope_pre_kernel_matches_reference_bitwise(kernel_device):
    # 20 tokens (two programs, the second partial), D = 48 (padded to 64), GPT-J and NeoX, partial
    # rotary; one position past the table (clamped to its last row in both); bf16 rounding must
    # agree exactly
    from torch_ops.kernels.triton import context_attention as ca
    x = torch.randn(20, 3, 48, dtype=BF16, device=kernel_device)
    for neox in (True, False):
        opts = rope_options(kernel_device, 48, 24, neox, 20, cache_dtype=BF16)
        opts["positions"][7] = 64
        got = ca.rope(x, opts["positions"], opts["cos_sin_cache"], neox)
        want = reference.apply_rope(x, opts["positions"], opts["cos_sin_cache"], neox).to(BF16)
        assert torch.equal(got, want), f"neox={neox}: {(got.float() - want.float()).abs().max()}"


def test_reference_rope_is_rotation_then_attention():
    # the reference's RoPE option equals rotating q and k by hand (complex multiplication) first
    q, k, v, cu, _ = make_context("cpu", q_lens=[5, 6], k_lens=[5, 6], hq=2, hkv=1, d=8, dtype=FP32)
    positions = torch.randint(0, 30, (11,))
    cache = reference.rope_cos_sin_cache(30, 8)
    c, s = cache[positions].double().chunk(2, -1)
    turn = torch.polar(torch.ones_like(c), torch.atan2(s, c))                  # [11, 4] complex

    def rotate_gptj(x):
        pairs = torch.view_as_complex(x.double().unflatten(-1, (4, 2)).contiguous())
        return torch.view_as_real(pairs * turn[:, None]).flatten(-2)

    got = reference.context_attention(q, k, v, cu, cu, causal=True, positions=positions, cos_sin_cache=cache,
                                      rope_neox=False, compute_dtype=torch.float64)
    want = reference.context_attention(rotate_gptj(q), rotate_gptj(k), v.double(), cu, cu, causal=True,
                                       compute_dtype=torch.float64)
    # the reference rotates fp32 inputs in fp32 (the kernels' order), `want` in float64: fp32
    # rounding apart (~1e-7, which failed float64's default tolerance now and then); a wrong
    # pairing or sign would be off by O(1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change,error,match", [
    (dict(cos_sin_cache=None), ValueError, "both positions and cos_sin_cache"),
    (dict(positions=torch.zeros(5, dtype=torch.int32)), ValueError, "positions must have shape"),
    (dict(positions=torch.zeros(8)), TypeError, "positions must have dtype"),
    (dict(cos_sin_cache=torch.zeros(4, 7)), ValueError, "rotary_dim"),
    (dict(cos_sin_cache=torch.zeros(4, 18)), ValueError, "rotary_dim"),
    (dict(key_tokens=6), ValueError, "self-attention"),
])
def test_context_rope_bad_input(change, error, match):
    key_tokens = change.pop("key_tokens", 8)
    q, k, v, cq, ck = make_context("cpu", q_lens=[8], k_lens=[key_tokens], hq=2, hkv=1, d=16, dtype=FP16)
    options = {"positions": torch.zeros(8, dtype=torch.int32), "cos_sin_cache": torch.zeros(4, 16), **change}
    with pytest.raises(error, match=match):
        torch.ops.attn.context_attention(q, k, v, cq, ck, **options)


@pytest.mark.gpu
@pytest.mark.parametrize("neox,rot", [(True, 128), (True, 64), (False, 128), (False, 32)])
def test_context_rope_gpu(kernel_device, neox, rot):
    lens = [2048, 1, 333]
    problem = make_context(kernel_device, q_lens=lens, k_lens=lens, hq=32, hkv=8, d=128)
    options = dict(causal=True, **rope_options(kernel_device, 128, rot, neox, sum(lens), max_position=4096))
    out, lse = run_context(problem, **options)
    check("context_attention", problem, out, lse, **options)


def test_context_rope_opcheck():
    lens = [4, 7]
    problem = make_context("cpu", q_lens=lens, k_lens=lens, hq=4, hkv=2, d=16)
    options = dict(causal=True, **rope_options("cpu", 16, 8, False, sum(lens)))
    torch.library.opcheck(torch.ops.attn.context_attention.default, problem, options)


@pytest.mark.parametrize("op", ["context_attention", "paged_prefill"])
def test_key_mask_hides_the_keys_it_marks_false(kernel_device, op):
    """`key_mask [T, N]` (keys indexed within each sequence): a row sees only its true keys, on
    top of causality; a row with none gets zeros and -inf."""
    args, kwargs = samples.sample(op, "causal" if op == "context_attention" else "mixed")
    args = tuple(a.to(kernel_device) for a in args)
    kwargs = {k: v.to(kernel_device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    mask = torch.rand(args[0].shape[0], 12, device=kernel_device) < 0.6
    mask[0] = False
    with torch_ops.use_backend("triton"):
        out, lse = getattr(torch.ops.attn, op)(*args, **kwargs, key_mask=mask)
    check(op, args, out, lse, **kwargs, key_mask=mask)
    assert (out[0].float() == 0).all() and (lse[0] == float("-inf")).all()
