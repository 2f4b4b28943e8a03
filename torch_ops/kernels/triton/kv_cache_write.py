"""Triton `attn::kv_cache_write`: scatter new key/value tokens into a paged KV cache at
`slot_mapping`, quantized to the cache format, with RoPE on key (and query) fused in.

Semantics: docs/ops.md ("KV cache", `kv_cache_write`); `reference.kv_cache_write` is the oracle.

Design
- **One launch, two kinds of programs**, in a 1-D grid sized from shapes only (CUDA-graph safe).
  Programs `[0, n_kv)` each own `BT_KV` tokens x `BH_KV` KV heads of both key and value (one slot
  lookup; both tiles are loaded before anything is stored). Programs `[n_kv, n_kv + n_q)` own
  `BT_Q` tokens x `BH_Q` query heads and write the rotated query (only when `query` is given).
- **Tiles are `[tokens, heads, NGP, GP]`**, head dim `d = g * QGROUP + e` (group `g < NG`,
  element `e < QGROUP`, both padded to powers of 2 and masked). For INT8/INT4 a group is a scale
  group, so its absmax is a reduction over the last axis; plain and FP8 rows are one group
  (`QGROUP = D`). Head dims and groups that are not powers of 2 (80, 96; 24, 48) are masks.
- **Addresses** are int64: `block * stride_b + offset * stride_t + head * stride_h + d`, any
  cache strides with a contiguous last dim (NHD, HND, combined, vLLM views); the block size is
  a compile-time constant (no 64-bit division per token). A negative or out-of-range slot skips
  the token (its key and value are not even read); a position outside `cos_sin_cache` is clamped
  into it: nothing is read or written out of bounds. Out-of-range slots and positions set their
  bits in the device error flag (`torch_ops.errors`).
- **Numbers are the reference's, bit for bit.** Plain caches without RoPE get the loaded bits.
  FP8: `clamp(x / scale)`, then the round-to-nearest-even convert. INT8/INT4, per group:
  `s = max(div_rn(absmax, qmax), 1e-5)` rounded to the scale-cache dtype, then
  `q = rint(x * RN(1 / s))` with the product exact (one FMA per element, `_rint_mul`; the
  reference's clamp never acts), INT4 as `q + 8` nibbles, even element low. The divisions are
  correctly rounded (FP8's per element by `_div_rn`: a reciprocal per scale and two FMAs per
  element; `absmax / qmax` by the constant `RN(1 / qmax)` and the same correction,
  `_div_by_qmax`; Triton's `/` is approximate on the GPU). RoPE is fp32 in the reference's operation
  order (`a*cos - b*sin` as a true subtraction: Triton's `-x` is `0 - x`, which loses the sign
  of a zero), compiled with `enable_fp_fusion=False` so that no FMA contraction changes a
  rounding. NeoX loads each element's partner `d +- rot/2` a second time (an L1 hit), except
  into FP8 caches with the whole head dim rotated, where a tile holds the rows' lower halves
  and the upper halves come in a second tile of the same layout (`split_halves`); GPT-J
  swaps adjacent pairs in registers (reshape + split + join). Plain caches get the rotated key
  rounded to the key dtype, as the reference does.
- Under TRITON_INTERPRET=1 the fp32 -> bf16/fp8 casts truncate (or round ties away without a
  carry), so there `_cast` first rounds in fp32 to a value of the target dtype.

Bandwidth (target: >= 85 % of a device-to-device copy of the same bytes, RoPE fused)
- Bytes: k/v (and q) are read once, cache rows (and the rotated q) written once: per token at
  Hkv=8, Hq=32, D=128, bf16, 4 KB k/v in + 4 KB out and 8 + 8 KB of q. cos/sin rows
  (`rot * 4` B per token, shared by the heads of a tile) mostly hit L2, NeoX partners L1.
- In flight: HBM3/HBM3e need ~2.5-3.5 MB in flight (3.35-4.8 TB/s x ~0.7 us), ~20-27 KB per
  SM. A program loads `Tuning.tile_elems` (2048 plain/FP8, 4096 INT8/INT4) elements of k and of v (8-16
  KB in bf16) before its first store; at 4 warps and 48-128 registers (sm_90 build) 4-10
  programs are resident per SM.
- Access width: the head-dim axis is contiguous (Triton specializes stride 1 and 16-byte
  alignment), so every k/v/q load and bf16 store is 16 B (`ld/st.global.v4.b32` in the PTX);
  scattered (token, head) rows are whole 32-B sectors (256 B bf16, 128 B FP8, 64 B INT4), and
  in NHD a token's group scales for all heads are adjacent (written by one program).
- Cache hints: from `Tuning.stream_min_tokens` tokens on, k/v/q are loaded `evict_first` and every row
  is stored `.cs` (streaming): each byte crosses once. Together (neither alone) they take T = 16k
  on an H200 from 82-92 to 85-99 % of copy, except INT8 k/v (90 -> 88) and INT4 RoPE on k (80 ->
  81); at T = 64-256 (decode batches, 2-3 us) the same hints cost 0.1-0.6 us.
- Shared memory only for small layout conversions (cos/sin rows, group scales, 1-byte codes),
  never for a whole bf16 tile: GPT-J's cos/sin pointers are spelled out per head so that Triton
  loads them in the tile's layout instead of converting the tile (checked in the sm_90 PTX).
- Issue budget: at 85 % of ~3.0 (H100) / ~4.3 (H200) TB/s a bf16 -> 1-byte element may take
  ~35 / ~25 instructions, and a division per element (`div.rn.f32`) alone takes ~12. So FP8
  multiplies by a reciprocal per scale (`_div_rn`, 3 instructions per element), `absmax / qmax`
  takes no division call (`_div_by_qmax`), INT8/INT4 codes are `rint(x * RN(1 / s))` in one FMA
  that adds 1.5 * 2^23 (`_rint_mul`, no clamps), and INT8/INT4 programs are capped at
  `GROUP_MAX_REGISTERS`. sm_90 build: ~13 SASS instructions per element for FP8 (plain: ~3);
  H200, T = 16k: INT8 88-90 %, INT4 90 % of copy.
- Small T is latency-bound: tiles shrink (fewer tokens per program) while the grid has fewer
  than `Tuning.min_programs_per_sm` programs per SM.

A value head dim of its own (`D_v != D`, the MLA latent cache) runs the kernel of `latent_cache_write.py`.

Not served (`unsupported` says why): head dims above `MAX_HEAD_DIM`; GPT-J RoPE on an INT8 cache
with an odd quant group (a rotated pair would straddle two groups).
Knobs (tests, tuning): `Tuning`, changed inside `with tuning(tile_elems=..., num_warps=...):`.
"""

