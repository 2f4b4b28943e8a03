"""Triton `attn::paged_decode`: 1..8 new query tokens per sequence over a paged KV cache.

Design (semantics: docs/ops.md; numbers and reasoning: the notes in benchmarks/bench_decode.py)

- **One program = one (sequence, KV head, split) and all its query rows.** The `Hq / Hkv` query
  heads of a KV head times the `q_per_seq` new tokens form the M dimension of the two `tl.dot`s
  (row `m = i * G + g`: token `i`, head `g` of the group), padded to >= 16 and tiled by at most
  64 rows (`M_TILES` programs share the KV head then; they run side by side, so the second read
  comes from L2). The K/V tiles are read once per program, whatever the GQA ratio.
- **Replicated rows.** With <= 8 query rows, a one-warp program's 16-row tile can hold R copies of
  them (row i = query row i // R, copy i % R); copy j scores key tile j of each R-tile step, so
  one softmax step and one rescale of the accumulators serve R tiles. Each copy keeps its own
  online-softmax state; the epilogue merges them (`config` says when R = 2 pays).
- **Paged tiles.** A tile is `BLOCK_N` tokens. When the block size is a multiple of `BLOCK_N`, a
  tile lies in one page and costs one block-table load (and, where `config` says so, its rows are
  32-bit offsets from one 64-bit base pointer); otherwise (block sizes 1..BLOCK_N-1, or not
  multiples) every token row looks its page up (an L1 hit). Row offsets are int64.
  Any block/token/head strides with a contiguous last dim (NHD, HND, combined, vLLM) are served.
- **Quantized tiles as words, split into 4 lanes.** FP8/INT8 rows are read as int32 words and
  packed INT4 rows as int16 words, 4 values each; word c of a row holds dims 4c..4c+3. Each word
  is dequantized in registers into 4 fp16 "lanes" (lane j = dim 4c + j), exactly: FP8 by the
  hardware `cvt.rn.f16x2.e4m3x2`/`e5m2x2`, INT8/INT4 by the fp16 magic number (`prmt`/`lop3`
  build the bit pattern 0x6400|bits = 1024 + bits, one `sub.f16x2`/`fma.rn.f16x2` removes the
  offset, two values per instruction), in PTX on the GPU and in plain Triton integer code under
  the interpreter, then times the group scale (a packed fp16 multiply for fp16 scale caches, in
  fp32 for fp32/bf16 ones, so that the product is rounded to fp16 once, as the reference does).
  Lane j of K is dotted with lane j of q
  (q[:, j::4]) and P @ V accumulates 4 lane accumulators, re-interleaved once in the epilogue,
  so no shuffle ever restores the dim order inside the loop; and the tiles are read from shared
  memory as whole words, straight into the MMA operand layout (no layout conversion in the sm_90a
  TTGIR; a byte-wise layout made Triton emit one `ld.shared.b8` per value).
  The FP8 per-tensor/per-head K scale rides on the softmax scale, the V scale on the output.
  With bf16 queries the QK operands are fp16 too: q is scaled by a power of two so that
  max |q| <= 2^15 (exact; undone in the softmax scale). Dequantized INT8/INT4 values must fit
  fp16 (|x| < 65504). Group scales are loaded once per (token, group) when the group is 4 x a
  power of 2 values, else gathered per value (slow path: groups of 2, 24, 48, ...).
- **Warps.** Quantized caches (and plain ones when B x Hkv is 32 to half the SM count) run
  one-warp programs of 16-key tiles: a warp owns all rows and keys of its tile, so no softmax
  state crosses warps inside the loop, and split-K supplies the parallelism. 32-row quantized
  tiles take two warps, the rest four (eight for 64-row plain tiles at D = 256; `config`).
- **Pipelining.** Triton's software pipeliner stages the block-table, K, V and scale loads through
  shared memory (cp.async); the page indirection costs it two stages, so `num_stages=5` keeps
  two tiles of every program in flight (`config`).
- **Softmax** online in fp32 with exp2, log2(e) folded into the scale; softcap via exp2-based
  tanh; ALiBi per row; causal among the new tokens; sliding window + sink tokens skip whole tiles
  (the split range starts at the window, sink tiles are visited by split 0 only).
- **Split-K.** `num_splits` comes from shapes only (B, Hkv, M tiles, `block_tables.shape[1]`,
  block size, SM count; `split_count`), so the grid is fixed under CUDA graphs. When the batch
  alone comes near filling the GPU, plain caches take tiles of twice the keys and one or two
  splits instead (`large_tile_splits`; one split for tables of <= 512 keys at D = 128, in 8-warp
  programs, and <= 1024 keys at D = 64: `Tuning.short_context`). Inside, each
  sequence cuts its own visible key span into `num_splits` equal parts (rounded up to `BLOCK_N`,
  at least `Tuning.min_split_tokens`): long sequences use every split, short ones a few, and splits
  past the span exit at once (they write nothing, and the merge kernel never reads them).
  With one split the kernel writes `out`/`lse` itself; otherwise `_merge_kernel` combines the
  partial (out, lse) of the active splits and adds the learned sinks once, after the merge.
  Few (sequence, KV head) pairs over long tables (B = 1 on a tensor-parallel shard of 1-2 KV
  heads) split up to `Tuning.max_splits` = 256 ways, and the merge then takes the head dim in blocks
  (`Tuning.merge_tile` partial values per program). H200, bf16, 16k-32k keys: 8/1 heads 1.6-1.9x, 16/2
  1.2x, FP8 8/1 1.9x, INT4 2.3x the 64-split cap.
  The merge is a kernel of its own (3.0-4.1 µs of a 9-27 µs call at B <= 16 on an H200): merging
  in the split kernel (the last split of a tile, after an atomic counter) saves 1-2 µs for MHA but
  is up to 2.3x slower for GQA at B = 1, where one program would merge 22-26 splits serially.
- **Workspace** (only when `num_splits > 1`): fp32 partial outputs `[num_splits, T, Hq, D]` and
  partial lse `[num_splits, T, Hq]`, allocated per call with `torch.empty` from shapes alone
  (inside CUDA-graph capture it comes from the graph's private pool: fixed addresses on replay).
- Length-0 sequences write zeros and lse -inf (or `sinks[h]`). No host sync in `run`.
- Bad metadata (docs/ops.md, "Errors"): lengths are clamped into the block table, block ids
  outside the cache are absent blocks (keys masked, folded into the load and visibility masks);
  each sets its bit in the device error flag (`torch_ops.errors`).

Not served (`unsupported` says why): head dims > 256; quantized caches whose head dim is not a
multiple of 4 or whose strides/alignment do not allow 4-value words. Any block size, any
GQA ratio, q_per_seq 1..8, fp16/bf16 queries are all served.

Knobs (tests, tuning): `Tuning`, changed inside `with tuning(num_splits=..., config=...):`.
A prepared launch carries its `kernels` (main, then merge) and `num_splits`. Under
TRITON_INTERPRET=1 the kernel takes a fixed trip count (the interpreter cannot use a loaded value as a loop bound with numpy >= 2.4), feeds `tl.dot`
fp32 instead of bf16 (the interpreter multiplies bf16 bit patterns) and rounds FP8 output in
fp32 (its fp32 -> e4m3 cast does not carry into the exponent): same math, CPU-testable.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl

from .. import errors, gpu
from ..quant import KVFormat, kv_format
from . import interpreting
from .formats import FMT_FP8, FMT_INT4, FMT_INT8, FMT_PLAIN
from .interpreter import exact_cast
from .launcher import TritonLaunch, no_launch, scale_operands
from .tuning import Knobs


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The kernel's tuning knobs, read when a launch is prepared (`tuning`)."""

    num_splits: int | None = None      # a fixed split count (tests force split-K with it)
    min_split_tokens: int = 64         # a split covers at least this many keys (rounded to BLOCK_N)
    max_splits: int = 256              # B = 1 over 1-2 KV heads takes 128-256 (a cap of 64: 1.2-2.3x slower
                                       # at 16k-32k keys); 384 and 512 run 2-4x slower (one-tile merge)
    merge_tile: int = 4096             # partial values per merge program (more splits: fewer dims each)
    replica_min_keys: int = 512        # quantized one-warp programs score 2 tiles side by side from
                                       # this many keys per split (`config`)
    programs_per_sm: int | None = None   # resident programs per SM for the split heuristic (None: the config's)
    config: dict | None = None         # a `config` dict for every call (replicas, rows32 default off)
    dequant_asm: bool | None = None    # None: PTX dequantization on CUDA, plain Triton otherwise
    # Short contexts on the large tiles (<= 16 query rows, a table of at most `keys` keys): one split
    # instead of two splits and their merge; at D = 128 in 8-warp programs of 7 stages. block_d (the
    # head dim rounded up to a power of two: D = 80 and 96 follow D = 128, unmeasured) -> (keys, config
    # changes). H200, 16-token pages: D = 128 B = 4 32/32 ctx 512 18.3 -> 15.7 us, B = 16 32/8 18.7 -> 16.3,
    # at 1k within 0.3 us, at 2k 42.3 -> 47.6; D = 64 B = 4 32/32 ctx 512 13.1 -> 9.9, ctx 1k 16.4 -> 15.0,
    # B = 16 32/8 ctx 1k 17.0 -> 16.0 (two splits still win at 2k: 24.8 against 26.4).
    short_context: dict = dataclasses.field(
        default_factory=lambda: {128: (512, {"num_warps": 8, "num_stages": 7}), 64: (1024, {})})


