"""Triton `attn::paged_decode` with a value head dim of its own (`D_v < D`): MLA decode over a
latent cache (DeepSeek-V3, Kimi K2: one KV head of `D = 576` = 512 latent + 64 RoPE dims, queries
in the absorbed form, `v_cache = k_cache[..., :512]`, out `[T, Hq, 512]`).

- **One program = one (sequence, KV head, M tile, split).** The `Hq / Hkv` query heads times the
  `q_per_seq` new tokens are the M rows of both `tl.dot`s (row `m = i * G + g`: token `i`, head `g`
  of the group, as in `paged_decode`), in tiles of at most `MAX_BLOCK_M`. Scores are two dots over
  the key's first `D_v` dims and its last `D_r = D - D_v` dims (576 is not a power of two; both
  parts are), `[BLOCK_M, D_v] x [D_v, BLOCK_N] + [BLOCK_M, D_r] x [D_r, BLOCK_N]`; the output is
  `P [BLOCK_M, BLOCK_N] x V [BLOCK_N, D_v]`.
- **Values from the key tile.** When `v_cache` is `k_cache`'s first `D_v` dims (same storage and
  strides: the MLA layout), V is the key tile's first part, read once. Otherwise V is read from
  `v_cache`. The choice is made per call from the addresses (the C++ front keys its recordings by
  which arguments share an address), so one plan serves both.
- **Caches.** Plain (the query dtype) and FP8 (e4m3/e5m2, read as bytes and converted exactly to
  the query dtype; the K scale rides on the softmax scale, the V scale on the output).
- **Split-K** and the merge as in `paged_decode`: the split count from shapes only
  (`paged_decode_config.split_count`), each sequence's keys cut by `_split_geometry`, the partials
  in `paged_decode.split_workspace` and merged by its merge kernel, which adds learned sinks and
  quantizes FP8 output.
- **Bad metadata** as in `paged_decode`: lengths clamped into the block table
  (`block_table.clamped_seq_len`); each program checks the block ids it reads before its key loop
  (`block_table.any_absent_block`); with one outside the cache it reads no keys (its split or its
  rows stay empty). Each bad value sets its bit in the error flag.

Served options: `scale`, `q_scaling`, `sinks`, `out_scale`, `key_mask`; ALiBi, sliding windows and
soft-capping are not (`unsupported`). Under TRITON_INTERPRET=1: a fixed trip count, bf16 dots in
fp32 with P rounded to bf16 first, as in `paged_decode`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ... import errors, gpu
from ...quant import KVFormat, kv_format
from . import cdiv, interpreting, pow2
from .block_table import any_absent_block, clamped_seq_len, key_capacity, table_for_no_blocks
from .interpreter import exact_cast
from .launcher import TritonLaunch, no_launch, scale_operands
from .paged_decode_config import INTERPRETER_SMS, ONE_PAGE_SPAN, split_count, tuning
from .online_softmax import softmax_step
from .paged_decode_kernels import _split_geometry, _store_rows

MAX_BLOCK_M = 64
MAX_VALUE_DIM = 512      # the fp32 accumulator [BLOCK_M, D_v]
MAX_ROPE_DIM = 256
_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def config(rows: int, fp8: bool, *, sm90: bool = False, key_mask: bool = False,
           values_in_keys: bool = True) -> dict:
    """BLOCK_M, BLOCK_N, num_warps, num_stages for `rows` query rows per KV head (`tuning.current.config`
    overrides them; BLOCK_M defaults to `rows` rounded up to a power of two, 16..`MAX_BLOCK_M`).

    Chosen from sm_90a compiles (Triton 3.6, ptxas, D = 576, D_v = 512, with the launch's argument
    specialization: 16-byte aligned pointers and strides, without which the key loads are neither
    vectorized nor pipelined and the counts below are wrong), untimed on a GPU unless stated:
    - bf16 64 rows x 16 keys, 8 warps, 3 stages (the query tile stays in shared memory: 72 KB):
      255 registers, no spills, 126-128 KB; measured on an H200 at Hq = 128, B = 64, ctx 4096:
      672 us. Its QK^T is 72 `wgmma m64n8k16` per tile: a dot chained into the PV dot gets all 8
      warps along M, so each of the two warpgroups computes the whole 64 x 16 score tile.
    - `sm90` (an sm_90 device), 64 rows, a plain cache of the query dtype, values that can be the keys' first dims
      (`values_in_keys`: the caches share strides and dtype), no key mask:
      64 rows x 64 keys, 8 warps, 2 stages: QK^T 72 `wgmma m64n32k16` (two per k step, still the
      whole tile in each warpgroup), PV 4 `m64n256k16` (the warpgroups split the 512 value dims),
      255 registers, no spills, 216 KB (query 72 KB + 2 x 72 KB key tiles, `cp.async`), on pages
      of 16 and 64 keys. A key mask costs 8 KB and 32-88 B of spills there (not taken); values
      of a cache of their own (`V_FROM_K` off) do not fit in 2 stages: such a call on the same
      plan takes 1 (144 KB, 0.6-0.9 KB of spills); caches of other strides keep the 16-key tiles.
    - FP8 (converted to the query dtype in registers before the dots): 32 x 32 takes 250
      registers, no spills, 70 KB, `mma.sync`; 64-row tiles (`wgmma`) spill 0.2-0.6 KB."""
    block_m = min(MAX_BLOCK_M, max(16, pow2(rows)))
    if tuning.current.config:
        return {"BLOCK_M": block_m, **tuning.current.config}
    if interpreting():
        return {"BLOCK_M": block_m, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    if fp8:
        return {"BLOCK_M": min(block_m, 32), "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}
    if block_m == 64:
        if sm90 and values_in_keys and not key_mask:
            return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "separate_values_stages": 1}
        return {"BLOCK_M": 64, "BLOCK_N": 16, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_M": block_m, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}


@triton.jit
def _load_rows(Base, rows, n_ok, first: tl.constexpr, DIMS: tl.constexpr, FP8: tl.constexpr, E5M2: tl.constexpr,
               DOT_DTYPE: tl.constexpr):
    """Dims `first ..< first + DIMS` of the token rows at offsets `rows` (in elements; FP8 rows as
    bytes), converted exactly to DOT_DTYPE: `[BLOCK_N, DIMS]`."""
    d = first + tl.arange(0, DIMS)
    x = tl.load(Base + rows[:, None] + d[None, :], mask=n_ok[:, None], other=0)
    if FP8:
        if E5M2:
            x = x.to(tl.float8e5, bitcast=True)
        else:
            x = x.to(tl.float8e4nv, bitcast=True)
        x = x.to(tl.float16)
    return x.to(DOT_DTYPE)


@triton.jit
def _tile(t0, end, acc, m_i, l_i, q_v, q_r, qk_scale, pos, km_rows, km_len, bt_row, stride_btp,
          K, V, k_head, v_head, stride_kb, stride_kt, stride_vb, stride_vt,
          D_V: tl.constexpr, D_R: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, ONE_PAGE: tl.constexpr,
          FP8: tl.constexpr, E5M2: tl.constexpr, V_FROM_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
          P_DTYPE: tl.constexpr, HAS_KEY_MASK: tl.constexpr, INTERPRET: tl.constexpr):
    """One online-softmax step (log2 units) over keys `t0 ..< min(t0 + BLOCK_N, end)`, whose block
    ids are known to lie in the cache (`any_absent_block`)."""
    offs_n = t0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < end
    if ONE_PAGE:
        page = tl.load(bt_row + (t0 // PAGE) * stride_btp)
    else:
        page = tl.load(bt_row + (offs_n // PAGE) * stride_btp, mask=n_ok, other=0)
    page = page.to(tl.int64)
    if ONE_PAGE:
        # one base pointer per tile and 32-bit row offsets: few registers for the tile's addresses
        first = (t0 % PAGE).to(tl.int64)
        Kt = K + (page * stride_kb + first * stride_kt + k_head)
        Vt = V + (page * stride_vb + first * stride_vt + v_head)
        k_rows = tl.arange(0, BLOCK_N) * stride_kt
        v_rows = tl.arange(0, BLOCK_N) * stride_vt
    else:
        within = (offs_n % PAGE).to(tl.int64)
        Kt = K
        Vt = V
        k_rows = page * stride_kb + within * stride_kt + k_head
        v_rows = page * stride_vb + within * stride_vt + v_head
    k_v = _load_rows(Kt, k_rows, n_ok, 0, D_V, FP8, E5M2, DOT_DTYPE)
    k_r = _load_rows(Kt, k_rows, n_ok, D_V, D_R, FP8, E5M2, DOT_DTYPE)
    s = tl.dot(q_v, tl.trans(k_v))
    s = tl.dot(q_r, tl.trans(k_r), s)
    s = s * qk_scale
    vis = n_ok[None, :] & (offs_n[None, :] <= pos[:, None])
    if HAS_KEY_MASK:   # km_rows: each row's key_mask row (row 0 for rows past the query's)
        vis = vis & (tl.load(km_rows[:, None] + offs_n[None, :], mask=vis & (offs_n < km_len)[None, :], other=0) != 0)
    s = tl.where(vis, s, float("-inf"))
    p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, True)
    if V_FROM_K:
        v = k_v
    else:
        v = _load_rows(Vt, v_rows, n_ok, 0, D_V, FP8, E5M2, DOT_DTYPE)
    p_op = exact_cast(p, P_DTYPE, INTERPRET).to(DOT_DTYPE)
    acc = tl.dot(p_op, v, acc * alpha[:, None])
    return acc, m_i, l_i


@triton.jit
def _key_loop(acc, m_i, l_i, start, end, q_v, q_r, qk_scale, pos, km_rows, km_len, bt_row, stride_btp,
              K, V, k_head, v_head, stride_kb, stride_kt, stride_vb, stride_vt,
              D_V: tl.constexpr, D_R: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, ONE_PAGE: tl.constexpr,
              FP8: tl.constexpr, E5M2: tl.constexpr, V_FROM_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
              P_DTYPE: tl.constexpr, HAS_KEY_MASK: tl.constexpr, DYNAMIC_LOOP: tl.constexpr,
              MAX_ITERS: tl.constexpr):
    """The tiles of keys `start ..< end` (`_tile`)."""
    n_iter = tl.cdiv(tl.maximum(end - start, 0), BLOCK_N)
    if DYNAMIC_LOOP:
        for it in range(0, n_iter):
            acc, m_i, l_i = _tile(start + it * BLOCK_N, end, acc, m_i, l_i, q_v, q_r, qk_scale, pos, km_rows,
                                  km_len, bt_row, stride_btp, K, V, k_head, v_head, stride_kb, stride_kt, stride_vb,
                                  stride_vt, D_V, D_R, BLOCK_N, PAGE, ONE_PAGE, FP8, E5M2, V_FROM_K, DOT_DTYPE,
                                  P_DTYPE, HAS_KEY_MASK, False)
    else:
        # the interpreter takes no loaded value as a loop bound (numpy >= 2.4): a fixed trip count
        for it in range(0, MAX_ITERS):
            if it < n_iter:
                acc, m_i, l_i = _tile(start + it * BLOCK_N, end, acc, m_i, l_i, q_v, q_r, qk_scale, pos, km_rows,
                                      km_len, bt_row, stride_btp, K, V, k_head, v_head, stride_kb, stride_kt, stride_vb,
                                      stride_vt, D_V, D_R, BLOCK_N, PAGE, ONE_PAGE, FP8, E5M2, V_FROM_K, DOT_DTYPE,
                                      P_DTYPE, HAS_KEY_MASK, True)
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["num_splits", "min_split"])   # they follow the batch size
def _mla_decode_kernel(
    Query, K, V, KScale, VScale, BT, SeqLens, Sinks, OutScale, Out, Lse, POut, PLse, KeyMask, Err,
    scale_eff, num_splits, min_split,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_fp8s,
    stride_btb, stride_btp,
    stride_ot, stride_oh, stride_od, stride_lt, stride_lh,
    stride_ps, stride_pt, stride_ph, stride_pls, stride_plt, stride_kmt, km_len, kv_cap, num_blocks,
    D_V: tl.constexpr, D_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, M_TILES: tl.constexpr,
    PAGE: tl.constexpr, ONE_PAGE: tl.constexpr, QPS: tl.constexpr, GROUP: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, FP8: tl.constexpr, E5M2: tl.constexpr, V_FROM_K: tl.constexpr,
    HAS_SINKS: tl.constexpr, OUT_FP8: tl.constexpr, SPLIT: tl.constexpr,
    DYNAMIC_LOOP: tl.constexpr, MAX_ITERS: tl.constexpr, DOT_DTYPE: tl.constexpr, P_DTYPE: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr, BLOCK_ERR: tl.constexpr,
):
    """`Query [T, Hq, D_V + D_R]`, caches `[num_blocks, page, Hkv, D_V + D_R]` (FP8: as bytes), `Out
    [T, Hq, D_V]`, `Lse [T, Hq]`; split-K partials `POut [S, T, Hq, D_V]`, `PLse [S, T, Hq]`.
    `Err`: the device error flag; bad block ids set `BLOCK_ERR` in it (0: no bit)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    mt = pid % M_TILES
    kh = (pid // M_TILES) % NUM_KV_HEADS
    b = pid // (M_TILES * NUM_KV_HEADS)
    INTERPRET: tl.constexpr = not DYNAMIC_LOOP

    L = clamped_seq_len(SeqLens, b, kv_cap, Err, True)
    _, start, end, n_active = _split_geometry(L, -1, split, num_splits, min_split, QPS, False, BLOCK_N)
    if SPLIT:
        if split >= n_active:
            return

    m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = m < QPS * GROUP
    qi = m // GROUP
    head = kh * GROUP + m % GROUP
    tok = b * QPS + qi
    pos = L - QPS + qi                     # absolute positions of the query rows
    km_rows = KeyMask + tl.where(row_ok, tok, 0).to(tl.int64) * stride_kmt
    q_rows = Query + tok.to(tl.int64) * stride_qt + head * stride_qh
    dv = tl.arange(0, D_V)
    dr = D_V + tl.arange(0, D_R)
    q_v = tl.load(q_rows[:, None] + dv[None, :] * stride_qd, mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)
    q_r = tl.load(q_rows[:, None] + dr[None, :] * stride_qd, mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)
    qk_scale = scale_eff * 1.4426950408889634
    if FP8:
        qk_scale = qk_scale * tl.load(KScale + kh * stride_fp8s)

    bt_row = BT + b.to(tl.int64) * stride_btb
    k_head = kh.to(tl.int64) * stride_kh
    v_head = kh.to(tl.int64) * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_V], tl.float32)
    # a bad block id among the ones this program reads: it reads none (its rows stay empty)
    absent = any_absent_block(bt_row, stride_btp, start // PAGE, tl.cdiv(tl.maximum(end, start), PAGE), num_blocks,
                              256, INTERPRET)
    if BLOCK_ERR != 0:
        tl.atomic_or(Err, BLOCK_ERR, mask=absent != 0, sem="relaxed")
    end = tl.where(absent != 0, start, end)
    acc, m_i, l_i = _key_loop(acc, m_i, l_i, start, end, q_v, q_r, qk_scale, pos, km_rows, km_len, bt_row,
                              stride_btp, K, V, k_head, v_head, stride_kb, stride_kt, stride_vb, stride_vt,
                              D_V, D_R, BLOCK_N, PAGE, ONE_PAGE, FP8, E5M2, V_FROM_K, DOT_DTYPE, P_DTYPE,
                              HAS_KEY_MASK, DYNAMIC_LOOP, MAX_ITERS)

    _store_rows(acc, m_i, l_i, tok, head, row_ok, dv < D_V, split, VScale + kh * stride_fp8s, Sinks, OutScale,
                Out, Lse, POut, PLse, stride_ot, stride_oh, stride_od, stride_lt, stride_lh,
                stride_ps, stride_pt, stride_ph, stride_pls, stride_plt,
                FP8, HAS_SINKS, OUT_FP8, SPLIT, D_V, INTERPRET)