from __future__ import annotations

import dataclasses
import struct

import torch
import triton
import triton.language as tl

from ... import errors, gpu
from ...quant import KVFormat, kv_format
from . import cdiv, interpreting, pow2
from .formats import FMT_FP8, FMT_INT4, FMT_INT8, FMT_PLAIN
from .launcher import TritonLaunch
from .tuning import Knobs
from .interpreter import exact_cast


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The kernel's tuning knobs, read when a launch is prepared (`tuning`)."""

    # elements of one tensor (k, v or q) per program, by cache format (H200, T = 16k): 2048 for plain
    # and FP8 caches (FP8 k/v 92 vs 87% of copy at 4096), 4096 for INT8/INT4 (INT4 RoPE on k 80 vs 68%)
    tile_elems: dict = dataclasses.field(default_factory=lambda: {
        KVFormat.PLAIN: 2048, KVFormat.FP8: 2048, KVFormat.INT8: 4096, KVFormat.INT4: 4096})
    num_warps: int = 4
    min_programs_per_sm: int = 4   # shrink tiles for small T until the grid has this many programs per SM
    stream_min_tokens: int = 2048  # from this many tokens on, streaming cache hints (module docstring)
    split_rope: bool = True        # FP8 rows as two halves for NeoX RoPE over the whole head dim (split_halves)


tuning = Knobs(Tuning())   # `with kv_cache_write.tuning(num_warps=8): ...`

# INT8/INT4: registers per thread kept at 96, five 4-warp programs per SM (INT8 with a query
# otherwise takes 100, four per SM: rope_qk at T = 16k 104.5 -> 111.0 us on an H200)
GROUP_MAX_REGISTERS = 96
MAX_HEAD_DIM = 1024
# RN(1 / qmax) in fp32 (the fp64 quotient rounds to the same fp32 value for 127 and 7)
_QMAX_RCP = {f: struct.unpack("f", struct.pack("f", 1 / f.qmax))[0] for f in KVFormat if f.group_scaled}
_ERR_SLOT = tl.constexpr(errors.SLOT_MAPPING)
_ERR_POS = tl.constexpr(errors.POSITIONS)


# =================================================================================================
# Kernel
# =================================================================================================