tuning = Knobs(Tuning())   # `with paged_decode.tuning(num_splits=4): ...`; `tuning.current`: the knobs in force

# split heuristic costs, in "tokens of one program's work"
SPLIT_FIXED_COST = 48                 # prologue/epilogue of one program
MERGE_COST = 96                       # the merge kernel's launch and its tail

INTERPRETER_SMS = 8   # the interpreter's stand-in: a small "GPU", so that the split heuristic still splits
MAX_HEAD_DIM = 256
MAX_BLOCK_M = 64
ONE_PAGE_SPAN = 1 << 30   # the page size the kernel assumes for single-page block tables
# Quantized tiles stop at 32 rows: at 64 their lane accumulators take ~250 registers, and with
# 16-value groups Triton 3.6 fails to compile them for sm_90 (TritonGPUOptimizeDotOperands).
MAX_BLOCK_M_QUANTIZED = 32
# Large tiles of the plain format (block_d -> BLOCK_N; 70 KB of shared memory at 5 stages:
# 3 programs per SM) and the M tiles they are used up to.
LARGE_TILE_KEYS = {64: 128, 128: 64}
LARGE_TILE_PROGRAMS_PER_SM = 3
LARGE_TILE_MAX_BLOCK_M = 32
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
_ERR_LEN = tl.constexpr(errors.SEQ_LENS)


# =================================================================================================
# Kernels
# =================================================================================================


@triton.jit
def _seq_len(SeqLens, b, kv_cap, Err, FLAG: tl.constexpr):
    """Sequence `b`'s key count, clamped into the block table's capacity: a bad length reads no
    memory outside it (and, with FLAG, sets its bit in `Err`)."""
    raw = tl.load(SeqLens + b)
    if FLAG:
        tl.atomic_or(Err, _ERR_LEN, mask=(raw < 0) | (raw > kv_cap))
    return tl.minimum(tl.maximum(raw, 0), kv_cap).to(tl.int32)