def _pow2_in(n: int, lo: int, hi: int) -> bool:
    return lo <= n <= hi and n & (n - 1) == 0


def unsupported(query, k_cache, v_cache, block_tables, seq_lens, *, alibi_slopes=None, window_left=-1,
                softcap=0.0, **options) -> list[str]:
    """Reasons this kernel cannot run a validated `paged_decode` call with `D_v != D`."""
    why = []
    d, dv = query.shape[-1], v_cache.shape[-1]
    if not (_pow2_in(dv, 16, MAX_VALUE_DIM) and _pow2_in(d - dv, 16, MAX_ROPE_DIM)):
        why.append(f"a value head dim D_v = {dv} below D = {d} is served when D_v and D - D_v are powers of two, "
                   f"D_v in 16..{MAX_VALUE_DIM} and D - D_v in 16..{MAX_ROPE_DIM} (MLA: 512 and 64)")
    if query.dtype not in _DTYPES:
        why.append(f"query dtype {query.dtype} is not served (fp16/bf16 only)")
    for name, given in (("ALiBi (alibi_slopes)", alibi_slopes is not None), ("sliding windows (window_left)",
                        window_left >= 0), ("soft-capping (softcap)", softcap > 0)):
        if given:
            why.append(f"{name} is not implemented for D_v != D")
    return why


