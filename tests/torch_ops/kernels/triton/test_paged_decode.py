"""The Triton `attn::paged_decode` kernel against the reference (docs/ops.md).

Truth is `reference.paged_decode(..., compute_dtype=float64)` on the same (quantized) cache; the
baseline is the same with the query dtype, and `assert_error_ratio` bounds our error by twice the
baseline's plus the output's rounding floor. Every call goes through `torch.ops.attn.paged_decode.out`
inside `use_backend("triton")` with NaN-poisoned `out`/`lse`, so an unwritten element fails.

On CPU the kernel runs in Triton's interpreter (a few tiny cases, split-K forced through the
module's knobs); the broad matrix, CUDA graphs and >2^31-element caches are marked `gpu`.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import torch_ops
from torch_ops import kv_cache, quant, reference
from torch_ops.kernels.triton import paged_decode as pd
from torch_ops.testing import assert_error_ratio, assert_replays_match_eager, max_error, poison_

from ... import samples

pytestmark = pytest.mark.usefixtures("poisoned_workspace")

BF16, FP16 = torch.bfloat16, torch.float16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
INT8, INT4 = torch.int8, torch.uint8
UNUSED_BLOCK = 2**30 - 1   # block-table entries past a sequence's length: reading one would fault


# ---- problem construction ----------------------------------------------------------------------


def make_problem(device, *, lens, hq, hkv, d, bs, qps=1, dtype=BF16, cache_dtype=None, layout="NHD",
                 group=None, scale_dtype=torch.float32, fp8_per_head=False, share_prefix=False,
                 spare_blocks=3, index_dtype=torch.int32, num_blocks=None, high_block_ids=False):
    """A random paged problem: cache filled through its format's quantizer, each sequence on a
    random permutation of blocks (optionally sequence 1 reusing sequence 0's first blocks)."""
    cache_dtype = cache_dtype or dtype
    per_seq = [-(-n // bs) for n in lens]
    max_blocks = max(per_seq + [1]) + 1
    needed = sum(per_seq) + spare_blocks
    nb = num_blocks or needed
    fp8_scale = torch.ones(hkv) if fp8_per_head and cache_dtype in (E4M3, E5M2) else None
    cache = kv_cache.PagedKVCache.allocate(nb, bs, hkv, d, cache_dtype, layout=layout, quant_group=group,
                                           scale_dtype=scale_dtype, fp8_scale=fp8_scale, device=device)
    kv_cache.random_(cache)
    ids = torch.randperm(needed).tolist()
    if high_block_ids:
        ids = [nb - 1 - i for i in ids]
    table = torch.full((len(lens), max_blocks), UNUSED_BLOCK, dtype=torch.int64)
    for b, n in enumerate(per_seq):
        table[b, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int64)
    if share_prefix and len(lens) > 1:
        shared = min(per_seq[0], per_seq[1]) - 1
        table[1, :max(shared, 0)] = table[0, :max(shared, 0)]
    q = torch.randn(len(lens) * qps, hq, d, dtype=dtype, device=device)
    return (q, cache, table.to(device=device, dtype=index_dtype),
            torch.tensor(lens, dtype=index_dtype, device=device))


def call_triton(q, cache, block_tables, seq_lens, **options):
    out_dtype = E4M3 if options.get("out_scale") is not None else q.dtype
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    poison_(out)
    poison_(lse)
    with torch_ops.use_backend("triton"):
        torch.ops.attn.paged_decode.out(q, cache.k, cache.v, block_tables, seq_lens, out=out, lse=lse,
                                        **cache.scale_kwargs(), **options)
    return out, lse


def check(q, cache, block_tables, seq_lens, out, lse, **options):
    """Our (out, lse) against the float64 truth, with the error-ratio tolerance."""
    kw = dict(cache.scale_kwargs(), **options)
    out_scale = kw.pop("out_scale", None)
    args = (cache.k, cache.v, block_tables, seq_lens)
    truth_o, truth_l = reference.paged_decode(q, *args, compute_dtype=torch.float64, **kw)  # unrounded fp64
    base_o, base_l = reference.paged_decode(q, *args, compute_dtype=q.dtype, **kw)
    if cache.format != quant.KVFormat.PLAIN and cache.k.numel() <= 2**28:
        # The kernels round the dequantized cache to the query dtype, as the baseline does. At
        # fp16 queries that rounding alone can exceed the baseline's total error, whose other
        # roundings partly cancel it (lse 1.66e-3 against 7.9e-4, H200, 1 seed in 150): bound by
        # the larger of the two errors. (Not for the >2^31-element cache: a dequantized copy.)
        plain = [x.to(q.dtype) for x in cache.dequantized()]
        plain_kw = {k: v for k, v in kw.items() if k not in ("k_scale", "v_scale")}
        round_o, round_l = reference.paged_decode(q, *plain, block_tables, seq_lens, compute_dtype=torch.float64,
                                                  **plain_kw)
        if max_error(round_o, truth_o) > max_error(base_o, truth_o):
            base_o = round_o
        if max_error(round_l, truth_l) > max_error(base_l, truth_l):
            base_l = round_l
    assert not torch.isnan(out.float()).any(), "out has NaN (unwritten or bad masking)"
    assert not torch.isnan(lse).any(), "lse has NaN"
    if out_scale is not None:
        # compare the FP8 output with the unquantized truth, the floor being FP8's rounding
        s = out_scale.double()
        assert_error_ratio(out.double(), truth_o.double() / s, base_o.double() / s,
                           floor=2 * _fp8_rounding(truth_o.double() / s) + 1e-6, name="fp8 out")
    else:
        assert_error_ratio(out, truth_o, base_o)
    assert_error_ratio(lse, truth_l, base_l, name="lse")
    empty = (seq_lens == 0).repeat_interleave(q.shape[0] // max(1, seq_lens.shape[0]))
    if empty.any():
        assert (out[empty].float() == 0).all()
        want = options["sinks"].expand(int(empty.sum()), -1) if options.get("sinks") is not None else -math.inf
        torch.testing.assert_close(lse[empty], torch.as_tensor(want, device=lse.device).expand_as(lse[empty]).float())


def _fp8_rounding(x: torch.Tensor) -> float:
    m = torch.finfo(E4M3).max
    x = x.clamp(-m, m)
    return (x.to(E4M3).double() - x).abs().max().item() if x.numel() else 0.0


def prepared(problem, **options):
    """The kernel's prepared launch of the problem's signature (its `num_splits`, `kernels`)."""
    q, cache, bt, sl = problem
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], device=q.device)
    return pd.prepare(q, cache.k, cache.v, bt, sl, out=out, lse=lse, **cache.scale_kwargs(), **options)


def run_and_check(problem, **options):
    q, cache, bt, sl = problem
    out, lse = call_triton(q, cache, bt, sl, **options)
    check(q, cache, bt, sl, out, lse, **options)
    return out, lse


# ---- CPU (interpreter) cases: few and tiny -----------------------------------------------------


def test_merge_of_many_splits_in_head_dim_blocks(kernel_device, knobs):
    # 40 splits x D = 128 exceed one merge tile (`Tuning.merge_tile`): the merge programs take 64 dims each
    knobs(num_splits=40, min_split_tokens=16, config={"BLOCK_N": 16, "num_warps": 4, "num_stages": 2})
    run_and_check(make_problem(kernel_device, lens=[700, 0, 17, 333], hq=4, hkv=1, d=128, bs=16))


@pytest.mark.parametrize("bs,block_n,qps,layout", [(16, 16, 1, "NHD"), (5, 16, 3, "HND"), (32, 16, 2, "vllm")])
def test_plain_gqa_split(kernel_device, knobs, bs, block_n, qps, layout):
    # odd lengths around the block size, a length-0 padding sequence, split-K on 16-key splits
    knobs(num_splits=3, min_split_tokens=16, config={"BLOCK_N": block_n, "num_warps": 4, "num_stages": 2})
    lens = [bs + 1, 0, 41, max(qps, bs - 1)]
    run_and_check(make_problem(kernel_device, lens=lens, hq=4, hkv=2, d=64, bs=bs, qps=qps, layout=layout))


def test_fp8_per_head_fp16(kernel_device, knobs):
    knobs(num_splits=2, min_split_tokens=16, config={"BLOCK_N": 16, "num_warps": 4, "num_stages": 2})
    problem = make_problem(kernel_device, lens=[37, 1, 19], hq=4, hkv=2, d=64, bs=8, dtype=FP16,
                           cache_dtype=E4M3, fp8_per_head=True)
    run_and_check(problem)


def test_int4_groups_no_split(kernel_device, knobs):
    knobs(num_splits=1, config={"BLOCK_N": 16, "num_warps": 4, "num_stages": 2})
    problem = make_problem(kernel_device, lens=[23, 0, 16], hq=4, hkv=1, d=64, bs=16, qps=2,
                           cache_dtype=INT4, group=16, scale_dtype=torch.float16)
    run_and_check(problem)


def test_quantized_rows_in_two_m_tiles(kernel_device, knobs):
    # 8 query heads x 8 new tokens on one KV head: 64 rows, two 32-row tiles for quantized caches
    knobs(num_splits=2, min_split_tokens=16, config={"BLOCK_N": 16, "num_warps": 4, "num_stages": 2})
    problem = make_problem(kernel_device, lens=[30, 8], hq=8, hkv=1, d=64, bs=8, qps=8, cache_dtype=INT4, group=16)
    run_and_check(problem)


def test_int8_features(kernel_device, knobs):
    # window + sink tokens + ALiBi + softcap + learned sinks + FP8 output, split-K, one page per tile
    knobs(num_splits=2, min_split_tokens=16, config={"BLOCK_N": 16, "num_warps": 4, "num_stages": 2})
    problem = make_problem(kernel_device, lens=[53, 0, 7], hq=4, hkv=2, d=64, bs=16, qps=2,
                           cache_dtype=INT8, group=32)
    hq = 4
    run_and_check(problem, window_left=20, sink_tokens=3, alibi_slopes=reference.alibi_slopes(hq).to(kernel_device),
                  softcap=5.0, sinks=torch.randn(hq, device=kernel_device), out_scale=torch.tensor(0.05, device=kernel_device),
                  scale=0.2, q_scaling=1.5)


@pytest.mark.parametrize("cache_dtype,group,bs,qps,replicas,rows32", [
    (BF16, None, 16, 2, 4, False), (E4M3, None, 5, 1, 4, True), (E4M3, None, 32, 2, 2, True),
    (INT8, 32, 48, 1, 2, True), (INT4, 16, 8, 3, 2, False)])
def test_replicated_rows(kernel_device, knobs, cache_dtype, group, bs, qps, replicas, rows32):
    # one-warp programs scoring `replicas` key tiles side by side (each in its own copy of the
    # query rows), merged in the epilogue; every masking feature, split-K, whole and partial
    # pages, single-page tiles addressed by 64-bit rows or by a base pointer and 32-bit rows
    knobs(num_splits=3, min_split_tokens=16,
          config={"BLOCK_N": 16, "num_warps": 1, "num_stages": 2, "replicas": replicas, "rows32": rows32})
    hq = 4
    problem = make_problem(kernel_device, lens=[150, 0, 3, 67], hq=hq, hkv=2, d=64, bs=bs, qps=qps,
                           cache_dtype=cache_dtype, group=group, fp8_per_head=True)
    run_and_check(problem)
    run_and_check(problem, window_left=40, sink_tokens=5, alibi_slopes=reference.alibi_slopes(hq).to(kernel_device),
                  softcap=5.0, sinks=torch.randn(hq, device=kernel_device), out_scale=torch.tensor(0.05, device=kernel_device))


@pytest.mark.parametrize("d,bs,cache_dtype,group", [(80, 7, INT4, 16), (96, 1, INT8, 24), (64, 3, E5M2, None)])
def test_odd_dims_groups_pages(kernel_device, knobs, d, bs, cache_dtype, group):
    # non-power-of-2 head dims, a gathered (non 4 x 2^k) scale group, e5m2, tiny pages
    knobs(num_splits=2, min_split_tokens=16, config={"BLOCK_N": 16, "num_warps": 4, "num_stages": 2})
    problem = make_problem(kernel_device, lens=[29, 2], hq=4, hkv=2, d=d, bs=bs, cache_dtype=cache_dtype,
                           group=group, fp8_per_head=True)
    run_and_check(problem)


def static_cache_problem(device, *, lens, capacity, hq, hkv, d, qps=1):
    """A contiguous per-sequence cache `[B, Hkv, S, D]` (Hugging Face's StaticCache layout) as one
    page of S = `capacity` tokens per sequence: the `[B, S, Hkv, D]` view, block table `[[0], [1], ...]`."""
    b = len(lens)
    k, v = (torch.randn(b, hkv, capacity, d, dtype=BF16, device=device) for _ in range(2))
    cache = kv_cache.PagedKVCache(k.transpose(1, 2), v.transpose(1, 2))
    table = torch.arange(b, dtype=torch.int32, device=device).unsqueeze(1)
    q = torch.randn(b * qps, hq, d, dtype=BF16, device=device)
    return q, cache, table, torch.tensor(lens, dtype=torch.int32, device=device)


@pytest.mark.parametrize("cache_dtype,group", [(BF16, None), (E4M3, None), (INT8, 32), (INT4, 16)],
                         ids=["bf16", "fp8", "int8", "int4"])
def test_scores_ramping_up_and_down(kernel_device, knobs, cache_dtype, group):
    # scores rising by ~3 (log2 units) per 16-key tile, so that the online softmax rescales the
    # accumulators at every tile, and falling (the running max is set by the first tile)
    knobs(num_splits=1, config={"BLOCK_N": 16, "num_warps": 4, "num_stages": 2})
    lens = [150, 150]
    q, cache, bt, sl = make_problem(kernel_device, lens=lens, hq=4, hkv=2, d=64, bs=16, cache_dtype=cache_dtype,
                                    group=group)
    u = torch.randn(64, dtype=torch.float64)
    u /= u.norm()
    t = torch.arange(150, dtype=torch.float64)
    ramp = torch.stack([t, 150 - t]) * 0.13                       # sequence 0 up, sequence 1 down
    key = (ramp[:, :, None, None] * u + 0.05 * torch.randn(2, 150, 2, 64, dtype=torch.float64)).to(BF16)
    value = torch.randn(2, 150, 2, 64, dtype=BF16)
    slots = torch.stack([bt[b, t.long() // 16].long().cpu() * 16 + t.long() % 16 for b in range(2)])
    reference.kv_cache_write(key.reshape(300, 2, 64).to(kernel_device), value.reshape(300, 2, 64).to(kernel_device),
                             cache.k, cache.v, slots.reshape(300).to(kernel_device), **cache.scale_kwargs())
    q = (u * 8).to(BF16).expand(2, 4, 64).contiguous().to(kernel_device)
    run_and_check((q, cache, bt, sl))


def test_one_page_per_sequence(kernel_device, knobs):
    # pages longer than 256 and not a multiple of the tile: one table load per tile all the same
    knobs(num_splits=2, min_split_tokens=16, config={"BLOCK_N": 16, "num_warps": 4, "num_stages": 2})
    run_and_check(static_cache_problem(kernel_device, lens=[300, 0, 17], capacity=301, hq=4, hkv=2, d=32, qps=2))


def test_unsupported_reasons(kernel_device):
    q = torch.randn(2, 4, 512, dtype=BF16)
    cache = torch.empty(4, 16, 2, 512, dtype=BF16)
    bt, sl = torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    why = pd.unsupported(q, cache, cache, bt, sl)
    assert why and "head dim 512" in why[0]
    q = torch.randn(2, 4, 256, dtype=BF16)
    cache = torch.empty(4, 16, 2, 256, dtype=BF16)
    assert pd.unsupported(q, cache, cache, bt, sl) == []
    q = torch.randn(2, 4, 18, dtype=BF16)
    cache = torch.empty(4, 16, 2, 18, dtype=E4M3)
    assert "divisible by 4" in " ".join(pd.unsupported(q, cache, cache, bt, sl))


def test_split_count_depends_on_shapes_only():
    def f(*args):
        return pd.split_count(*args, 132, 4)

    assert f(256, 8, 1, 64, 16, 64, 4) == 1                    # many programs: no split
    assert f(1, 8, 1, 2048, 16, 64, 4) > 8                      # one long sequence: split wide
    assert f(1, 8, 1, 4, 16, 64, 4) == 1                        # 64-key table: nothing to split
    assert 1 <= f(16, 8, 1, 256, 16, 64, 4) <= pd.tuning.current.max_splits
    assert f(64, 8, 1, 256, 16, 32, 4) == 1                     # 512 programs fill 528 slots: one wave


def test_large_tiles_when_the_batch_nearly_fills_the_gpu():
    assert pd.large_tile_splits(256, 132) == 1     # B = 32 x 8 KV heads: one split
    assert pd.large_tile_splits(128, 132) == 2     # just below one program per SM: two
    assert pd.large_tile_splits(8, 132) == 0       # a long context at B = 1: many small splits
    assert pd.large_tile_splits(512, 132) == 0     # more than a wave of large tiles: small ones


def test_large_tiles_automatic(kernel_device):
    # no knobs: 4 programs on the interpreter's 8 "SMs" take 128-key tiles in two splits (a table
    # longer than `Tuning.short_context`'s)
    problem = make_problem(kernel_device, lens=[1259, 0, 5, 130], hq=4, hkv=1, d=64, bs=16)
    run_and_check(problem)
    assert prepared(problem).num_splits == 2


@pytest.mark.parametrize("d", [64, 128])
def test_short_context_on_large_tiles_takes_one_split(kernel_device, knobs, d):
    # 4 programs on the interpreter's 8 "SMs", a 272-key table: one split, no merge
    problem = make_problem(kernel_device, lens=[259, 0, 5, 130], hq=4, hkv=1, d=d, bs=16)
    run_and_check(problem)
    assert prepared(problem).num_splits == 1
    knobs(short_context={})
    run_and_check(problem)
    assert prepared(problem).num_splits == 2


@pytest.mark.parametrize("cache_dtype", [E4M3, INT4])
def test_quantized_short_table_on_a_full_grid_takes_one_split(kernel_device, knobs, cache_dtype):
    # 8 programs on the interpreter's 8 "SMs": a 256-key table takes one split; past
    # `Tuning.quantized_one_split_keys` the split heuristic splits it
    problem = make_problem(kernel_device, lens=[240, 0, 5, 133, 17, 48, 1, 64], hq=2, hkv=1, d=64, bs=16,
                           cache_dtype=cache_dtype, group=16 if cache_dtype is INT4 else None)
    run_and_check(problem)
    assert prepared(problem).num_splits == 1
    knobs(quantized_one_split_keys=128)
    run_and_check(problem)
    assert prepared(problem).num_splits > 1


@pytest.mark.gpu
@pytest.mark.parametrize("d,hq,hkv", [(128, 32, 8), (128, 32, 32), (64, 32, 8)])
def test_short_context_on_large_tiles_gpu(kernel_device, d, hq, hkv):
    # B x Hkv = 128 programs (at most one per SM on an H100/H200), a table of `Tuning.short_context`'s keys
    # (make_problem adds a block): one split (of 8 warps at D = 128); ragged lengths, an empty sequence
    rng = random.Random(torch.randint(0, 2**31, ()).item())
    b, longest = 128 // hkv, pd.tuning.current.short_context[d][0] - 16
    lens = [longest, 0, 1, 17] + [rng.randint(1, longest) for _ in range(b - 4)]
    problem = make_problem(kernel_device, lens=lens, hq=hq, hkv=hkv, d=d, bs=16)
    run_and_check(problem)
    launch = prepared(problem)
    assert launch.num_splits == 1 and launch.kernels[0].meta["num_warps"] == (8 if d == 128 else 4)


# ---- GPU: the broad matrix ---------------------------------------------------------------------

# (head dim, block size, (Hq, Hkv, q_per_seq), cache dtype, query dtype, extra)
MATRIX = [
    (64, 8, (8, 2, 1), BF16, BF16, {"layout": "NHD"}),
    (80, 16, (8, 2, 2), BF16, BF16, {"layout": "HND"}),
    (96, 17, (4, 4, 1), FP16, FP16, {"layout": "combined_NHD"}),
    (128, 16, (32, 8, 1), BF16, BF16, {"layout": "vllm"}),
    (128, 64, (16, 2, 8), FP16, FP16, {"layout": "combined_HND"}),
    (256, 32, (8, 1, 3), BF16, BF16, {}),
    (128, 256, (8, 2, 1), BF16, BF16, {}),
    (128, 1, (8, 2, 1), BF16, BF16, {"index_dtype": torch.int64}),
    (64, 128, (64, 1, 2), BF16, BF16, {}),                           # 128 rows: two M tiles
    (128, 16, (32, 8, 1), E4M3, BF16, {}),
    (128, 16, (32, 8, 4), E4M3, FP16, {"fp8_per_head": True}),
    (80, 32, (8, 2, 1), E5M2, BF16, {"fp8_per_head": True, "layout": "HND"}),
    (256, 64, (16, 4, 2), E4M3, BF16, {}),
    (64, 7, (4, 1, 1), E5M2, FP16, {}),
    (128, 16, (32, 8, 1), INT8, BF16, {"group": 32, "scale_dtype": torch.float16}),
    (128, 16, (8, 2, 3), INT8, FP16, {"group": 128}),
    (96, 24, (8, 2, 1), INT8, BF16, {"group": 24}),                 # group not a power of 2
    (80, 16, (8, 4, 2), INT8, BF16, {"group": 16, "layout": "vllm"}),  # 5 groups
    (256, 32, (8, 1, 1), INT8, FP16, {"group": 64}),
    (64, 8, (8, 8, 1), INT8, BF16, {"group": 8}),
    (128, 16, (32, 8, 1), INT4, BF16, {"group": 32, "scale_dtype": torch.float16}),
    (128, 16, (8, 2, 2), INT4, FP16, {"group": 128}),
    (64, 16, (8, 2, 1), INT4, BF16, {"group": 8, "layout": "HND"}),
    (80, 20, (8, 2, 1), INT4, BF16, {"group": 16}),
    (96, 16, (4, 4, 1), INT4, FP16, {"group": 48}),                 # 24 bytes per scale
    (256, 64, (16, 2, 1), INT4, BF16, {"group": 64}),
    (128, 16, (8, 2, 1), INT4, BF16, {"group": 2}),
    (64, 8, (8, 1, 8), INT4, BF16, {"group": 16}),                  # 64 rows of 16-value groups
    (64, 16, (8, 1, 8), INT8, FP16, {"group": 16}),                 # (did not compile at BLOCK_M 64)
]


def _lens(bs: int, rng: random.Random) -> list[int]:
    return [1, bs, bs + 1, max(1, bs - 1), 0, rng.randint(2, 300), rng.randint(600, 1100) | 1]


@pytest.mark.gpu
@pytest.mark.parametrize("d,bs,heads,cache_dtype,dtype,extra", MATRIX,
                         ids=[f"d{c[0]}-bs{c[1]}-h{c[2][0]}x{c[2][1]}q{c[2][2]}-{str(c[3])[6:]}-{str(c[4])[6:]}"
                              for c in MATRIX])
def test_matrix(kernel_device, d, bs, heads, cache_dtype, dtype, extra):
    hq, hkv, qps = heads
    rng = random.Random(torch.randint(0, 2**31, ()).item())
    problem = make_problem(kernel_device, lens=_lens(bs, rng), hq=hq, hkv=hkv, d=d, bs=bs, qps=qps,
                           dtype=dtype, cache_dtype=cache_dtype, share_prefix=True, **extra)
    run_and_check(problem)


@pytest.mark.gpu
@pytest.mark.parametrize("forced_split", [False, True])
@pytest.mark.parametrize("cache_dtype,group", [(BF16, None), (E4M3, None), (INT4, 32)])
@pytest.mark.parametrize("feature", list(samples.FEATURES))
def test_features(kernel_device, knobs, feature, cache_dtype, group, forced_split):
    if forced_split:
        knobs(num_splits=5, min_split_tokens=64)
    hq = 16
    problem = make_problem(kernel_device, lens=[700, 3, 0, 161, 1029], hq=hq, hkv=4, d=128, bs=16, qps=2,
                           cache_dtype=cache_dtype, group=group)
    run_and_check(problem, **samples.FEATURES[feature](hq, kernel_device))


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1, 7, 64, 200])
def test_split_k_long(kernel_device, knobs, splits):
    knobs(num_splits=splits, min_split_tokens=64 if splits else pd.tuning.current.min_split_tokens)
    problem = make_problem(kernel_device, lens=[9001, 1, 0, 4096], hq=32, hkv=8, d=128, bs=16)
    run_and_check(problem)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype,group", [(INT8, 32), (INT4, 16), (INT4, 128), (E4M3, None), (E5M2, None)])
def test_dequant_asm_matches_plain(kernel_device, knobs, cache_dtype, group):
    problem = make_problem(kernel_device, lens=[517, 33, 0], hq=16, hkv=4, d=128, bs=16,
                           cache_dtype=cache_dtype, group=group)
    knobs(dequant_asm=True)
    o1, l1 = run_and_check(problem)
    knobs(dequant_asm=False)
    o2, l2 = run_and_check(problem)
    assert max_error(o1, o2) <= 1e-2 * o2.float().abs().max().item() + 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("capacity", [2049, 8192])
def test_one_page_per_sequence_gpu(kernel_device, capacity):
    rng = random.Random(torch.randint(0, 2**31, ()).item())
    lens = [capacity, 1, 0, rng.randint(2, capacity), rng.randint(2, 300)]
    run_and_check(static_cache_problem(kernel_device, lens=lens, capacity=capacity, hq=32, hkv=8, d=128))


@pytest.mark.gpu
def test_cache_over_2g_elements(kernel_device):
    # FP8 cache of 2.3e9 elements per tensor; the sequences live in its last blocks
    nb = (2**31 // (16 * 8 * 128)) + 4096
    problem = make_problem(kernel_device, lens=[1000, 77], hq=32, hkv=8, d=128, bs=16, cache_dtype=E4M3,
                           num_blocks=nb, high_block_ids=True)
    assert problem[1].k.numel() > 2**31
    run_and_check(problem)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype,group", [(BF16, None), (E4M3, None), (INT4, 32)])
def test_cuda_graph_replay(kernel_device, cache_dtype, group):
    """Capture one call; then write new lengths, block tables, queries and scales into the captured
    tensors, replay, and compare with eager calls on the same inputs (same grid: bit-identical)."""
    dev = kernel_device
    B, qps, hq, hkv, d, bs, max_blocks = 6, 2, 16, 4, 128, 16, 96
    nb = B * max_blocks + 8
    cache = kv_cache.PagedKVCache.allocate(nb, bs, hkv, d, cache_dtype, quant_group=group, device=dev)
    kv_cache.random_(cache)
    q = torch.randn(B * qps, hq, d, dtype=BF16, device=dev)
    bt = torch.zeros(B, max_blocks, dtype=torch.int32, device=dev)
    sl = torch.zeros(B, dtype=torch.int32, device=dev)
    out = torch.empty(q.shape, dtype=BF16, device=dev)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=dev)

    def fill(step):
        lens = torch.randint(qps, max_blocks * bs + 1, (B,))
        lens[step % B] = 0
        if step == 0:
            lens[:] = 1 + qps
        sl.copy_(lens)
        bt.copy_(torch.randperm(nb)[: B * max_blocks].view(B, max_blocks))
        q.normal_()
        if cache_dtype == E4M3:
            cache.k_scale.mul_(1.5)
            cache.v_scale.mul_(0.75)
        elif group:
            cache.k_scale.mul_(1.25)

    def call():
        with torch_ops.use_backend("triton"):
            torch.ops.attn.paged_decode.out(q, cache.k, cache.v, bt, sl, out=out, lse=lse, **cache.scale_kwargs())

    assert_replays_match_eager(call, fill, (out, lse), lambda o, l: check(q, cache, bt, sl, o, l))


@pytest.mark.parametrize("qps,splits", [(1, None), (2, 3)])
def test_key_mask_hides_the_keys_it_marks_false(kernel_device, knobs, qps, splits):
    """`key_mask [T, N]`: a row sees only its true keys (none: zeros and -inf), keys past N none."""
    if splits:
        knobs(num_splits=splits, min_split_tokens=16, config={"BLOCK_N": 16, "num_warps": 4, "num_stages": 2})
    problem = make_problem(kernel_device, lens=[37, 0, 50], hq=4, hkv=2, d=32, bs=8, qps=qps)
    q = problem[0]
    mask = torch.rand(q.shape[0], 45, device=kernel_device) < 0.6
    mask[0] = False
    run_and_check(problem, key_mask=mask)