@triton.jit
def _split_geometry(L, window_left, split, num_splits, min_split,
                    QPS: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key range of split `split` of a sequence of `L` keys: (kv_lo, start, end, n_active).

    The visible span [kv_lo, L) (kv_lo: the first query's window start, aligned down to BLOCK_N)
    is cut into parts of `per` keys, a multiple of BLOCK_N and >= min_split."""
    kv_lo = L * 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(L - QPS - window_left, 0)
        kv_lo = (kv_lo // BLOCK_N) * BLOCK_N
    span = tl.maximum(L - kv_lo, 0)
    per = tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
    per = tl.maximum(per, min_split)
    n_active = tl.cdiv(span, per)
    start = kv_lo + split * per
    end = tl.minimum(start + per, L)
    return kv_lo, start, end, n_active


# FP8 x 4 per word: bytes of the two words regrouped by lane (t0 = a0 b0 a1 b1, t1 = a2 b2 a3 b3),
# then one packed convert per lane
_E4M3_ASM = """
{
.reg .b32 t0, t1;
.reg .b16 l0, h0, l1, h1;
prmt.b32 t0, $4, $5, 0x5140;
prmt.b32 t1, $4, $5, 0x7362;
mov.b32 {l0, h0}, t0;
mov.b32 {l1, h1}, t1;
cvt.rn.f16x2.CVT_TYPE $0, l0;
cvt.rn.f16x2.CVT_TYPE $1, h0;
cvt.rn.f16x2.CVT_TYPE $2, l1;
cvt.rn.f16x2.CVT_TYPE $3, h1;
}
"""
_FP8_E4M3_ASM = tl.constexpr(_E4M3_ASM.replace("CVT_TYPE", "e4m3x2"))
_FP8_E5M2_ASM = tl.constexpr(_E4M3_ASM.replace("CVT_TYPE", "e5m2x2"))
# int8 x 4 per word: bytes of the two words regrouped by lane, each byte b made the fp16 bit
# pattern 0x64 : (b ^ 0x80), i.e. 1152 + b, and 1152 subtracted (exact)
_INT8_ASM = tl.constexpr("""
{
.reg .b32 t0, t1, v0, v1, m, c;
xor.b32 t0, $4, 0x80808080;
xor.b32 t1, $5, 0x80808080;
prmt.b32 v0, t0, t1, 0x5140;
prmt.b32 v1, t0, t1, 0x7362;
mov.b32 m, 0x64646464;
prmt.b32 $0, v0, m, 0x4140;
prmt.b32 $1, v0, m, 0x4342;
prmt.b32 $2, v1, m, 0x4140;
prmt.b32 $3, v1, m, 0x4342;
mov.b32 c, 0x64806480;
sub.f16x2 $0, $0, c;
sub.f16x2 $1, $1, c;
sub.f16x2 $2, $2, c;
sub.f16x2 $3, $3, c;
}
""")
# int4 x 4 per 16-bit word (two words in $4): nibble j of each word into the mantissa of 1024
# (lanes 0, 2) or of 1024 + 16 n (lanes 1, 3), then - 1032 or * 1/16 - 72 (exact)
_INT4_ASM = tl.constexpr("""
{
.reg .b32 h, c, s, o;
shr.b32 h, $4, 8;
lop3.b32 $0, $4, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 $1, $4, 0x00F000F0, 0x64006400, 0xEA;
lop3.b32 $2, h, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 $3, h, 0x00F000F0, 0x64006400, 0xEA;
mov.b32 c, 0x64086408;
sub.f16x2 $0, $0, c;
sub.f16x2 $2, $2, c;
mov.b32 s, 0x2C002C00;
mov.b32 o, 0xD480D480;
fma.rn.f16x2 $1, $1, s, o;
fma.rn.f16x2 $3, $3, s, o;
}
""")


@triton.jit
def _unpack_words(w, FMT: tl.constexpr, E5M2: tl.constexpr, ASM: tl.constexpr):
    """Words of 4 values (int32: FP8/INT8 bytes; int16: INT4 nibbles) -> 4 fp16 tensors of w's
    shape, lane j holding value j of every word; exact (group scales are applied by the caller)."""
    if ASM:
        if FMT == FMT_FP8:
            if E5M2:
                code: tl.constexpr = _FP8_E5M2_ASM
            else:
                code: tl.constexpr = _FP8_E4M3_ASM
            return tl.inline_asm_elementwise(code, "=r,=r,=r,=r,r,r", [w], dtype=(tl.float16,) * 4,
                                             is_pure=True, pack=2)
        elif FMT == FMT_INT8:
            return tl.inline_asm_elementwise(_INT8_ASM, "=r,=r,=r,=r,r,r", [w], dtype=(tl.float16,) * 4,
                                             is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(_INT4_ASM, "=r,=r,=r,=r,r", [w], dtype=(tl.float16,) * 4,
                                             is_pure=True, pack=2)
    else:
        if FMT == FMT_INT4:
            u = w.to(tl.int32) & 0xFFFF
            x0 = ((u & 15) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1032.0
            x1 = (((u >> 4) & 15) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1032.0
            x2 = (((u >> 8) & 15) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1032.0
            x3 = (((u >> 12) & 15) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1032.0
            return x0, x1, x2, x3
        elif FMT == FMT_INT8:
            x0 = (((w & 0xFF) ^ 0x80) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1152.0
            x1 = ((((w >> 8) & 0xFF) ^ 0x80) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1152.0
            x2 = ((((w >> 16) & 0xFF) ^ 0x80) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1152.0
            x3 = ((((w >> 24) & 0xFF) ^ 0x80) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1152.0
            return x0, x1, x2, x3
        else:
            if E5M2:
                f8: tl.constexpr = tl.float8e5
            else:
                f8: tl.constexpr = tl.float8e4nv
            x0 = (w & 0xFF).to(tl.uint8).to(f8, bitcast=True).to(tl.float16)
            x1 = ((w >> 8) & 0xFF).to(tl.uint8).to(f8, bitcast=True).to(tl.float16)
            x2 = ((w >> 16) & 0xFF).to(tl.uint8).to(f8, bitcast=True).to(tl.float16)
            x3 = ((w >> 24) & 0xFF).to(tl.uint8).to(f8, bitcast=True).to(tl.float16)
            return x0, x1, x2, x3


@triton.jit
def _load_plain(Base, rows, n_ok, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    return tl.load(Base + rows[:, None] + d[None, :], mask=n_ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)


@triton.jit
def _scaled(x, s, SCALE_F16: tl.constexpr):
    """fp16 value `x` (an exact integer) times its group scale, rounded once to fp16 as the
    reference does: a packed fp16 multiply for fp16 scales, else in fp32 (rounding an fp32 or bf16
    scale to fp16 first would round twice)."""
    if SCALE_F16:
        return x * s
    return (x.to(tl.float32) * s.to(tl.float32)).to(tl.float16)


@triton.jit
def _load_lanes(Base, rows, n_ok, SBase, srows,
                FMT: tl.constexpr, E5M2: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                NG: tl.constexpr, NGP: tl.constexpr, GW: tl.constexpr, QGROUP: tl.constexpr,
                SCALE_PER_GRP: tl.constexpr, ASM: tl.constexpr, SCALE_F16: tl.constexpr):
    """One quantized K or V tile of BLOCK_N token rows as 4 dequantized fp16 lanes
    [BLOCK_N, NGP * GW]: lane j, column c holds dim 4c + j. `rows` are the rows' offsets in words
    (4 values each); the words are grouped [BLOCK_N, NGP, GW] by scale group (GW words per group)
    when the group is a multiple of 4 values and GW a power of 2, else [BLOCK_N, 1, GW]."""
    grp = tl.arange(0, NGP)
    e = tl.arange(0, GW)
    col = grp[None, :, None] * GW + e[None, None, :]          # word column
    mask = n_ok[:, None, None] & (col < HEAD_DIM // 4)
    w = tl.load(Base + rows[:, None, None] + col, mask=mask, other=0)
    x0, x1, x2, x3 = _unpack_words(w, FMT, E5M2, ASM)
    if FMT != FMT_FP8:
        if SCALE_PER_GRP:
            # a 2-D load (vectorized along the groups, so the pipeliner can stage it)
            s = tl.load(SBase + srows[:, None] + grp[None, :], mask=n_ok[:, None] & (grp < NG)[None, :], other=0.0)
            s = tl.expand_dims(s, 2)
            x0 = _scaled(x0, s, SCALE_F16)
            x1 = _scaled(x1, s, SCALE_F16)
            x2 = _scaled(x2, s, SCALE_F16)
            x3 = _scaled(x3, s, SCALE_F16)
        else:
            sp = SBase + srows[:, None, None]
            x0 = _scaled(x0, tl.load(sp + (4 * col + 0) // QGROUP, mask=mask, other=0.0), SCALE_F16)
            x1 = _scaled(x1, tl.load(sp + (4 * col + 1) // QGROUP, mask=mask, other=0.0), SCALE_F16)
            x2 = _scaled(x2, tl.load(sp + (4 * col + 2) // QGROUP, mask=mask, other=0.0), SCALE_F16)
            x3 = _scaled(x3, tl.load(sp + (4 * col + 3) // QGROUP, mask=mask, other=0.0), SCALE_F16)
    shape: tl.constexpr = (BLOCK_N, NGP * GW)
    return tl.reshape(x0, shape), tl.reshape(x1, shape), tl.reshape(x2, shape), tl.reshape(x3, shape)


@triton.jit
def _tile(it, acc0, acc1, acc2, acc3, m_i, l_i, bad, q0, q1, q2, q3, qk_scale, softcap, window_left, sink_tokens,
          n_sink, sink_hi, start, end, pos, rep, alibi2, bt_row, stride_btp, num_blocks, km_rows, km_len,
          K, V, KS, VS, k_head, v_head, ks_head, vs_head,
          stride_kb, stride_kt, stride_vb, stride_vt, stride_ksb, stride_kst, stride_vsb, stride_vst,
          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, R: tl.constexpr,
          PAGE: tl.constexpr, ONE_PAGE: tl.constexpr, ROWS32: tl.constexpr,
          FMT: tl.constexpr, E5M2: tl.constexpr, NG: tl.constexpr, NGP: tl.constexpr, GW: tl.constexpr,
          QGROUP: tl.constexpr, SCALE_PER_GRP: tl.constexpr, ASM: tl.constexpr,
          HAS_ALIBI: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
          DOT_F32: tl.constexpr, SVEC: tl.constexpr, SCALE_F16: tl.constexpr, HAS_KEY_MASK: tl.constexpr):
    """Chunk `it` of this program's key ranges (sink chunks first): R tiles of BLOCK_N keys, tile
    j scored by the rows of replica j (`rep`), then one online-softmax step per row. A block id
    outside [0, num_blocks) is an absent block (its keys masked, marked in `bad [BLOCK_N]`)."""
    CHUNK: tl.constexpr = R * BLOCK_N
    if HAS_WINDOW:
        in_sink = it < n_sink
        t0 = tl.where(in_sink, it * CHUNK, start + (it - n_sink) * CHUNK)
        hi = tl.where(in_sink, sink_hi, end)
    else:
        t0 = start + it * CHUNK
        hi = end

    s = tl.zeros([rep.shape[0], BLOCK_N], tl.float32)
    if R > 1:
        kv_ok = tl.zeros([rep.shape[0], BLOCK_N], tl.int1)   # the keys of each row's tile that exist
    v_tiles = ()
    for j in tl.static_range(R):
        offs_n = t0 + j * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        if ONE_PAGE:
            page = tl.load(bt_row + ((t0 + j * BLOCK_N) // PAGE) * stride_btp, mask=t0 + j * BLOCK_N < hi, other=0)
        else:
            page = tl.load(bt_row + (offs_n // PAGE) * stride_btp, mask=n_ok, other=0)
        page_ok = (page >= 0) & (page < num_blocks)
        bad = bad | tl.where(page_ok, False, n_ok)   # (a where: page_ok may be a scalar)
        n_ok = tl.where(page_ok, n_ok, False)
        page = tl.where(page_ok, page, 0).to(tl.int64)
        if ROWS32:
            # (single-page tiles) one base pointer per tile, 32-bit row offsets within it
            within = ((t0 + j * BLOCK_N) % PAGE).to(tl.int64)
            row = tl.arange(0, BLOCK_N)
            Kt = K + (page * stride_kb + within * stride_kt + k_head)
            Vt = V + (page * stride_vb + within * stride_vt + v_head)
            k_rows = row * stride_kt
            v_rows = row * stride_vt
            if FMT != FMT_PLAIN:
                ks_off = page * stride_ksb + within * stride_kst + ks_head
                vs_off = page * stride_vsb + within * stride_vst + vs_head
                if SVEC > 1:   # scale rows start on SVEC-element boundaries: vector (pipelinable) loads
                    ks_off = tl.multiple_of(ks_off, SVEC)
                    vs_off = tl.multiple_of(vs_off, SVEC)
                KSt = KS + ks_off
                VSt = VS + vs_off
                ks_rows = row * stride_kst
                vs_rows = row * stride_vst
        else:
            within = (offs_n % PAGE).to(tl.int64)
            Kt = K
            Vt = V
            k_rows = page * stride_kb + within * stride_kt + k_head
            v_rows = page * stride_vb + within * stride_vt + v_head
            if FMT != FMT_PLAIN:
                KSt = KS
                VSt = VS
                ks_rows = page * stride_ksb + within * stride_kst + ks_head
                vs_rows = page * stride_vsb + within * stride_vst + vs_head
        if FMT == FMT_PLAIN:
            k = _load_plain(Kt, k_rows, n_ok, HEAD_DIM, BLOCK_D)
            if DOT_F32:   # the interpreter's tl.dot multiplies bf16 bit patterns: give it fp32
                k = k.to(tl.float32)
            qk = tl.dot(q0, tl.trans(k))
            VSt = Vt
            vs_rows = v_rows
        else:
            if SVEC > 1:
                ks_rows = tl.multiple_of(ks_rows, SVEC)
                vs_rows = tl.multiple_of(vs_rows, SVEC)
            k0, k1, k2, k3 = _load_lanes(Kt, k_rows, n_ok, KSt, ks_rows, FMT, E5M2, HEAD_DIM, BLOCK_N,
                                         NG, NGP, GW, QGROUP, SCALE_PER_GRP, ASM, SCALE_F16)
            qk = tl.dot(q0, tl.trans(k0))
            qk = tl.dot(q1, tl.trans(k1), qk)
            qk = tl.dot(q2, tl.trans(k2), qk)
            qk = tl.dot(q3, tl.trans(k3), qk)
        v_tiles = v_tiles + ((Vt, v_rows, VSt, vs_rows, n_ok),)
        if R == 1:
            s = qk
            kv_ok = n_ok[None, :]
        else:
            s = tl.where((rep == j)[:, None], qk, s)
            kv_ok = tl.where((rep == j)[:, None], n_ok[None, :], kv_ok)

    if HAS_SOFTCAP:
        # softcap * tanh(s / softcap), tanh(x) = 1 - 2 / (exp(2x) + 1), then to log2 units
        x = s * (qk_scale / softcap)
        th = 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)
        s = th * (softcap * 1.4426950408889634)
    else:
        s = s * qk_scale
    key = t0 + rep[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]   # [rows, BLOCK_N] key index
    dist = pos[:, None] - key
    if HAS_ALIBI:
        s = s + alibi2[:, None] * tl.abs(dist).to(tl.float32)
    vis = kv_ok & (dist >= 0)
    if HAS_WINDOW:
        vis = vis & ((dist <= window_left) | (key < sink_tokens))
    if HAS_KEY_MASK:   # km_rows: each row's key_mask row (row 0 for rows past the query's)
        vis = vis & (tl.load(km_rows[:, None] + key, mask=vis & (key < km_len), other=0) != 0)
    s = tl.where(vis, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    m_i = m_new

    acc0 = acc0 * alpha[:, None]
    if FMT != FMT_PLAIN:
        acc1 = acc1 * alpha[:, None]
        acc2 = acc2 * alpha[:, None]
        acc3 = acc3 * alpha[:, None]
    for j in tl.static_range(R):
        Vt, v_rows, VSt, vs_rows, n_ok = v_tiles[j]
        if FMT == FMT_PLAIN:
            v = _load_plain(Vt, v_rows, n_ok, HEAD_DIM, BLOCK_D)
            p_op = exact_cast(p, v.dtype, DOT_F32)
            if DOT_F32:
                p_op = p_op.to(tl.float32)
                v = v.to(tl.float32)
            if R > 1:
                p_op = tl.where((rep == j)[:, None], p_op, 0.0)
            acc0 = tl.dot(p_op, v, acc0)
        else:
            v0, v1, v2, v3 = _load_lanes(Vt, v_rows, n_ok, VSt, vs_rows, FMT, E5M2, HEAD_DIM, BLOCK_N,
                                         NG, NGP, GW, QGROUP, SCALE_PER_GRP, ASM, SCALE_F16)
            p_op = p.to(tl.float16)
            if R > 1:
                p_op = tl.where((rep == j)[:, None], p_op, 0.0)
            acc0 = tl.dot(p_op, v0, acc0)
            acc1 = tl.dot(p_op, v1, acc1)
            acc2 = tl.dot(p_op, v2, acc2)
            acc3 = tl.dot(p_op, v3, acc3)
    return acc0, acc1, acc2, acc3, m_i, l_i, bad


@triton.jit
def _load_q(q_rows, row_ok, stride_qd, lane: tl.constexpr, STEP: tl.constexpr,
            HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.arange(0, BLOCK) * STEP + lane
    return tl.load(q_rows[:, None] + c[None, :] * stride_qd, mask=row_ok[:, None] & (c < HEAD_DIM)[None, :], other=0.0)


@triton.jit(do_not_specialize=["num_splits", "min_split"])   # they follow the batch size
def _paged_decode_kernel(
    Query, K, V, KS, VS, BT, SeqLens, Sinks, Alibi, OutScale, Out, Lse, POut, PLse, KeyMask, Err,
    scale_eff, softcap, window_left, sink_tokens, num_splits, min_split,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
    stride_fp8s,
    stride_btb, stride_btp,
    stride_ot, stride_oh, stride_od, stride_lt, stride_lh,
    stride_ps, stride_pt, stride_ph, stride_pls, stride_plt, stride_kmt, km_len, kv_cap, num_blocks,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, R: tl.constexpr, M_TILES: tl.constexpr,
    PAGE: tl.constexpr, ONE_PAGE: tl.constexpr, ROWS32: tl.constexpr, QPS: tl.constexpr, GROUP: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    FMT: tl.constexpr, E5M2: tl.constexpr, NG: tl.constexpr, NGP: tl.constexpr, GW: tl.constexpr,
    QGROUP: tl.constexpr, SCALE_PER_GRP: tl.constexpr, ASM: tl.constexpr, PRESCALE_Q: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr, OUT_FP8: tl.constexpr, SPLIT: tl.constexpr,
    DYNAMIC_LOOP: tl.constexpr, MAX_ITERS: tl.constexpr, DOT_F32: tl.constexpr, SVEC: tl.constexpr,
    SCALE_F16: tl.constexpr, HAS_KEY_MASK: tl.constexpr, BLOCK_ERR: tl.constexpr,
):
    """`Err`: the device error flag (`torch_ops.errors`); bad block ids set `BLOCK_ERR` in it (0: no bit)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    mt = pid % M_TILES
    kh = (pid // M_TILES) % NUM_KV_HEADS
    b = pid // (M_TILES * NUM_KV_HEADS)

    CHUNK: tl.constexpr = R * BLOCK_N       # keys per loop step
    RP: tl.constexpr = BLOCK_M // R         # query rows per replica
    L = _seq_len(SeqLens, b, kv_cap, Err, True)
    kv_lo, start, end, n_active = _split_geometry(L, window_left, split, num_splits, min_split,
                                                  QPS, HAS_WINDOW, CHUNK)
    if SPLIT:
        if split >= n_active:
            return

    # tile row i = query row i // R (token, head of the group) of replica i % R
    rep = tl.arange(0, BLOCK_M) % R
    m = mt * RP + tl.arange(0, BLOCK_M) // R
    row_ok = m < QPS * GROUP
    qi = m // GROUP
    head = kh * GROUP + m % GROUP
    tok = b * QPS + qi
    pos = L - QPS + qi                     # absolute positions of the query rows
    km_rows = KeyMask + tl.where(row_ok, tok, 0).to(tl.int64) * stride_kmt

    # ---- q: plain -> [BLOCK_M, BLOCK_D]; quantized -> 4 lanes [BLOCK_M, BLOCK_DW] (dims 4c + j)
    q_rows = Query + tok.to(tl.int64) * stride_qt + head * stride_qh
    qk_scale = scale_eff                    # natural-log units until the softcap is applied
    if FMT == FMT_PLAIN:
        q0 = _load_q(q_rows, row_ok, stride_qd, 0, 1, HEAD_DIM, BLOCK_D)
        if DOT_F32:
            q0 = q0.to(tl.float32)
        q1 = q0
        q2 = q0
        q3 = q0
    else:
        q0 = _load_q(q_rows, row_ok, stride_qd, 0, 4, HEAD_DIM, BLOCK_DW).to(tl.float32)
        q1 = _load_q(q_rows, row_ok, stride_qd, 1, 4, HEAD_DIM, BLOCK_DW).to(tl.float32)
        q2 = _load_q(q_rows, row_ok, stride_qd, 2, 4, HEAD_DIM, BLOCK_DW).to(tl.float32)
        q3 = _load_q(q_rows, row_ok, stride_qd, 3, 4, HEAD_DIM, BLOCK_DW).to(tl.float32)
        if FMT == FMT_FP8:
            qk_scale = qk_scale * tl.load(KS + kh * stride_fp8s)
        if PRESCALE_Q:
            # bf16 query -> fp16 operand: scale by 2^-sh so that max |q| <= 2^15 (exact)
            amax = tl.maximum(tl.maximum(tl.max(tl.max(tl.abs(q0), 1), 0), tl.max(tl.max(tl.abs(q1), 1), 0)),
                              tl.maximum(tl.max(tl.max(tl.abs(q2), 1), 0), tl.max(tl.max(tl.abs(q3), 1), 0)))
            sh = tl.maximum(tl.ceil(tl.log2(amax)) - 15.0, 0.0).to(tl.int32)
            down = ((127 - sh) << 23).to(tl.float32, bitcast=True)
            qk_scale = qk_scale * ((127 + sh) << 23).to(tl.float32, bitcast=True)
            q0 = q0 * down
            q1 = q1 * down
            q2 = q2 * down
            q3 = q3 * down
        q0 = q0.to(tl.float16)
        q1 = q1.to(tl.float16)
        q2 = q2.to(tl.float16)
        q3 = q3.to(tl.float16)
    if not HAS_SOFTCAP:
        qk_scale = qk_scale * 1.4426950408889634

    alibi2 = qk_scale  # unused placeholder without ALiBi
    if HAS_ALIBI:
        alibi2 = -tl.load(Alibi + head, mask=row_ok, other=0.0) * 1.4426950408889634

    # ---- key ranges: sink tiles (split 0 only, window mode) then this split's tiles ------------
    sink_hi = L * 0
    if HAS_WINDOW:
        if split == 0:
            sink_hi = tl.minimum(sink_tokens, kv_lo)
    n_sink = tl.cdiv(sink_hi, CHUNK)
    n_main = tl.cdiv(tl.maximum(end - start, 0), CHUNK)

    bt_row = BT + b.to(tl.int64) * stride_btb
    k_head = kh.to(tl.int64) * stride_kh
    v_head = kh.to(tl.int64) * stride_vh
    ks_head = kh.to(tl.int64) * stride_ksh
    vs_head = kh.to(tl.int64) * stride_vsh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if FMT == FMT_PLAIN:
        acc0 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    else:
        acc0 = tl.zeros([BLOCK_M, BLOCK_DW], tl.float32)
    acc1 = tl.zeros([BLOCK_M, BLOCK_DW], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_DW], tl.float32)
    acc3 = tl.zeros([BLOCK_M, BLOCK_DW], tl.float32)
    bad = tl.zeros([BLOCK_N], tl.int1)   # keys of absent blocks (block ids outside the cache)

    n_iter = n_sink + n_main
    if DYNAMIC_LOOP:
        for it in range(0, n_iter):
            acc0, acc1, acc2, acc3, m_i, l_i, bad = _tile(
                it, acc0, acc1, acc2, acc3, m_i, l_i, bad, q0, q1, q2, q3, qk_scale, softcap, window_left,
                sink_tokens, n_sink, sink_hi, start, end, pos, rep, alibi2, bt_row, stride_btp, num_blocks, km_rows, km_len,
                K, V, KS, VS, k_head, v_head, ks_head, vs_head,
                stride_kb, stride_kt, stride_vb, stride_vt, stride_ksb, stride_kst, stride_vsb, stride_vst,
                HEAD_DIM, BLOCK_D, BLOCK_N, R, PAGE, ONE_PAGE, ROWS32, FMT, E5M2, NG, NGP, GW, QGROUP, SCALE_PER_GRP,
                ASM, HAS_ALIBI, HAS_WINDOW, HAS_SOFTCAP, DOT_F32, SVEC, SCALE_F16, HAS_KEY_MASK)
    else:
        # Triton's interpreter cannot take a loaded value as a loop bound (numpy >= 2.4): a fixed
        # trip count with the tail skipped; same arithmetic
        for it in range(0, MAX_ITERS):
            if it < n_iter:
                acc0, acc1, acc2, acc3, m_i, l_i, bad = _tile(
                    it, acc0, acc1, acc2, acc3, m_i, l_i, bad, q0, q1, q2, q3, qk_scale, softcap, window_left,
                    sink_tokens, n_sink, sink_hi, start, end, pos, rep, alibi2, bt_row, stride_btp, num_blocks, km_rows, km_len,
                    K, V, KS, VS, k_head, v_head, ks_head, vs_head,
                    stride_kb, stride_kt, stride_vb, stride_vt, stride_ksb, stride_kst, stride_vsb, stride_vst,
                    HEAD_DIM, BLOCK_D, BLOCK_N, R, PAGE, ONE_PAGE, ROWS32, FMT, E5M2, NG, NGP, GW, QGROUP, SCALE_PER_GRP,
                    ASM, HAS_ALIBI, HAS_WINDOW, HAS_SOFTCAP, DOT_F32, SVEC, SCALE_F16, HAS_KEY_MASK)
    if BLOCK_ERR != 0:
        tl.atomic_or(Err + tl.zeros([BLOCK_N], tl.int32), BLOCK_ERR, mask=bad)

    # ---- epilogue ------------------------------------------------------------------------------
    if FMT == FMT_PLAIN:
        acc = acc0
    else:   # interleave the lanes back: column 4c + j <- lane j, column c
        acc = tl.reshape(tl.join(tl.join(acc0, acc2), tl.join(acc1, acc3)), (BLOCK_M, BLOCK_D))
    if R > 1:
        # merge the replicas' softmax states: [RP * R] rows -> RP query rows
        m2 = tl.reshape(m_i, (RP, R))
        m_i = tl.max(m2, 1)
        w = tl.exp2(m2 - tl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
        l_i = tl.sum(tl.reshape(l_i, (RP, R)) * w, 1)
        acc = tl.sum(tl.reshape(acc, (RP, R, BLOCK_D)) * w[:, :, None], 1)
        m = mt * RP + tl.arange(0, RP)
        row_ok = m < QPS * GROUP
        qi = m // GROUP
        head = kh * GROUP + m % GROUP
        tok = b * QPS + qi
    empty = l_i == 0.0
    inv_l = 1.0 / tl.where(empty, 1.0, l_i)
    if FMT == FMT_FP8:
        inv_l = inv_l * tl.load(VS + kh * stride_fp8s)
    o = acc * inv_l[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    if SPLIT:
        p_rows = split.to(tl.int64) * stride_ps + tok.to(tl.int64) * stride_pt + head * stride_ph
        tl.store(POut + p_rows[:, None] + d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(PLse + split.to(tl.int64) * stride_pls + tok.to(tl.int64) * stride_plt + head, lse, mask=row_ok)
    else:
        if HAS_SINKS:
            sink = tl.load(Sinks + head, mask=row_ok, other=0.0)
            mx = tl.maximum(lse, sink)
            lse_f = mx + tl.log(tl.exp(lse - mx) + tl.exp(sink - mx))
            o = o * tl.exp(lse - lse_f)[:, None]
            lse = lse_f
        o_rows = tok.to(tl.int64) * stride_ot + head * stride_oh
        if OUT_FP8:
            o = tl.clamp(o / tl.load(OutScale), -448.0, 448.0)
        o = exact_cast(o, Out.dtype.element_ty, not DYNAMIC_LOOP)
        tl.store(Out + o_rows[:, None] + d[None, :] * stride_od, o,
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(Lse + tok.to(tl.int64) * stride_lt + head * stride_lh, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits", "min_split"])
def _merge_kernel(
    POut, PLse, Out, Lse, SeqLens, Sinks, OutScale,
    window_left, num_splits, min_split,
    stride_ps, stride_pt, stride_ph, stride_pls, stride_plt,
    stride_ot, stride_oh, stride_od, stride_lt, stride_lh, kv_cap,
    NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, QPS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, NS_P: tl.constexpr, CHUNK: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, OUT_FP8: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """Combine the active splits' partial (out, lse) of BLOCK_H heads and BLOCK_D head dims of one
    query token; add the learned sinks; write out (query dtype or FP8) and lse (the first dim
    block writes it)."""
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < NUM_HEADS
    L = _seq_len(SeqLens, t // QPS, kv_cap, SeqLens, False)
    _, _, _, n_active = _split_geometry(L, window_left, 0, num_splits, min_split, QPS, HAS_WINDOW, CHUNK)
    s = tl.arange(0, NS_P)
    s_ok = s < n_active
    lse_ptr = PLse + s[:, None].to(tl.int64) * stride_pls + t.to(tl.int64) * stride_plt + h[None, :]
    lse_s = tl.load(lse_ptr, mask=s_ok[:, None] & h_ok[None, :], other=float("-inf"))    # [NS_P, BLOCK_H]
    mx = tl.max(lse_s, 0)
    mx_use = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp(lse_s - mx_use[None, :])
    den = tl.sum(w, 0)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    o_ptr = (POut + s[:, None, None].to(tl.int64) * stride_ps + t.to(tl.int64) * stride_pt
             + h[None, :, None] * stride_ph + d[None, None, :])
    o_s = tl.load(o_ptr, mask=s_ok[:, None, None] & h_ok[None, :, None] & (d < HEAD_DIM)[None, None, :], other=0.0)
    empty = den == 0.0
    o = tl.sum(o_s * w[:, :, None], 0) / tl.where(empty, 1.0, den)[:, None]
    lse = tl.where(empty, float("-inf"), mx_use + tl.log(tl.where(empty, 1.0, den)))
    if HAS_SINKS:
        sink = tl.load(Sinks + h, mask=h_ok, other=0.0)
        m2 = tl.maximum(lse, sink)
        lse_f = m2 + tl.log(tl.exp(lse - m2) + tl.exp(sink - m2))
        o = o * tl.exp(lse - lse_f)[:, None]
        lse = lse_f
    if OUT_FP8:
        o = tl.clamp(o / tl.load(OutScale), -448.0, 448.0)
    o_rows = t.to(tl.int64) * stride_ot + h * stride_oh
    tl.store(Out + o_rows[:, None] + d[None, :] * stride_od, exact_cast(o, Out.dtype.element_ty, INTERPRETED),
             mask=h_ok[:, None] & (d < HEAD_DIM)[None, :])
    if tl.program_id(2) == 0:
        tl.store(Lse + t.to(tl.int64) * stride_lt + h * stride_lh, lse, mask=h_ok)


# =================================================================================================
# Launcher
# =================================================================================================


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def config(head_dim: int, fmt: KVFormat, block_m: int, programs: int, sms: int) -> dict:
    """Tile and launch parameters from shapes (`programs` = B x Hkv x M tiles before any split):
    BLOCK_N (keys per tile), num_warps, num_stages, and `programs_per_sm` (resident programs per
    SM, for `split_count`; from the compiled registers and shared memory at D = 128, sm_90a).

    A stage holds one K and one V tile. Triton's pipeliner spends two stages on the block-table
    indirection, so `num_stages = 5` keeps two tiles of each program in flight (three buffers).
    `large_tile_splits` may double the plain format's tile."""
    if tuning.current.config:
        return dict(tuning.current.config)
    block_d = max(16, _pow2(head_dim))
    one_warp = {"BLOCK_N": 16, "num_warps": 1, "num_stages": 5, "programs_per_sm": 8}
    if fmt is KVFormat.PLAIN and block_d <= 128 and block_m <= 16 and 32 <= programs < sms // 2:
        # Few programs (B x Hkv = 32..65 on an H200): split-K makes the parallelism, and one-warp
        # programs of 16-key tiles (see below) split finer. Against 4-warp 32-key tiles (H200)
        # B = 1 at 32/32 and B = 4 at 32/8 and 64/8 run 1.00-1.15x (B = 1, ctx 1k, 32/32: 13.5 ->
        # 12.0 us); with fewer programs one warp each leaves too few bytes in flight (B = 1 at 32/4
        # 0.84-0.97x, ctx 32k 26.1 -> 31.1 us; at 32/8 0.89-0.94x below ctx 4k). From half the SMs
        # up, `large_tile_splits` takes over.
        return one_warp
    if fmt is KVFormat.PLAIN:
        # D = 128: 32 keys: 64-key tiles take 168 registers and 72 KB (3 programs per SM), and
        # 512 programs then run in 1.3 waves (H200, B=64, ctx 4k, 32/8 heads: 328 -> 249 us).
        # D <= 64: 64 keys (H200, 32/8 heads, D = 64: B=32 ctx 2k 45.6 -> 41.5 us, B=64 ctx 4k
        # 154 -> 132 us, B=128 ctx 2k 159 -> 149 us; B=1 and B=8 within 0.5-1 us).
        warps = 8 if block_m * block_d >= 64 * 256 else 4
        return {"BLOCK_N": 64 if block_d <= 64 else 32, "num_warps": warps, "num_stages": 5, "programs_per_sm": 4}
    if block_d <= 128 and block_m <= 16:
        # Quantized: one-warp programs of 16-key tiles. With 4 warps the warps of a program split
        # a tile's keys, so every tile paid cross-warp softmax reductions and a shared-memory
        # exchange of P (35 barriers per tile); one warp owns its rows and keys, and split-K
        # supplies the parallelism instead. 16-key tiles keep FP8 at 126 registers (32 keys: 254).
        # H200, 32/8 heads, ctx 4k, B = 256 / 64: 128-key 4-warp tiles -> 16-key 1-warp: FP8 701
        # -> 533 / 196 -> 162 us, INT8 966 -> 724 / 248 -> 197, INT4 761 -> 557 / 191 -> 147.
        # `programs_per_sm` 8 (16 splits more and is slower: INT8 B = 64 234 us).
        # `replicas`: with <= 8 query rows, the 16-row tile holds two copies of them, each copy
        # scoring its own 16-key tile, so one softmax step and one rescale of the accumulators
        # serve 32 keys (merged in the epilogue). H200, 32/8 heads, splits of >= 1k keys: FP8 B = 64 ctx 4k 160 -> 141 us, B = 16 ctx
        # 16k 162 -> 142, B = 256 535 -> 518; INT4 148 -> 137, 554 -> 503; INT8 1-4%; 32/32 heads
        # B = 128 within the 6-8% those points move between runs. Splits of 64-128 keys run 4-10%
        # slower (`run` keeps one tile below `Tuning.replica_min_keys` per split); four copies take 255
        # registers and spill.
        # `rows32` (FP8 only): single-page tiles as one base pointer and 32-bit row offsets, ~50
        # fewer instructions per 16 keys for +8-15 registers: FP8 B = 64 ctx 4k 147 -> 140 us
        # (R = 2), B = 16 ctx 1k 23.2 -> 21.3 (R = 1), but at one split and R = 1 the registers
        # cost occupancy (B = 256 ctx 256 41.7 -> 48.7; `run` leaves it out there); INT8/INT4
        # gain no instructions and lose up to 8%.
        return dict(one_warp, replicas=2, rows32=fmt is KVFormat.FP8)
    if block_d <= 128:
        # 32-row tiles (several query tokens per sequence): one warp would spill, and 128-key
        # 4-warp tiles spill 76-228 bytes; two warps spill nothing (168-229 registers). H200,
        # B = 64, 4 tokens x 64/8 heads, ctx 4k: FP8 572 -> 363 us, INT8 936 -> 395, INT4
        # 1147 -> 342.
        return {"BLOCK_N": 32, "num_warps": 2, "num_stages": 5, "programs_per_sm": 4}
    return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 5, "programs_per_sm": 2}   # D = 256


def large_tile_splits(programs: int, sms: int) -> int:
    """Split count for the plain format's large tiles (`LARGE_TILE_KEYS`), 0 where they do not
    pay. When the batch alone (`programs` = B x Hkv x M tiles) comes near filling the `sms`, a
    memory-bound SM streams the same bytes whether they come as a few long programs or many
    split ones, so splitting only adds the merge; larger tiles keep more bytes in flight per
    program instead. One split (two below one program per SM), as long as they fit one wave of
    `LARGE_TILE_PROGRAMS_PER_SM`. H200, 32/8 heads, 16-token pages and the static-cache layout:
    D = 64 B = 32 ctx 2k 41.8 -> 37.3 us
    (static cache 39.9 -> 36.1), B = 16 27.1 -> 24.8, B = 32 ctx 4k 73.8 -> 68.8; D = 128 B = 32
    ctx 2k 73.1 -> 68.2, B = 16 ctx 4k 73.8 -> 72.6. Fewer programs (long contexts at small
    batch) want many splits of small tiles; more than a wave (B = 64 at 8 KV heads) small tiles."""
    if programs < sms // 2:
        return 0
    splits = -(-sms // programs)
    return splits if programs * splits <= LARGE_TILE_PROGRAMS_PER_SM * sms else 0


def split_count(batch: int, num_kv_heads: int, m_tiles: int, max_blocks: int, block_size: int,
                block_n: int, group_rows: int, sms: int, programs_per_sm: int) -> int:
    """Split-K factor from shapes only (never from data: the grid is fixed under CUDA graphs).

    Models the time of the worst case (every sequence at the table's capacity) as
    waves x (keys per split + fixed cost) + the merge (kernel, plus each split's partial state,
    `2 * rows` key-equivalents of traffic), and picks the cheapest count."""
    knobs = tuning.current
    if knobs.num_splits is not None:
        return max(1, int(knobs.num_splits))
    return _cheapest_split_count(batch * num_kv_heads * m_tiles, max_blocks * block_size, block_n, group_rows,
                                 max(1, sms * programs_per_sm), knobs.min_split_tokens, knobs.max_splits, SPLIT_FIXED_COST,
                                 MERGE_COST)


@functools.lru_cache(maxsize=4096)
def _cheapest_split_count(programs: int, cap: int, block_n: int, group_rows: int, slots: int, min_tokens: int,
                          max_splits: int, fixed_cost: int, merge_cost: int) -> int:
    """`split_count`'s search (cached: it runs on every call, ~100 µs of Python at 256 splits)."""
    if programs == 0 or cap == 0:
        return 1
    min_split = max(block_n, -(-min_tokens // block_n) * block_n)
    best, best_cost = 1, None
    for s in range(1, max_splits + 1):
        per = max(min_split, _cdiv(_cdiv(cap, s), block_n) * block_n)
        if s > 1 and (s - 1) * per >= cap:
            continue                       # the last split would be empty: same as fewer splits
        waves = -(-programs * s // slots)
        cost = waves * (per + fixed_cost)
        if s > 1:
            cost += merge_cost + programs * s * 2 * group_rows / slots
        if best_cost is None or cost < best_cost * 0.97:
            best, best_cost = s, cost
    return best


def _group_layout(head_dim: int, fmt: KVFormat, k_scale) -> tuple[int, int, int, int, bool]:
    """(NG, NGP, GW, QGROUP, per_group) of the [BLOCK_N, NGP, GW] word tiles: NG scale groups of
    QGROUP values per row; a group is GW = QGROUP / 4 words when that is a power of 2 (one scale
    load per group), else one padded row with a scale gathered per value."""
    block_dw = max(16, _pow2(head_dim // 4))
    if fmt is KVFormat.FP8:
        return 1, 1, block_dw, head_dim, True
    ng = k_scale.shape[-1]
    qgroup = head_dim // ng
    gw = qgroup // 4
    if qgroup % 4 == 0 and gw & (gw - 1) == 0 and gw <= block_dw:
        return ng, block_dw // gw, gw, qgroup, True
    return ng, 1, block_dw, qgroup, False


def _word_view(cache: torch.Tensor) -> torch.Tensor | None:
    """The cache as words of 4 values: int32 for 1-byte formats, int16 for packed INT4."""
    word, size = (torch.int16, 2) if cache.dtype == torch.uint8 else (torch.int32, 4)
    if cache.shape[-1] * cache.element_size() % size or cache.data_ptr() % size:
        return None
    if any(st % size for st in cache.stride()[:-1]):
        return None
    return cache.view(word)


def split_workspace(num_splits: int, tokens: int, heads: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K partials, uninitialized: fp32 out `[num_splits, T, Hq, D]` and lse `[num_splits, T, Hq]`,
    in one allocation. A split past its sequence's keys writes neither, and the merge never reads it
    (tests poison them)."""
    rows = num_splits * tokens * heads
    space = torch.empty(rows * (head_dim + 1), dtype=torch.float32, device=device)
    return (space[:rows * head_dim].view(num_splits, tokens, heads, head_dim),
            space[rows * head_dim:].view(num_splits, tokens, heads))


def unsupported(query, k_cache, v_cache, block_tables, seq_lens, **options) -> list[str]:
    """Reasons this kernel cannot run the call (the front has validated shapes and dtypes)."""
    why = []
    d = query.shape[-1]
    if d > MAX_HEAD_DIM:
        why.append(f"head dim {d} > {MAX_HEAD_DIM} is not served by the Triton paged_decode kernel "
                   "(the fp32 accumulator and q tile would spill registers)")
    if query.dtype not in (torch.float16, torch.bfloat16):
        why.append(f"query dtype {query.dtype} is not served (fp16/bf16 only)")
    if kv_format(k_cache.dtype) is not KVFormat.PLAIN:
        if d % 4:
            why.append(f"a {k_cache.dtype} cache needs a head dim divisible by 4 (read as 4-value words), got {d}")
        elif k_cache.numel() and (_word_view(k_cache) is None or _word_view(v_cache) is None):
            why.append("a quantized cache must have 4-byte (INT4: 2-byte) aligned data and block/token/head "
                       f"strides (it is read as 4-value words); got strides {k_cache.stride()}")
    return why


def run(*args, **kwargs) -> None:
    """Fill `out [T, Hq, D]` and `lse [T, Hq]` (see the module docstring)."""
    prepare(*args, **kwargs)(*args, **kwargs)


def prepare(query, k_cache, v_cache, block_tables, seq_lens, *, out, lse, scale=None, q_scaling=1.0,
            alibi_slopes=None, window_left=-1, sink_tokens=0, sinks=None, softcap=0.0, out_scale=None,
            k_scale=None, v_scale=None, key_mask=None, num_blocks=None, block_error=errors.BLOCK_TABLES):
    """The launch of a call of this signature (`run`'s arguments; only their metadata is read):
    `launch(*args, **kwargs)` fills `out`/`lse` of a call with the same signature. Block ids
    outside `[0, num_blocks)` (default `k_cache.shape[0]`) are absent blocks, flagged with the
    error bit `block_error` (0: none)."""
    t, hq, d = query.shape
    batch = seq_lens.shape[0]
    if t == 0 or batch == 0:
        return no_launch
    _, page, hkv, _ = k_cache.shape
    fmt = kv_format(k_cache.dtype)
    e5m2 = k_cache.dtype == torch.float8_e5m2
    qps, group = t // batch, hq // hkv
    rows = qps * group
    block_m = min(MAX_BLOCK_M if fmt is KVFormat.PLAIN else MAX_BLOCK_M_QUANTIZED, max(16, _pow2(rows)))
    m_tiles = -(-rows // block_m)
    sms = gpu.sm_count(query.device, cpu=INTERPRETER_SMS)
    cfg = config(d, fmt, block_m, batch * hkv * m_tiles, sms)
    knobs = tuning.current
    if fmt.group_scaled and not _group_layout(d, fmt, k_scale)[4] and not knobs.config:
        # scales gathered per value (group not 4 x a power of 2): small tiles, no deep pipeline
        cfg = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    if fmt is KVFormat.PLAIN:
        block_d = max(16, _pow2(d))
        block_dw = 16
    else:
        block_dw = max(16, _pow2(d // 4))
        block_d = 4 * block_dw
    max_blocks = block_tables.shape[1]
    # With one page per sequence every key is in it: any tile lies in one page (and one compiled
    # kernel serves every page size, e.g. the lengths of Hugging Face static caches).
    page_span = ONE_PAGE_SPAN if max_blocks == 1 else page
    num_splits = 0
    if (fmt is KVFormat.PLAIN and block_d in LARGE_TILE_KEYS and block_m <= LARGE_TILE_MAX_BLOCK_M
            and not knobs.config and knobs.num_splits is None):
        num_splits = large_tile_splits(batch * hkv * m_tiles, sms)
        if num_splits:
            cfg = dict(cfg, BLOCK_N=LARGE_TILE_KEYS[block_d])
        keys, short_cfg = knobs.short_context.get(block_d, (0, {}))
        if num_splits > 1 and block_m == 16 and max_blocks * page <= keys:
            num_splits = 1
            cfg.update(short_cfg)
    block_n = cfg["BLOCK_N"]
    if not num_splits:
        per_sm = knobs.programs_per_sm or cfg.get("programs_per_sm", 2)
        num_splits = split_count(batch, hkv, m_tiles, max_blocks, page, block_n, rows, sms, per_sm)
    replicas = max(1, min(cfg.get("replicas", 1), block_m // _pow2(rows)))
    # one tile per step for short splits, and for FP8 at D <= 64 in one split with GQA, where the
    # registers of two copies (126 against 71) cost more occupancy than they save instructions
    # (H200, B = 256, 32/8, ctx 1k / 4k: 82 / 368 us against 100 / 401; 32/32 heads gain from the copies)
    if not knobs.config and (max_blocks * page < knobs.replica_min_keys * num_splits
                                or (fmt is KVFormat.FP8 and d <= 64 and num_splits == 1 and group > 1)):
        replicas = 1
    chunk = replicas * block_n      # keys per loop step
    min_split = max(chunk, -(-knobs.min_split_tokens // chunk) * chunk)

    kc, vc, ks, vs = k_cache, v_cache, k_scale, v_scale
    ng, ngp, gw, qgroup, per_grp = 1, 1, block_dw, d, True
    ks_strides = vs_strides = (0, 0, 0)
    fp8_stride = 0
    svec = 1
    scales = "none"   # how a call passes its scales (`scale_operands`)
    if fmt is not KVFormat.PLAIN:
        kc, vc = _word_view(k_cache), _word_view(v_cache)
        ng, ngp, gw, qgroup, per_grp = _group_layout(d, fmt, k_scale)
        scales = "given"
    if fmt is KVFormat.FP8:
        fp8_stride = 1 if k_scale.dim() == 1 else 0
        if v_scale.dim() != k_scale.dim():
            # per-head K scale with a 0-d V scale (or the reverse): one stride serves both
            scales, fp8_stride = "per_head", 1
    elif fmt.group_scaled:
        if (k_scale.shape[-1] > 1 and k_scale.stride(-1) != 1) or (v_scale.shape[-1] > 1 and v_scale.stride(-1) != 1):
            ks, vs, scales = k_scale.contiguous(), v_scale.contiguous(), "contiguous"   # rare: strided last dim
        ks_strides, vs_strides = ks.stride()[:3], vs.stride()[:3]
        if per_grp:
            # the largest power of two (<= the groups per row) dividing every scale-row offset (of
            # the base address, only what the call's signature fixes: its alignment up to 16 bytes)
            vals = [*ks_strides, *vs_strides, *(_alignment(x) // x.element_size() for x in (ks, vs))]
            while svec * 2 <= ng and all(v % (svec * 2) == 0 for v in vals):
                svec *= 2
    asm = False
    if fmt is not KVFormat.PLAIN:
        asm = knobs.dequant_asm if knobs.dequant_asm is not None else (query.device.type == "cuda" and not interpreting())
        words_per_thread = block_n * ngp * gw // (32 * cfg["num_warps"])
        asm = bool(asm) and words_per_thread >= 2 and words_per_thread % 2 == 0

    no_tables = torch.zeros(1, 1, dtype=torch.int32, device=query.device) if not block_tables.numel() else None
    bt = block_tables if no_tables is None else no_tables
    one_page = page_span % block_n == 0
    # single-page tiles may address their rows with 32-bit offsets from the tile's first row
    rows32 = (one_page and cfg.get("rows32", False) and (replicas > 1 or num_splits > 1)
              and (block_n - 1) * max(kc.stride(1), vc.stride(1), ks_strides[1], vs_strides[1]) + d < 2**31)
    split = num_splits > 1
    if split:
        p_strides = (t * hq * d, hq * d, d, t * hq, hq)   # split_workspace's contiguous partials
    else:
        p_strides = (0, 0, 0, 0, 0)

    scale_eff = (scale if scale is not None else 1.0 / math.sqrt(d)) / q_scaling
    has_window = window_left >= 0
    static_loop = interpreting()
    max_iters = 1
    if static_loop:
        cap = max_blocks * page
        per = max(min_split, _cdiv(_cdiv(cap, num_splits), chunk) * chunk)
        max_iters = max(1, _cdiv(min(per, cap), chunk) + 1
                        + (_cdiv(min(sink_tokens, cap), chunk) if has_window else 0))
    main = TritonLaunch(_paged_decode_kernel, (batch * hkv * m_tiles, num_splits), (
        float(scale_eff), float(softcap), int(window_left), int(sink_tokens), num_splits, min_split,
        query.stride(0), query.stride(1), query.stride(2),
        kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2),
        *ks_strides, *vs_strides, fp8_stride,
        bt.stride(0), bt.stride(1),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        *p_strides, *((key_mask.stride(0), key_mask.shape[1]) if key_mask is not None else (0, 0)),
        max_blocks * page, k_cache.shape[0] if num_blocks is None else num_blocks,
    ), dict(
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_DW=block_dw, BLOCK_M=block_m, BLOCK_N=block_n, R=replicas, M_TILES=m_tiles,
        PAGE=page_span, ONE_PAGE=one_page, ROWS32=rows32, QPS=qps, GROUP=group, NUM_KV_HEADS=hkv,
        FMT=fmt.code, E5M2=e5m2, NG=ng, NGP=ngp, GW=gw, QGROUP=qgroup, SCALE_PER_GRP=per_grp, ASM=asm,
        PRESCALE_Q=fmt is not KVFormat.PLAIN and query.dtype == torch.bfloat16,
        HAS_ALIBI=alibi_slopes is not None, HAS_WINDOW=has_window, HAS_SOFTCAP=softcap > 0,
        HAS_SINKS=sinks is not None, OUT_FP8=out_scale is not None, SPLIT=split,
        DYNAMIC_LOOP=not static_loop, MAX_ITERS=max_iters if static_loop else 1,
        DOT_F32=static_loop and fmt is KVFormat.PLAIN and query.dtype == torch.bfloat16, SVEC=svec,
        SCALE_F16=ks is not None and vs is not None and ks.dtype == vs.dtype == torch.float16,
        HAS_KEY_MASK=key_mask is not None, BLOCK_ERR=block_error,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    ))
    merge = None
    if split:
        # tiles of <= merge_tile partials: heads while they fit, then head-dim blocks
        ns_p = _pow2(num_splits)
        block_h = min(_pow2(hq), max(1, knobs.merge_tile // (ns_p * block_d)))
        merge_d = min(block_d, max(16, knobs.merge_tile // ns_p))
        merge = TritonLaunch(_merge_kernel, (t, -(-hq // block_h), block_d // merge_d), (
            int(window_left), num_splits, min_split, *p_strides,
            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), max_blocks * page,
        ), dict(
            NUM_HEADS=hq, BLOCK_H=block_h, QPS=qps, HEAD_DIM=d, BLOCK_D=merge_d,
            NS_P=ns_p, CHUNK=chunk, HAS_WINDOW=has_window,
            HAS_SINKS=sinks is not None, OUT_FP8=out_scale is not None, INTERPRETED=static_loop,
            num_warps=4,
        ))
    word = (torch.int16 if k_cache.dtype == torch.uint8 else torch.int32) if fmt is not KVFormat.PLAIN else None
    flag = errors.device_flag(query.device)

    def launch(query, k_cache, v_cache, block_tables, seq_lens, *, out, lse, alibi_slopes=None, sinks=None,
               out_scale=None, k_scale=None, v_scale=None, key_mask=None, **_):
        kc, vc = (k_cache, v_cache) if word is None else (k_cache.view(word), v_cache.view(word))
        ks, vs = scale_operands(scales, k_scale, v_scale, hkv, lse)
        pout, plse = split_workspace(num_splits, t, hq, d, query.device) if split else (lse, lse)
        sinks_ = lse if sinks is None else sinks
        out_scale_ = lse if out_scale is None else out_scale
        main(query, kc, vc, ks, vs, block_tables if no_tables is None else no_tables, seq_lens, sinks_,
             lse if alibi_slopes is None else alibi_slopes, out_scale_, out, lse, pout, plse,
             lse if key_mask is None else key_mask.view(torch.uint8), flag)
        if merge is not None:
            merge(pout, plse, out, lse, seq_lens, sinks_, out_scale_)

    launch.describe = (f"Triton paged_decode, grid {batch * hkv * m_tiles} x {num_splits} split(s)"
                       f"{' + merge' if split else ''}: {block_m} query rows x {block_n}-key tiles"
                       f"{f' ({replicas} per step)' if replicas > 1 else ''}, {cfg['num_warps']} warps, "
                       f"{cfg['num_stages']} stages")
    launch.kernels = (main,) if merge is None else (main, merge)
    launch.num_splits = num_splits
    return launch


def _alignment(x: torch.Tensor) -> int:
    """The largest power of two, up to 16, that divides `x`'s address in bytes."""
    a = x.data_ptr() % 16
    return a & -a if a else 16