def run(*args, **kwargs) -> None:
    """Fill `out [T, Hq, D_v]` and `lse [T, Hq]`."""
    prepare(*args, **kwargs)(*args, **kwargs)


def values_in_keys(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """`v_cache` is `k_cache`'s first `D_v` dims (the MLA latent cache): same storage and strides."""
    return (v_cache.data_ptr() == k_cache.data_ptr() and v_cache.stride() == k_cache.stride()
            and v_cache.dtype == k_cache.dtype)


def prepare(query, k_cache, v_cache, block_tables, seq_lens, *, out, lse, scale=None, q_scaling=1.0,
            sinks=None, out_scale=None, k_scale=None, v_scale=None, key_mask=None, num_blocks=None,
            block_error=errors.BLOCK_TABLES, **_):
    """The launch of a call of this signature (only the arguments' metadata is read). Block ids
    outside `[0, num_blocks)` (default `k_cache.shape[0]`) are absent blocks, flagged with the error
    bit `block_error` (0: none)."""
    from . import paged_decode

    t, hq, d = query.shape
    batch = seq_lens.shape[0]
    if t == 0 or batch == 0:
        return no_launch
    dv = v_cache.shape[-1]
    _, page, hkv, _ = k_cache.shape
    fmt = kv_format(k_cache.dtype)
    fp8 = fmt is KVFormat.FP8
    qps, group = t // batch, hq // hkv
    rows = qps * group
    shareable = v_cache.stride() == k_cache.stride() and v_cache.dtype == k_cache.dtype
    # (a plain cache of another dtype than the query's is converted in registers: 0.4 KB of spills on the wide tiles)
    sm90 = query.device.type == "cuda" and k_cache.dtype == query.dtype and gpu.capability(query.device) == (9, 0)
    cfg = config(rows, fp8, sm90=sm90, key_mask=key_mask is not None, values_in_keys=shareable)
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    m_tiles = cdiv(rows, block_m)
    knobs = tuning.current
    sms = gpu.sm_count(query.device, cpu=INTERPRETER_SMS)
    max_blocks = block_tables.shape[1]
    num_splits = split_count(batch, hkv, m_tiles, max_blocks, page, block_n, rows, sms, 1)
    min_split = max(block_n, cdiv(knobs.min_split_tokens, block_n) * block_n)
    num_blocks = k_cache.shape[0] if num_blocks is None else num_blocks
    kv_cap = key_capacity(max_blocks, page, num_blocks)
    page_span = ONE_PAGE_SPAN if max_blocks == 1 else page
    # a tile in one page is addressed by 32-bit row offsets from its first row
    one_page = page_span % block_n == 0 and (block_n - 1) * max(k_cache.stride(1), v_cache.stride(1)) + d < 2**31
    split = num_splits > 1
    p_strides = (t * hq * dv, hq * dv, dv, t * hq, hq) if split else (0, 0, 0, 0, 0)
    scales = "none"
    fp8_stride = 0
    if fp8:
        scales = "given"
        fp8_stride = 1 if k_scale.dim() == 1 else 0
        if v_scale.dim() != k_scale.dim():   # one stride serves both
            scales, fp8_stride = "per_head", 1
    interpret = interpreting()
    max_iters = 1
    if interpret:
        per = max(min_split, cdiv(cdiv(kv_cap, num_splits), block_n) * block_n)
        max_iters = max(1, cdiv(min(per, kv_cap), block_n) + 1)
    no_tables = table_for_no_blocks(query.device) if not block_tables.numel() else None
    bt = block_tables if no_tables is None else no_tables
    scale_eff = (scale if scale is not None else 1.0 / math.sqrt(d)) / q_scaling
    dot_dtype = _DTYPES[query.dtype]

    def main(v_from_k: bool) -> TritonLaunch:
        vc = k_cache if v_from_k else v_cache
        # a value tile of its own takes shared memory of its own: fewer stages where the config says
        stages = cfg["num_stages"] if v_from_k else cfg.get("separate_values_stages", cfg["num_stages"])
        return TritonLaunch(_mla_decode_kernel, (batch * hkv * m_tiles, num_splits), (
            float(scale_eff), num_splits, min_split,
            query.stride(0), query.stride(1), query.stride(2),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
            fp8_stride, bt.stride(0), bt.stride(1),
            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
            *p_strides, *((key_mask.stride(0), key_mask.shape[1]) if key_mask is not None else (0, 0)),
            kv_cap, num_blocks,
        ), dict(
            D_V=dv, D_R=d - dv, BLOCK_M=block_m, BLOCK_N=block_n, M_TILES=m_tiles, PAGE=page_span,
            ONE_PAGE=one_page, QPS=qps, GROUP=group, NUM_KV_HEADS=hkv, FP8=fp8,
            E5M2=k_cache.dtype == torch.float8_e5m2, V_FROM_K=v_from_k, HAS_SINKS=sinks is not None,
            OUT_FP8=out_scale is not None, SPLIT=split, DYNAMIC_LOOP=not interpret, MAX_ITERS=max_iters,
            DOT_DTYPE=tl.float32 if interpret and query.dtype == torch.bfloat16 else dot_dtype, P_DTYPE=dot_dtype,
            HAS_KEY_MASK=key_mask is not None, BLOCK_ERR=block_error, num_warps=cfg["num_warps"],
            num_stages=stages,
        ))

    mains = {False: main(False), True: main(True) if shareable else None}
    merge = paged_decode.merge_launch(t, hq, qps, dv, dv, num_splits, min_split, block_n, -1, kv_cap, p_strides, out,
                                      lse, sinks, out_scale, interpret) if split else None
    flag = errors.device_flag(query.device)

    def launch(query, k_cache, v_cache, block_tables, seq_lens, *, out, lse, sinks=None, out_scale=None,
               k_scale=None, v_scale=None, key_mask=None, **_):
        kernel = mains[values_in_keys(k_cache, v_cache)]
        kc, vc = (k_cache.view(torch.uint8), v_cache.view(torch.uint8)) if fp8 else (k_cache, v_cache)
        ks, vs = scale_operands(scales, k_scale, v_scale, hkv, lse)
        pout, plse = paged_decode.split_workspace(num_splits, t, hq, dv, query.device) if split else (lse, lse)
        sinks_ = lse if sinks is None else sinks
        out_scale_ = lse if out_scale is None else out_scale
        kernel(query, kc, vc, ks, vs, block_tables if no_tables is None else no_tables, seq_lens, sinks_,
               out_scale_, out, lse, pout, plse, lse if key_mask is None else key_mask.view(torch.uint8), flag)
        if merge is not None:
            merge(pout, plse, out, lse, seq_lens, sinks_, out_scale_)

    launch.describe = (f"Triton paged_decode (D = {d}, D_v = {dv}), grid {batch * hkv * m_tiles} x {num_splits} "
                       f"split(s){' + merge' if split else ''}: {block_m} query rows x {block_n}-key tiles, "
                       f"{cfg['num_warps']} warps, {cfg['num_stages']} stages")
    launch.kernels = tuple(k for k in (mains[True] or mains[False], merge) if k is not None)
    launch.num_splits = num_splits
    return launch