@triton.jit
def _rope(x, ptrs, mask, stride_d, cs_rows, cs_ok, stride_csd, g, e,
          BT: tl.constexpr, BH: tl.constexpr, NGP: tl.constexpr, GP: tl.constexpr,
          QGROUP: tl.constexpr, ROT: tl.constexpr, NEOX: tl.constexpr):
    """Rotary embedding of the fp32 tile `x [BT, BH, NGP, GP]` (dims `d = g * QGROUP + e`, loaded
    from `ptrs` under `mask`). `cs_rows [BT]` point at each token's cos/sin row."""
    HALF: tl.constexpr = ROT // 2
    if NEOX:
        # pairs (d, d + HALF); the partner is loaded again (an L1 hit)
        cs = cs_rows[:, None, None, None]
        d = g * QGROUP + e
        rot = d < ROT
        first = d < HALF
        i = tl.where(first, d, d - HALF)
        cs_mask = cs_ok[:, None, None, None] & rot
        c = tl.load(cs + i * stride_csd, mask=cs_mask, other=0.0).to(tl.float32)
        s = tl.load(cs + (i + HALF) * stride_csd, mask=cs_mask, other=0.0).to(tl.float32)
        # a select of pointers, not of offsets: Triton then sees 16-byte runs (Triton 3.9 made one
        # 2-byte load per element of `ptrs + where(first, HALF, -HALF)`)
        p = tl.load(tl.where(first, ptrs + HALF * stride_d, ptrs - HALF * stride_d), mask=mask & rot, other=0.0).to(tl.float32)
        xc = x * c
        ps = p * s
        return tl.where(rot, tl.where(first, xc - ps, xc + ps), x)
    else:
        # pairs (2i, 2i + 1), adjacent in the tile: the partner is the pair swapped in registers
        # (reshape + split + join), cos/sin are loaded once per pair and duplicated the same way.
        # Their pointers are spelled out for every head so that Triton loads them in the tile's
        # layout (L1 hits) instead of converting the whole tile through shared memory.
        i = g * (QGROUP // 2) + tl.arange(0, GP // 2)[None, :]
        rot2 = i < HALF
        heads = tl.zeros((1, BH, 1, 1), tl.int32)
        cs = cs_rows[:, None, None, None] + heads
        cs_mask = (cs_ok[:, None, None, None] & (heads == 0)) & rot2
        c2 = tl.load(cs + i * stride_csd, mask=cs_mask, other=0.0).to(tl.float32)
        s2 = tl.load(cs + (i + HALF) * stride_csd, mask=cs_mask, other=0.0).to(tl.float32)
        c = tl.reshape(tl.join(c2, c2), (BT, BH, NGP, GP))
        s = tl.reshape(tl.join(s2, s2), (BT, BH, NGP, GP))
        a, b = tl.split(tl.reshape(x, (BT, BH, NGP, GP // 2, 2)))
        p = tl.reshape(tl.join(b, a), (BT, BH, NGP, GP))
        rot = tl.reshape(tl.join(rot2, rot2), (NGP, GP))
        xc = x * c
        ps = p * s
        return tl.where(rot, tl.where(e % 2 == 0, xc - ps, xc + ps), x)


@triton.jit
def _rope_halves(lo, hi, cs_rows, cs_ok, stride_csd, d, HALF: tl.constexpr):
    """NeoX RoPE over the whole head dim of the fp32 tiles `lo` (dims `d < HALF`) and `hi` (dims
    `d + HALF`), which share one layout: every element is loaded once and meets its partner in
    the same thread. `cs_rows`/`cs_ok` broadcast to the tiles. The same operations as `_rope`."""
    c = tl.load(cs_rows + d * stride_csd, mask=cs_ok, other=0.0).to(tl.float32)
    s = tl.load(cs_rows + (d + HALF) * stride_csd, mask=cs_ok, other=0.0).to(tl.float32)
    return lo * c - hi * s, hi * c + lo * s


@triton.jit
def _div_rn(x, s, INTERPRETED: tl.constexpr):
    """`x / s` correctly rounded, with one division per scale instead of one per element: the
    reciprocal `r = RN(1 / s)`, `q = RN(x * r)` (within an ulp), then Markstein's correction
    `RN(q + RN(x - s * q) * r)`, both steps FMAs, which is the correctly rounded quotient
    (Markstein's theorem; checked against exact rational arithmetic on 60k adversarial cases).
    The correction would turn x = -0 into +0 and an overflowing quotient into NaN: a select per
    element keeps those as the division does. The interpreter's FMA rounds twice, so there it
    divides per element."""
    if INTERPRETED:
        return tl.math.div_rn(x, s)
    r = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
    q = x * r
    corrected = tl.math.fma(tl.math.fma(q, -s, x), r, q)   # -s per scale: Triton negates as 0 - x
    return tl.where((x == 0) | (tl.abs(q) == float("inf")), q, corrected)


@triton.jit
def _rint_mul(x, r, MAGIC: tl.constexpr, INTERPRETED: tl.constexpr):
    """The fp32 bits of `MAGIC + rint(x * r)`, the product exact and rounded once to an integer
    (ties to even): one FMA, `x * r + MAGIC` with `MAGIC = 1.5 * 2^23 (+ offset)`, whose ulp is 1.
    The interpreter's FMA rounds twice; there the exact product and its rounding are fp64."""
    if INTERPRETED:
        y = (x.to(tl.float64) * r.to(tl.float64) + 6755399441055744.0) - 6755399441055744.0   # 1.5 * 2^52
        return (y.to(tl.float32) + MAGIC).to(tl.int32, bitcast=True)
    return tl.math.fma(x, r, MAGIC).to(tl.int32, bitcast=True)


@triton.jit
def _div_by_qmax(amax, QMAX: tl.constexpr, QMAX_RCP: tl.constexpr, INTERPRETED: tl.constexpr):
    """`amax / QMAX` correctly rounded, without a division: `_div_rn`'s Markstein correction with
    the constant reciprocal `QMAX_RCP = RN(1 / QMAX)` (checked against exact rational arithmetic
    on 400k random fp32 values, subnormals included, for 7 and 127). +inf stays +inf."""
    if INTERPRETED:
        return tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32))
    q = amax * QMAX_RCP
    corrected = tl.math.fma(tl.math.fma(q, -QMAX, amax), QMAX_RCP, q)
    return tl.where(q == float("inf"), q, corrected)


@triton.jit
def _store(x, Cache, rows, scales, stride_sg, row_ok, g, e,
           FMT: tl.constexpr, FP8_MAX: tl.constexpr, QMAX: tl.constexpr, QMAX_RCP: tl.constexpr,
           BT: tl.constexpr, BH: tl.constexpr, NG: tl.constexpr, NGP: tl.constexpr, GP: tl.constexpr,
           QGROUP: tl.constexpr, INTERPRETED: tl.constexpr, STORE_CM: tl.constexpr, FLAT_ROWS: tl.constexpr = False):
    """Write the tile `x [BT, BH, NGP, GP]` to the cache rows `rows [BT, BH, 1, 1]` (pointers)
    where `row_ok`, in the cache format. `x` is fp32, or the cache dtype for plain caches.
    `scales`: FP8: the fp32 scale of each head `[1, BH, 1, 1]`; INT8/INT4: pointers to each row's
    first group scale `[BT, BH, 1, 1]`. `FLAT_ROWS` (INT4 without padded groups): the packed row is
    stored as one run of bytes instead of group by group."""
    ok = row_ok & (g < NG) & (e < QGROUP)
    d = g * QGROUP + e
    if FMT == FMT_PLAIN:
        tl.store(rows + d, exact_cast(x, Cache.dtype.element_ty, INTERPRETED), mask=ok, cache_modifier=STORE_CM)
    elif FMT == FMT_FP8:
        y = _div_rn(x, scales, INTERPRETED)
        if INTERPRETED:
            # on the GPU the convert saturates (cvt.rn.satfinite): the clamp for finite and
            # infinite y, and NaN stays NaN as in the reference (min/max would make it -FP8_MAX)
            y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
        tl.store(rows + d, exact_cast(y, Cache.dtype.element_ty, INTERPRETED), mask=ok, cache_modifier=STORE_CM)
    else:
        amax = tl.max(tl.abs(x), axis=3, keep_dims=True)                   # [BT, BH, NGP, 1]
        s = tl.maximum(_div_by_qmax(amax, QMAX, QMAX_RCP, INTERPRETED), 1e-5)
        # a NaN in a group makes its scale NaN (the group reads back as NaN), as in the reference:
        # the max reductions above skip NaN on the GPU
        nan = tl.max((x != x).to(tl.int32), axis=3, keep_dims=True) > 0
        s = tl.where(nan, float("nan"), s).to(scales.dtype.element_ty)
        tl.store(scales + g * stride_sg, s, mask=row_ok & (g < NG), cache_modifier=STORE_CM)
        # s = max(absmax / QMAX, 1e-5) rounded to fp16 or fp32 is at most 0.3% below absmax / QMAX
        # (fp16 subnormals just above the floor; 2^-11 for normal fp16), so |x * RN(1 / s)| <
        # QMAX + 0.5 and rint never leaves [-QMAX, QMAX]: the reference's clamp is left out
        # (tested with the worst bf16 inputs). The low bits of the sum are rint(x * r) (+ 8 for
        # the INT4 offset), two's complement.
        r = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s.to(tl.float32))
        bits = _rint_mul(x, r, 12582912.0 + (8.0 if FMT == FMT_INT4 else 0.0), INTERPRETED)
        if FMT == FMT_INT8:
            tl.store(rows + d, bits.to(tl.int8), mask=ok, cache_modifier=STORE_CM)
        else:
            lo, hi = tl.split(tl.reshape(bits, (BT, BH, NGP, GP // 2, 2)))
            # bits 4-7 of the low byte are 0 (q + 8 is in [1, 15]): one multiply-add per byte
            packed = (hi * 16 + lo).to(tl.uint8)
            if FLAT_ROWS:
                # groups unpadded: each row's bytes stored as one contiguous run, in 16-byte pieces
                # (the group pieces below leave half of every 32-byte sector to a second store:
                # H200 T = 16k, RoPE on k 84% of copy against 82%)
                ROW: tl.constexpr = NGP * GP // 2
                flat = tl.reshape(packed, (BT, BH, 1, ROW))
                b = tl.arange(0, ROW)[None, None, None, :]
                tl.store(rows + b, flat, mask=row_ok, cache_modifier=STORE_CM)
            else:
                j = tl.arange(0, GP // 2)[None, :]
                byte = g * (QGROUP // 2) + j
                tl.store(rows + byte, packed, mask=row_ok & (g < NG) & (j < QGROUP // 2), cache_modifier=STORE_CM)


@triton.jit
def rope_position(Positions, t, t_ok, stride_pos, max_position, Err, FLAG: tl.constexpr):
    """Token `t`'s RoPE position clamped into the table's rows `[0, max_position)` (with FLAG, one
    outside it sets its bit in `Err`), int64, and whether its cos/sin row may be read."""
    pos = tl.load(Positions + t.to(tl.int64) * stride_pos, mask=t_ok, other=0).to(tl.int64)
    if FLAG:
        tl.atomic_or(Err + t * 0, _ERR_POS, mask=t_ok & ((pos < 0) | (pos >= max_position)))
    pos = tl.minimum(tl.maximum(pos, 0), max_position - 1)
    return pos, t_ok & (pos >= 0)   # -1: an empty table


@triton.jit(do_not_specialize=["num_tokens", "num_kv_programs"])   # per-step values: one compiled kernel
def _kv_cache_write_kernel(
    Key, Value, KCache, VCache, KScale, VScale, Slots, Positions, CosSin, Query, QOut, Err,
    num_tokens, num_slots, max_position, num_kv_programs,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    stride_ksb, stride_kst, stride_ksh, stride_ksg, stride_vsb, stride_vst, stride_vsh, stride_vsg,
    stride_slot, stride_pos, stride_cs, stride_csd,
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
    NUM_KV_HEADS: tl.constexpr, NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    FMT: tl.constexpr, FP8_MAX: tl.constexpr, QMAX: tl.constexpr, QMAX_RCP: tl.constexpr,
    QGROUP: tl.constexpr, NG: tl.constexpr, NGP: tl.constexpr, GP: tl.constexpr, DP: tl.constexpr,
    ROPE: tl.constexpr, NEOX: tl.constexpr, ROT: tl.constexpr, HAS_QUERY: tl.constexpr, SPLIT: tl.constexpr,
    FLAT_ROWS: tl.constexpr,
    BT_KV: tl.constexpr, BH_KV: tl.constexpr, BT_Q: tl.constexpr, BH_Q: tl.constexpr,
    INTERPRETED: tl.constexpr, LOAD_EVICT: tl.constexpr, STORE_CM: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < num_kv_programs:
        # ---- key and value of BT_KV tokens x BH_KV heads -----------------------------------
        HB: tl.constexpr = (NUM_KV_HEADS + BH_KV - 1) // BH_KV
        t = (pid // HB) * BT_KV + tl.arange(0, BT_KV)
        h = (pid % HB) * BH_KV + tl.arange(0, BH_KV)
        g = tl.arange(0, NGP)[:, None]
        e = tl.arange(0, GP)[None, :]
        d = g * QGROUP + e
        t_ok = t < num_tokens
        slot = tl.load(Slots + t.to(tl.int64) * stride_slot, mask=t_ok, other=-1).to(tl.int64)
        tl.atomic_or(Err + t * 0, _ERR_SLOT, mask=slot >= num_slots)
        w_ok = t_ok & (slot >= 0) & (slot < num_slots)
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        t4 = t.to(tl.int64)[:, None, None, None]
        h4 = h.to(tl.int64)[None, :, None, None]
        row_ok = w_ok[:, None, None, None] & (h4 < NUM_KV_HEADS)
        ld_ok = row_ok & (g < NG) & (e < QGROUP)
        k_ptrs = Key + t4 * stride_kt + h4 * stride_kh + d
        v_ptrs = Value + t4 * stride_vt + h4 * stride_vh + d
        k = tl.load(k_ptrs, mask=ld_ok, other=0.0, eviction_policy=LOAD_EVICT)
        v = tl.load(v_ptrs, mask=ld_ok, other=0.0, eviction_policy=LOAD_EVICT)
        if SPLIT:  # the tile is each row's lower half; the upper half comes in tiles of the same layout
            k_hi = tl.load(k_ptrs + HEAD_DIM // 2, mask=ld_ok, other=0.0, eviction_policy=LOAD_EVICT)
            v_hi = tl.load(v_ptrs + HEAD_DIM // 2, mask=ld_ok, other=0.0, eviction_policy=LOAD_EVICT)
        if ROPE:
            pos, pos_ok = rope_position(Positions, t, t_ok, stride_pos, max_position, Err, True)
            if SPLIT:
                # cos/sin pointers spelled out for every head: loaded in the tile's layout (L1 hits)
                heads = tl.zeros((1, BH_KV, 1, 1), tl.int32)
                cs_rows = (CosSin + pos * stride_cs)[:, None, None, None] + heads
                k, k_hi = _rope_halves(k.to(tl.float32), k_hi.to(tl.float32), cs_rows,
                                       pos_ok[:, None, None, None] & (heads == 0), stride_csd, d, HEAD_DIM // 2)
            else:
                k = _rope(k.to(tl.float32), k_ptrs, ld_ok, 1, CosSin + pos * stride_cs, pos_ok, stride_csd, g, e,
                          BT_KV, BH_KV, NGP, GP, QGROUP, ROT, NEOX)
        if FMT != FMT_PLAIN:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            if SPLIT:
                v_hi = v_hi.to(tl.float32)
        block4 = block[:, None, None, None]
        offset4 = offset[:, None, None, None]
        k_rows = KCache + block4 * stride_kcb + offset4 * stride_kct + h4 * stride_kch
        v_rows = VCache + block4 * stride_vcb + offset4 * stride_vct + h4 * stride_vch
        if FMT == FMT_FP8:
            # per-head (or per-tensor: stride 0) values, loaded once per head
            hs = tl.where(h < NUM_KV_HEADS, h, 0)
            k_scales = tl.load(KScale + hs * stride_ksh)[None, :, None, None]
            v_scales = tl.load(VScale + hs * stride_vsh)[None, :, None, None]
        else:
            k_scales = KScale + block4 * stride_ksb + offset4 * stride_kst + h4 * stride_ksh
            v_scales = VScale + block4 * stride_vsb + offset4 * stride_vst + h4 * stride_vsh
        _store(k, KCache, k_rows, k_scales, stride_ksg, row_ok, g, e,
               FMT, FP8_MAX, QMAX, QMAX_RCP, BT_KV, BH_KV, NG, NGP, GP, QGROUP, INTERPRETED, STORE_CM, FLAT_ROWS)
        _store(v, VCache, v_rows, v_scales, stride_vsg, row_ok, g, e,
               FMT, FP8_MAX, QMAX, QMAX_RCP, BT_KV, BH_KV, NG, NGP, GP, QGROUP, INTERPRETED, STORE_CM, FLAT_ROWS)
        if SPLIT:
            _store(k_hi, KCache, k_rows, k_scales, stride_ksg, row_ok, g + NG // 2, e,
                   FMT, FP8_MAX, QMAX, QMAX_RCP, BT_KV, BH_KV, NG, NGP, GP, QGROUP, INTERPRETED, STORE_CM)
            _store(v_hi, VCache, v_rows, v_scales, stride_vsg, row_ok, g + NG // 2, e,
                   FMT, FP8_MAX, QMAX, QMAX_RCP, BT_KV, BH_KV, NG, NGP, GP, QGROUP, INTERPRETED, STORE_CM)
    elif HAS_QUERY:
        # ---- rotated query of BT_Q tokens x BH_Q heads (names differ from the branch above:
        # a variable assigned in both branches of a runtime `if` must keep one type)
        HB_Q: tl.constexpr = (NUM_Q_HEADS + BH_Q - 1) // BH_Q
        qpid = pid - num_kv_programs
        tq = (qpid // HB_Q) * BT_Q + tl.arange(0, BT_Q)
        hq = ((qpid % HB_Q) * BH_Q + tl.arange(0, BH_Q)).to(tl.int64)[None, :, None, None]
        dq = tl.arange(0, DP)[None, :]
        tq_ok = tq < num_tokens
        tq4 = tq.to(tl.int64)[:, None, None, None]
        q_ok = tq_ok[:, None, None, None] & (hq < NUM_Q_HEADS) & (dq < HEAD_DIM)
        q_ptrs = Query + tq4 * stride_qt + hq * stride_qh + dq * stride_qd
        q = tl.load(q_ptrs, mask=q_ok, other=0.0, eviction_policy=LOAD_EVICT).to(tl.float32)
        q_pos, q_pos_ok = rope_position(Positions, tq, tq_ok, stride_pos, max_position, Err, False)
        o_ptrs = QOut + tq4 * stride_ot + hq * stride_oh + dq * stride_od
        if SPLIT:  # DP is half the head dim here
            q_hi = tl.load(q_ptrs + DP * stride_qd, mask=q_ok, other=0.0, eviction_policy=LOAD_EVICT).to(tl.float32)
            q, q_hi = _rope_halves(q, q_hi, (CosSin + q_pos * stride_cs)[:, None, None, None],
                                   q_pos_ok[:, None, None, None] & (dq < DP), stride_csd, dq, DP)
            tl.store(o_ptrs + DP * stride_od, exact_cast(q_hi, QOut.dtype.element_ty, INTERPRETED), mask=q_ok,
                     cache_modifier=STORE_CM)
        else:
            q = _rope(q, q_ptrs, q_ok, stride_qd, CosSin + q_pos * stride_cs, q_pos_ok,
                      stride_csd, tl.zeros((1, 1), tl.int32), dq, BT_Q, BH_Q, 1, DP, HEAD_DIM, ROT, NEOX)
        tl.store(o_ptrs, exact_cast(q, QOut.dtype.element_ty, INTERPRETED), mask=q_ok, cache_modifier=STORE_CM)


# =================================================================================================
# Launcher
# =================================================================================================


def tile(num_tokens: int, heads: int, row_elems: int, sms: int, tile_elems: int) -> tuple[int, int]:
    """(tokens, heads) per program for rows of `row_elems` (padded) elements: about `tile_elems`
    elements, all heads when they fit, fewer tokens while the grid is under
    `Tuning.min_programs_per_sm` programs per SM. From shapes only."""
    bh = min(pow2(heads), max(1, tile_elems // row_elems))
    bt = min(max(1, tile_elems // (bh * row_elems)), pow2(max(num_tokens, 1)))
    while bt > 1 and cdiv(num_tokens, bt) * cdiv(heads, bh) < tuning.current.min_programs_per_sm * sms:
        bt //= 2
    return bt, bh


def split_halves(head_dim: int, k_cache: torch.Tensor, positions, cos_sin_cache, rope_neox) -> bool:
    """Whether the kernel takes each row as two halves (SPLIT): NeoX RoPE over the whole head dim (a
    power of two) into an FP8 cache. Each element then meets its rotation partner in the same
    thread instead of being loaded a second time. H200, T = 16k, % of copy: FP8 RoPE on k 94 -> 102,
    on q and k 95 -> 101; bf16 (98 -> 92) and INT4 (81 -> 65-80) lose and INT8 moves within -1 to +2
    points, so they keep one tile."""
    return (tuning.current.split_rope and positions is not None and rope_neox and kv_format(k_cache.dtype) is KVFormat.FP8
            and cos_sin_cache.shape[1] == head_dim == pow2(head_dim))


def group_layout(head_dim: int, k_cache: torch.Tensor, k_scale, split: bool = False) -> tuple[int, int, int, int]:
    """(QGROUP, NG, NGP, GP): groups of QGROUP elements (INT8/INT4 scale groups, else the whole
    row, or its halves when `split`), NG of them per row, padded to powers of 2 in the tile, which
    holds NGP of them (one half when `split`)."""
    if kv_format(k_cache.dtype).group_scaled:
        ng = k_scale.shape[-1]
        qgroup = head_dim // ng
        return qgroup, ng, pow2(ng), pow2(qgroup)
    if split:
        return head_dim // 2, 2, 1, head_dim // 2
    return head_dim, 1, 1, pow2(head_dim)


def unsupported(key, value, k_cache, v_cache, slot_mapping, **options) -> list[str]:
    """Reasons this kernel cannot run the call (the front has validated shapes and dtypes)."""
    if value.shape[-1] != key.shape[-1]:
        from . import latent_cache_write

        return latent_cache_write.unsupported(key, value, k_cache, v_cache, slot_mapping, **options)
    why = []
    d = key.shape[-1]
    if d > MAX_HEAD_DIM:
        why.append(f"head dim {d} > {MAX_HEAD_DIM} is not served by the Triton kv_cache_write kernel")
    if options.get("positions") is not None and not options.get("rope_neox", True):
        qgroup, ng, _, _ = group_layout(d, k_cache, options.get("k_scale"))
        if ng > 1 and qgroup % 2:
            why.append(f"GPT-J RoPE needs an even quant group (a rotated pair must stay in one group), "
                       f"got quant group {qgroup}")
    return why


def run(*args, **kwargs) -> torch.Tensor:
    """Write `key`/`value [T, Hkv, D]` at `slot_mapping [T]` into the caches (and INT8/INT4 scale
    caches); returns the rotated query (new, like `query [T, Hq, D]`) or an empty tensor."""
    return prepare(*args, **kwargs)(*args, **kwargs)


def prepare(key, value, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None, query=None,
            positions=None, cos_sin_cache=None, rope_neox=True):
    """`launch(*args, **kwargs)` for calls of this signature (only the metadata is read). Values of
    a head dim of their own (the MLA latent cache) go to `latent_cache_write`."""
    t, hkv, d = key.shape
    if t == 0:
        return _no_tokens
    if value.shape[-1] != d:
        from . import latent_cache_write

        return latent_cache_write.prepare(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale,
                                          query=query, positions=positions, cos_sin_cache=cos_sin_cache,
                                          rope_neox=rope_neox)
    fmt = kv_format(k_cache.dtype)
    split = split_halves(d, k_cache, positions, cos_sin_cache, rope_neox)
    qgroup, ng, ngp, gp = group_layout(d, k_cache, k_scale, split)
    dp = d // 2 if split else pow2(d)
    halves = 2 if split else 1
    sms = gpu.sm_count(key.device, cpu=1)   # the interpreter: few, large programs are fastest
    knobs = tuning.current
    bt_kv, bh_kv = tile(t, hkv, ngp * gp * halves, sms, knobs.tile_elems[fmt])
    n_kv = cdiv(t, bt_kv) * cdiv(hkv, bh_kv)
    hq, bt_q, bh_q, n_q = 1, 1, 1, 0
    if query is not None:
        hq = query.shape[1]
        bt_q, bh_q = tile(t, hq, dp * halves, sms, knobs.tile_elems[fmt])
        n_q = cdiv(t, bt_q) * cdiv(hq, bh_q)

    if fmt is KVFormat.FP8:
        k_sstrides = (0, 0, k_scale.stride(0) if k_scale.dim() else 0, 0)
        v_sstrides = (0, 0, v_scale.stride(0) if v_scale.dim() else 0, 0)
    elif fmt.group_scaled:
        k_sstrides, v_sstrides = k_scale.stride(), v_scale.stride()
    else:
        k_sstrides = v_sstrides = (0, 0, 0, 0)
    stream = t >= knobs.stream_min_tokens
    rope = positions is not None
    cs = cos_sin_cache if rope else key
    kernel = TritonLaunch(_kv_cache_write_kernel, (n_kv + n_q,), (
        t, k_cache.shape[0] * k_cache.shape[1], cs.shape[0] if rope else 0, n_kv,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *k_sstrides, *v_sstrides,
        slot_mapping.stride(0), (positions if rope else slot_mapping).stride(0),
        cs.stride(0) if rope else 0, cs.stride(1) if rope else 0,
        *(query.stride() if query is not None else (0, 0, 0)),
        *(torch.empty_like(query).stride() if query is not None else (0, 0, 0)),   # the rotated query's
    ), dict(
        NUM_KV_HEADS=hkv, NUM_Q_HEADS=hq, HEAD_DIM=d, BLOCK_SIZE=k_cache.shape[1],
        FMT=fmt.code, FP8_MAX=float(torch.finfo(k_cache.dtype).max) if fmt is KVFormat.FP8 else 0.0,
        QMAX=float(fmt.qmax), QMAX_RCP=_QMAX_RCP.get(fmt, 0.0),
        QGROUP=qgroup, NG=ng, NGP=ngp, GP=gp, DP=dp,
        ROPE=rope, NEOX=bool(rope_neox), ROT=cs.shape[1] if rope else 0, HAS_QUERY=query is not None, SPLIT=split,
        FLAT_ROWS=fmt is KVFormat.INT4 and ng == ngp and qgroup == gp,
        BT_KV=bt_kv, BH_KV=bh_kv, BT_Q=bt_q, BH_Q=bh_q,
        INTERPRETED=interpreting(),
        LOAD_EVICT="evict_first" if stream else "", STORE_CM=".cs" if stream else "",
        num_warps=knobs.num_warps, enable_fp_fusion=False,
        **({"maxnreg": GROUP_MAX_REGISTERS} if fmt.group_scaled and not interpreting() else {}),
    ))
    scaled = fmt is not KVFormat.PLAIN
    flag = errors.device_flag(key.device)

    def launch(key, value, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None, query=None,
               positions=None, cos_sin_cache=None, **_):
        rotated = torch.empty_like(query) if query is not None else None
        kernel(key, value, k_cache, v_cache, k_scale if scaled else k_cache, v_scale if scaled else v_cache,
               slot_mapping, slot_mapping if positions is None else positions,
               key if cos_sin_cache is None else cos_sin_cache, key if query is None else query,
               key if rotated is None else rotated, flag)
        return rotated if rotated is not None else key.new_empty(0)

    return launch


def _no_tokens(key, value, k_cache, v_cache, slot_mapping, *, query=None, **_) -> torch.Tensor:
    return torch.empty_like(query) if query is not None else key.new_empty(0)
