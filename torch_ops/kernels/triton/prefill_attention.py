"""Triton prefill attention: varlen packed queries over fresh packed K/V (`context_attention`) or a
paged KV cache (`paged_prefill`). One FlashAttention-2-style forward kernel serves both.

Semantics: docs/ops.md. Design, in the order the kernel runs:

- **Work list.** Sequence `b` (q_len queries) owns the work slots `[cu_q[b] // TOK + b,
  cu_q[b+1] // TOK + b + 1)`, at least `cdiv(q_len, TOK)` of them (TOK query tokens per tile), so
  `T // TOK + B` slots cover any batch: the grid is a function of shapes only, and the work
  scales with the query tiles present, not with batch x longest sequence. A program finds its
  sequence by a binary search over `cu_q[b] // TOK + b` (no prologue kernel, no host sync: CUDA-
  graph safe); programs past their sequence's last tile exit at once. Slots run heaviest first
  (the last tile of a causal sequence sees the most keys), the KV heads fastest.
- **Short sequences get their own launch.** In a mixed batch a decode fills 1 x group rows of a
  128-row tile and pays for all of them over its whole context. So a batch of several sequences
  launches twice: the work list skips sequences of at most `SHORT_BLOCK_M // group` tokens, and a
  second grid of one program per (sequence, KV head) serves exactly those with 16-row tiles.
  Which launch takes a sequence is decided on the device; both grids come from shapes. With
  `max_queries`, both launches also leave sequences of more queries to the caller (the `mixed`
  backend runs those through the CUTLASS paged kernel), and the work list gives each sequence
  `cdiv(max_queries, TOK)` slots of its own where that makes fewer programs (`SEQ_SLOTS`; no
  search): a batch of long chunks, which it leaves alone, then launches a few programs rather than
  `T // TOK + B`.
- **GQA: the group's query heads are packed into M.** Row `m` of a BLOCK_M tile is token
  `m // HPT`, head `m % HPT` of the KV head's group (HPT = min(group, BLOCK_M) heads per tile,
  TOK = BLOCK_M // HPT tokens). Each K/V tile is read once per group instead of once per query
  head, and short queries (decodes inside a mixed batch, small chunks) fill the tensor-core tile
  with heads instead of padding; for long prefills the FLOPs are the same as one head per program.
  Groups larger than BLOCK_M split into `cdiv(group, HPT)` head chunks.
- **Keys visited.** Bottom-right aligned positions `p = Lk - Lq + i`. A tile visits the keys
  `[lo, hi)` its rows can see (causal: up to its last row; window: from its first row's window
  start), plus the sink-token tiles below `lo`, in three loops: masked (sink tiles and the
  window's leading edge), unmasked (keys every row sees: no mask arithmetic, no bounds checks),
  masked (the causal diagonal and the last partial tile). Fully masked tiles are never loaded.
- **K/V tiles.** Packed K/V: rows `cu_k[b] + j`. Paged: page `block_tables[b, j // PAGE]`, one
  table load per tile when PAGE is a multiple of BLOCK_N, else one per key row (block sizes
  1..BLOCK_N-1 and non-multiples). Any block/token/head strides (NHD, HND, combined, vLLM views).
  FP8 caches (e4m3/e5m2) are read as bytes and converted exactly to the dot dtype in registers;
  the per-tensor or per-head K scale rides on the softmax scale, the V scale on the output.
  INT8 / packed INT4 caches are dequantized in registers with their group scales (gathered per
  value from the scale cache: simple, not fast) and rounded to the dot dtype, as the reference
  does. Addresses are int64.
- **Bad metadata** (docs/ops.md, "Errors"): lengths are clamped into the tensors. Each program
  checks the block ids its tiles read before its loops (`block_table.any_absent_block`); with one
  outside the cache it reads no keys, so its rows are empty. The loops themselves carry no check:
  a per-tile check costs the paged loop its schedule (sm_90). Each bad value sets its bit in the
  device error flag (`torch_ops.errors`).
- **Softmax** online in fp32 with exp2 (log2(e) folded into the scale), scale/q_scaling,
  softcap (exp2-based tanh), ALiBi `-slope * |p - j|`; `tl.dot` on fp16/bf16 tiles with fp32
  accumulation (fp32 inputs: "ieee" dots; FP8 `context_attention` inputs: fp16 dots on the
  exactly converted values, q/k scales on the softmax scale). Learned sinks join the final
  normalization as one more logit without a value. Rows that see nothing write zeros and
  lse -inf (or the sink). lse is natural-log fp32. FP8 output: `clamp(out / out_scale, +-448)`.
- **Tiles** come from `config(head_dim, dtype, causal, paged, rows_per_seq, group_scaled)`; one that
  does not fit the GPU (Triton's OutOfResources) is retried with fewer stages, then smaller
  BLOCK_N, and the fitting one remembered.

Value head dim: V tiles, the P @ V product, the accumulator and the output have D_v (`HEAD_DV`,
padded to `BLOCK_DV`), which may differ from the query/key head dim (plain and FP8 K/V; MLA
prefill: D = 192, D_v = 128). Tile configs follow the larger of the two; with D_v = D the kernel
is the one of D alone. A query/key head dim that is no power of two but the sum of two (192 =
128 + 64, 96, 80, 48: `split_dims`) takes its scores as one dot per part instead of one over the
dims padded to the next power of two (sm_90a compile, D = 192: 24 wgmma k-steps a tile against 32,
128 KB of shared memory against 160 KB); a power-of-two head dim takes one dot.

Not served (`unsupported` says why): head dims > 256.

Knobs (tests, tuning): `prefill_config.Tuning`, changed inside `with tuning(config=...):`. A prepared launch's `kernels` are its `TritonLaunch`es
(main launch first; each holds its compiled kernel once run, for reports).
Under TRITON_INTERPRET=1 (CPU tests) the loops are `while` loops (the interpreter cannot take a
tensor as a `range` bound with numpy >= 2.4), bf16 dots take fp32 operands holding bf16 values
(the interpreter multiplies bf16 bit patterns), and bf16/FP8 outputs are rounded to nearest in
fp32 arithmetic first (its casts truncate, or round without carrying into the exponent): the same
math as on the GPU.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ... import errors
from ...quant import KVFormat, kv_format
from . import cdiv, interpreting, pow2
from .block_table import any_absent_block, clamped_seq_len, key_capacity
from .formats import FMT_FP8, FMT_INT4, FMT_INT8, FMT_PLAIN
from .interpreter import exact_cast, round_to_bf16
from .launcher import TritonLaunch, no_launch, scale_operands
from .online_softmax import softmax_step
from .prefill_config import _smaller, config, split_dims, tuning


SHORT_BLOCK_M = 16   # rows of the second launch's tiles, for sequences that fit one (decodes)

MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634
_DOT_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_ERR_CU = tl.constexpr(errors.CU_SEQLENS)


# =================================================================================================
# Kernel
# =================================================================================================


@triton.jit
def _find_sequence(CuQ, num_seqs, slot, TOK: tl.constexpr):
    """The sequence owning work slot `slot`: the largest b with cu_q[b] // TOK + b <= slot."""
    lo = slot * 0
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(CuQ + mid).to(tl.int32) // TOK + mid <= slot:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _masked_load(ptrs, n_ok, c_ok, MASKED: tl.constexpr, PAD: tl.constexpr):
    """Load a [BLOCK_N, C] tile: rows past the keys (MASKED) and padded columns (PAD) read 0."""
    if MASKED:
        return tl.load(ptrs, mask=n_ok[:, None] & c_ok[None, :], other=0)
    elif PAD:
        return tl.load(ptrs, mask=c_ok[None, :], other=0)
    else:
        return tl.load(ptrs)


@triton.jit
def _load_query(Q, q_rows, row_ok, stride_qd, FIRST: tl.constexpr, DIMS: tl.constexpr, BLOCK: tl.constexpr,
                Q_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Dims `FIRST ..< FIRST + DIMS` (padded to BLOCK) of the query rows at `q_rows`, in the dot dtype."""
    d = tl.arange(0, BLOCK)
    if FIRST > 0:
        d += FIRST
    q = tl.load(Q + q_rows[:, None] + d[None, :] * stride_qd, mask=row_ok[:, None] & (d < FIRST + DIMS)[None, :], other=0)
    if Q_FP8:
        q = q.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return q.to(DOT_DTYPE)


@triton.jit
def _load_tile(Base, rows, SBase, s_rows, n_ok, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_D: tl.constexpr, FMT: tl.constexpr, E5M2: tl.constexpr, QGROUP: tl.constexpr, DOT_DTYPE: tl.constexpr,
               FIRST: tl.constexpr):
    """A [BLOCK_N, BLOCK_D] K or V tile of dims `FIRST ..< FIRST + HEAD_DIM` in the dot dtype.
    `rows`: offsets of its token rows (in stored elements); plain tiles load as they are, FP8 bytes
    convert exactly, INT8 values and INT4 nibbles (low nibble first, offset 8) are multiplied by
    their group scales at `SBase + s_rows`."""
    PAD: tl.constexpr = HEAD_DIM != BLOCK_D
    if FIRST > 0:   # INT4: two dims a byte
        if FMT == FMT_INT4:
            Base += FIRST // 2
        else:
            Base += FIRST
    if FMT == FMT_INT4:
        c = tl.arange(0, BLOCK_D // 2)
        b = _masked_load(Base + rows[:, None] + c[None, :], n_ok, c < HEAD_DIM // 2, MASKED, PAD).to(tl.int32)
        x = tl.reshape(tl.join((b & 15) - 8, (b >> 4) - 8), (b.shape[0], BLOCK_D))
    else:
        c = tl.arange(0, BLOCK_D)
        x = _masked_load(Base + rows[:, None] + c[None, :], n_ok, c < HEAD_DIM, MASKED, PAD)
    if FMT == FMT_FP8:
        if E5M2:
            x = x.to(tl.float8e5, bitcast=True).to(tl.float16)
        else:
            x = x.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    elif FMT != FMT_PLAIN:
        d = tl.arange(0, BLOCK_D)
        scale = _masked_load(SBase + s_rows[:, None] + ((FIRST + d) // QGROUP)[None, :], n_ok, d < HEAD_DIM, MASKED, PAD)
        x = x.to(tl.float32) * scale.to(tl.float32)
    return x.to(DOT_DTYPE)


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, q_hi, row_scale, alibi, pos, start_n, kv_len, window_left, sink_tokens, softcap2,
    K, V, KS, VS, bt_row, stride_btp, stride_kb, stride_kt, stride_vb, stride_vt,
    stride_ksb, stride_kst, stride_vsb, stride_vst, km_rows, km_len,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, HEAD_DV: tl.constexpr,
    PAGED: tl.constexpr, PAGE: tl.constexpr, ONE_PAGE: tl.constexpr, KV_FMT: tl.constexpr, E5M2: tl.constexpr, QGROUP: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, MASKED: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, ROUND_P_BF16: tl.constexpr, D_LO: tl.constexpr,
):
    """One online-softmax step over keys `start_n .. start_n + BLOCK_N - 1` (log2 units): K tiles of
    HEAD_DIM (padded to BLOCK_D) dims, or, with D_LO, two dots over dims `..< D_LO` (`q`) and
    `D_LO ..< HEAD_DIM` (`q_hi`), both powers of two; V tiles and `acc` of HEAD_DV (padded to BLOCK_DV).
    K and V (and INT8/INT4 scale caches KS, VS) point at this program's KV head (and, for packed
    K/V, its sequence's first key)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < kv_len
    ks_rows = offs_n * 0
    vs_rows = offs_n * 0
    if PAGED:
        if ONE_PAGE:
            page = tl.load(bt_row + (start_n // PAGE) * stride_btp).to(tl.int64)
        elif MASKED:
            page = tl.load(bt_row + (offs_n // PAGE) * stride_btp, mask=n_ok, other=0).to(tl.int64)
        else:
            page = tl.load(bt_row + (offs_n // PAGE) * stride_btp).to(tl.int64)
        within = (offs_n % PAGE).to(tl.int64)
        k_rows = page * stride_kb + within * stride_kt
        v_rows = page * stride_vb + within * stride_vt
        if KV_FMT == FMT_INT8 or KV_FMT == FMT_INT4:
            ks_rows = page * stride_ksb + within * stride_kst
            vs_rows = page * stride_vsb + within * stride_vst
    else:
        k_rows = offs_n.to(tl.int64) * stride_kt
        v_rows = offs_n.to(tl.int64) * stride_vt

    if D_LO > 0:
        k = _load_tile(K, k_rows, KS, ks_rows, n_ok, MASKED, D_LO, D_LO, KV_FMT, E5M2, QGROUP, DOT_DTYPE, 0)
        k_hi = _load_tile(K, k_rows, KS, ks_rows, n_ok, MASKED, HEAD_DIM - D_LO, HEAD_DIM - D_LO, KV_FMT, E5M2,
                          QGROUP, DOT_DTYPE, D_LO)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        qk = tl.dot(q_hi, tl.trans(k_hi), qk, input_precision=DOT_PRECISION)
    else:
        k = _load_tile(K, k_rows, KS, ks_rows, n_ok, MASKED, HEAD_DIM, BLOCK_D, KV_FMT, E5M2, QGROUP, DOT_DTYPE, 0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if HAS_SOFTCAP:
        # softcap * tanh(x) with tanh(x) = 1 - 2 / (exp(2x) + 1); softcap2 = softcap * log2(e)
        x = qk * row_scale[:, None]
        s = (1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)) * softcap2
    else:
        s = qk * row_scale[:, None]
    dist = pos[:, None] - offs_n[None, :]
    if HAS_ALIBI:
        s += alibi[:, None] * tl.abs(dist).to(tl.float32)
    if MASKED:
        visible = n_ok[None, :]
        if CAUSAL:
            visible = visible & (dist >= 0)
        if HAS_WINDOW:
            visible = visible & ((dist <= window_left) | (offs_n < sink_tokens)[None, :])
        if HAS_KEY_MASK:   # km_rows: each row's key_mask row (row 0 for padding rows); every tile is masked
            visible = visible & (tl.load(km_rows[:, None] + offs_n[None, :],
                                         mask=visible & (offs_n < km_len)[None, :], other=0) != 0)
        s = tl.where(visible, s, float("-inf"))

    p, alpha, m_new, l_i = softmax_step(s, m_i, l_i, MASKED)   # only masked tiles leave a row empty
    v = _load_tile(V, v_rows, VS, vs_rows, n_ok, MASKED, HEAD_DV, BLOCK_DV, KV_FMT, E5M2, QGROUP, DOT_DTYPE, 0)
    if ROUND_P_BF16:
        p = round_to_bf16(p)
    acc = tl.dot(p.to(DOT_DTYPE), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_range(
    acc, m_i, l_i, it_lo, it_hi, n_sink, t_lo,
    q, q_hi, row_scale, alibi, pos, kv_len, window_left, sink_tokens, softcap2,
    K, V, KS, VS, bt_row, stride_btp, stride_kb, stride_kt, stride_vb, stride_vt,
    stride_ksb, stride_kst, stride_vsb, stride_vst, km_rows, km_len,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, HEAD_DV: tl.constexpr,
    PAGED: tl.constexpr, PAGE: tl.constexpr, ONE_PAGE: tl.constexpr, KV_FMT: tl.constexpr, E5M2: tl.constexpr, QGROUP: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, MASKED: tl.constexpr, SINK_TILES: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, ROUND_P_BF16: tl.constexpr, D_LO: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Key tiles `it_lo .. it_hi - 1`; with SINK_TILES, iterations below `n_sink` are the sink
    tiles 0.. and the rest continue from tile `t_lo`."""
    if INTERPRET:
        it = it_lo
        while it < it_hi:
            tile = it
            if SINK_TILES:
                tile = tl.where(it < n_sink, it, it - n_sink + t_lo)
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, q_hi, row_scale, alibi, pos, tile * BLOCK_N, kv_len, window_left, sink_tokens,
                softcap2, K, V, KS, VS, bt_row, stride_btp, stride_kb, stride_kt, stride_vb, stride_vt,
                stride_ksb, stride_kst, stride_vsb, stride_vst, km_rows, km_len,
                BLOCK_N, BLOCK_D, HEAD_DIM, BLOCK_DV, HEAD_DV, PAGED, PAGE, ONE_PAGE, KV_FMT, E5M2, QGROUP, CAUSAL,
                HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, MASKED, HAS_KEY_MASK, DOT_DTYPE, DOT_PRECISION, ROUND_P_BF16, D_LO)
            it += 1
    else:
        for it in range(it_lo, it_hi):
            tile = it
            if SINK_TILES:
                tile = tl.where(it < n_sink, it, it - n_sink + t_lo)
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, q_hi, row_scale, alibi, pos, tile * BLOCK_N, kv_len, window_left, sink_tokens,
                softcap2, K, V, KS, VS, bt_row, stride_btp, stride_kb, stride_kt, stride_vb, stride_vt,
                stride_ksb, stride_kst, stride_vsb, stride_vst, km_rows, km_len,
                BLOCK_N, BLOCK_D, HEAD_DIM, BLOCK_DV, HEAD_DV, PAGED, PAGE, ONE_PAGE, KV_FMT, E5M2, QGROUP, CAUSAL,
                HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, MASKED, HAS_KEY_MASK, DOT_DTYPE, DOT_PRECISION, ROUND_P_BF16, D_LO)
    return acc, m_i, l_i


# per-step values and bounds, not specialized: one compiled kernel serves every batch
@triton.jit(do_not_specialize=["num_seqs", "short_tokens", "max_queries", "num_tokens", "kv_cap", "num_blocks"])
def _prefill_kernel(
    Q, K, V, Out, Lse,
    CuQ, KvLens, BlockTables,
    QScale, KScale, VScale, Alibi, Sinks, OutScale, KeyMask, Err,
    qk_scale, softcap2, window_left, sink_tokens, num_seqs, short_tokens, max_queries, num_tokens, kv_cap, num_blocks,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_btb, stride_btp,
    stride_ot, stride_oh, stride_od, stride_lt, stride_lh,
    stride_qs, stride_ks, stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh, stride_kmt, km_len,
    GROUP: tl.constexpr, HPT: tl.constexpr, HEAD_CHUNKS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, ONE_PAGE: tl.constexpr,
    Q_FP8: tl.constexpr, KV_FMT: tl.constexpr, E5M2: tl.constexpr, QGROUP: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr, OUT_FP8: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, ROUND_P_BF16: tl.constexpr,
    SHORT: tl.constexpr, SEQ_SLOTS: tl.constexpr, INTERPRET: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    BLOCK_ERR: tl.constexpr, D_LO: tl.constexpr,
):
    """`Err`: the device error flag (`torch_ops.errors`): bad lengths set their bits in it, bad block
    ids `BLOCK_ERR` (0: no bit)."""
    TOK: tl.constexpr = BLOCK_M // HPT
    HEAD_PROGS: tl.constexpr = NUM_KV_HEADS * HEAD_CHUNKS
    pid = tl.program_id(0)
    kh = (pid % HEAD_PROGS) // HEAD_CHUNKS
    chunk = pid % HEAD_CHUNKS
    if SHORT:   # one program per (sequence, head): only sequences of at most TOK tokens
        b = pid // HEAD_PROGS
        slot = b   # unused
    elif SEQ_SLOTS > 0:   # SEQ_SLOTS programs per (sequence, head), tiles in order
        b = pid // HEAD_PROGS // SEQ_SLOTS
        slot = pid // HEAD_PROGS % SEQ_SLOTS
    else:
        slot = tl.num_programs(0) // HEAD_PROGS - 1 - pid // HEAD_PROGS   # heaviest tiles first
        b = _find_sequence(CuQ, num_seqs, slot, TOK)
    # lengths clamped into the tensors (T query rows; the block table's or Tk keys): bad
    # metadata reads and writes no memory outside them
    q_lo = tl.load(CuQ + b)
    q_hi = tl.load(CuQ + b + 1)
    tl.atomic_or(Err, _ERR_CU, mask=(q_lo < 0) | (q_hi < q_lo) | (q_hi > num_tokens), sem="relaxed")
    q_start = tl.minimum(tl.maximum(q_lo, 0), num_tokens).to(tl.int32)
    q_len = tl.minimum(tl.maximum(q_hi, q_start), num_tokens).to(tl.int32) - q_start
    if SHORT:
        tok0 = q_len * 0
        if q_len > TOK or q_len > max_queries:
            return
    else:
        tok0 = slot * TOK if SEQ_SLOTS > 0 else (slot - (q_start // TOK + b)) * TOK
        if q_len <= short_tokens or q_len > max_queries:   # served by the short launch / another kernel
            return
    if tok0 >= q_len:
        return
    if PAGED:   # KvLens: seq_lens [B]
        kv_start = q_len * 0
        kv_len = clamped_seq_len(KvLens, b, kv_cap, Err, True)
    else:       # KvLens: cu_seqlens_k [B + 1]
        k_lo = tl.load(KvLens + b)
        k_hi = tl.load(KvLens + b + 1)
        tl.atomic_or(Err, _ERR_CU, mask=(k_lo < 0) | (k_hi < k_lo) | (k_hi > kv_cap), sem="relaxed")
        kv_start = tl.minimum(tl.maximum(k_lo, 0), kv_cap).to(tl.int32)
        kv_len = tl.minimum(tl.maximum(k_hi, kv_start), kv_cap).to(tl.int32) - kv_start

    # ---- rows: TOK tokens x HPT heads of KV head kh's group ------------------------------------
    m = tl.arange(0, BLOCK_M)
    tok = tok0 + m // HPT
    hg = chunk * HPT + m % HPT
    row_ok = (m < TOK * HPT) & (tok < q_len) & (hg < GROUP)
    head = kh * GROUP + hg
    last_tok = tl.minimum(tok0 + TOK, q_len) - 1
    pos = kv_len - q_len + tl.minimum(tok, last_tok)   # padding rows borrow a real row's position
    p_min = kv_len - q_len + tok0
    p_max = kv_len - q_len + last_tok
    km_rows = KeyMask + tl.where(row_ok, q_start + tok, 0).to(tl.int64) * stride_kmt

    q_rows = (q_start + tok).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    if D_LO > 0:   # two power-of-two parts of the head dim, one dot each (`_attend_tile`)
        q = _load_query(Q, q_rows, row_ok, stride_qd, 0, D_LO, D_LO, Q_FP8, DOT_DTYPE)
        q_hi = _load_query(Q, q_rows, row_ok, stride_qd, D_LO, HEAD_DIM - D_LO, HEAD_DIM - D_LO, Q_FP8, DOT_DTYPE)
    else:
        q = _load_query(Q, q_rows, row_ok, stride_qd, 0, HEAD_DIM, BLOCK_D, Q_FP8, DOT_DTYPE)
        q_hi = q   # unused
    row_scale = tl.full([BLOCK_M], qk_scale, tl.float32)
    if Q_FP8:
        row_scale *= tl.load(QScale + head * stride_qs, mask=row_ok, other=0.0)
    if KV_FMT == FMT_FP8:
        row_scale *= tl.load(KScale + kh * stride_ks)
    alibi = row_scale   # placeholder when there is no ALiBi
    if HAS_ALIBI:
        alibi = tl.load(Alibi + head, mask=row_ok, other=0.0) * -1.4426950408889634

    # ---- key tiles: [lo, hi) seen by some row, [full_lo, full_hi) seen by every row ------------
    hi = kv_len
    full_hi = kv_len
    if CAUSAL:
        hi = tl.minimum(hi, p_max + 1)
        full_hi = tl.minimum(full_hi, p_min + 1)
    hi = tl.maximum(hi, 0)
    full_hi = tl.maximum(full_hi, 0)
    lo = kv_len * 0
    full_lo = kv_len * 0
    if HAS_WINDOW:
        lo = tl.maximum(p_min - window_left, 0)
        full_lo = tl.maximum(p_max - window_left, 0)
    t_lo = lo // BLOCK_N
    t_hi = tl.maximum(tl.cdiv(hi, BLOCK_N), t_lo)
    f_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N), t_lo), t_hi)
    f_hi = tl.minimum(tl.maximum(full_hi // BLOCK_N, f_lo), t_hi)
    n_sink = t_lo * 0
    if HAS_WINDOW:
        n_sink = tl.cdiv(tl.minimum(sink_tokens, t_lo * BLOCK_N), BLOCK_N)
    if HAS_KEY_MASK:   # no tile is seen whole by every row
        f_hi = f_lo

    Kh = K + kh.to(tl.int64) * stride_kh + kv_start.to(tl.int64) * stride_kt
    Vh = V + kh.to(tl.int64) * stride_vh + kv_start.to(tl.int64) * stride_vt
    KSh = KScale + kh.to(tl.int64) * stride_ksh   # INT8/INT4 scale caches
    VSh = VScale + kh.to(tl.int64) * stride_vsh
    bt_row = BlockTables + b.to(tl.int64) * stride_btb

    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if PAGED:   # a bad block id among the ones this program reads: it reads none (its rows stay empty)
        absent = tl.maximum(
            any_absent_block(bt_row, stride_btp, 0, tl.cdiv(tl.minimum(n_sink * BLOCK_N, kv_len), PAGE), num_blocks,
                             256, INTERPRET),
            any_absent_block(bt_row, stride_btp, t_lo * BLOCK_N // PAGE, tl.cdiv(tl.minimum(t_hi * BLOCK_N, kv_len), PAGE),
                             num_blocks, 256, INTERPRET))
        if BLOCK_ERR != 0:
            tl.atomic_or(Err, BLOCK_ERR, mask=absent != 0, sem="relaxed")
        n_sink = tl.where(absent != 0, 0, n_sink)
        f_lo = tl.where(absent != 0, t_lo, f_lo)
        f_hi = tl.where(absent != 0, t_lo, f_hi)
        t_hi = tl.where(absent != 0, t_lo, t_hi)
    if HAS_WINDOW:   # masked: sink tiles, then the window's leading edge
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, 0, n_sink + f_lo - t_lo, n_sink, t_lo,
            q, q_hi, row_scale, alibi, pos, kv_len, window_left, sink_tokens, softcap2,
            Kh, Vh, KSh, VSh, bt_row, stride_btp, stride_kb, stride_kt, stride_vb, stride_vt,
            stride_ksb, stride_kst, stride_vsb, stride_vst, km_rows, km_len,
            BLOCK_N, BLOCK_D, HEAD_DIM, BLOCK_DV, HEAD_DV, PAGED, PAGE, ONE_PAGE, KV_FMT, E5M2, QGROUP, CAUSAL,
            HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, True, True, HAS_KEY_MASK, DOT_DTYPE, DOT_PRECISION, ROUND_P_BF16,
            D_LO, INTERPRET)
    acc, m_i, l_i = _attend_range(   # unmasked: every row sees every key
        acc, m_i, l_i, f_lo, f_hi, n_sink, t_lo,
        q, q_hi, row_scale, alibi, pos, kv_len, window_left, sink_tokens, softcap2,
        Kh, Vh, KSh, VSh, bt_row, stride_btp, stride_kb, stride_kt, stride_vb, stride_vt,
        stride_ksb, stride_kst, stride_vsb, stride_vst, km_rows, km_len,
        BLOCK_N, BLOCK_D, HEAD_DIM, BLOCK_DV, HEAD_DV, PAGED, PAGE, ONE_PAGE, KV_FMT, E5M2, QGROUP, CAUSAL, HAS_WINDOW,
        HAS_SOFTCAP, HAS_ALIBI, False, False, False, DOT_DTYPE, DOT_PRECISION, ROUND_P_BF16, D_LO, INTERPRET)
    acc, m_i, l_i = _attend_range(   # masked: causal diagonal, last partial tile
        acc, m_i, l_i, f_hi, t_hi, n_sink, t_lo,
        q, q_hi, row_scale, alibi, pos, kv_len, window_left, sink_tokens, softcap2,
        Kh, Vh, KSh, VSh, bt_row, stride_btp, stride_kb, stride_kt, stride_vb, stride_vt,
        stride_ksb, stride_kst, stride_vsb, stride_vst, km_rows, km_len,
        BLOCK_N, BLOCK_D, HEAD_DIM, BLOCK_DV, HEAD_DV, PAGED, PAGE, ONE_PAGE, KV_FMT, E5M2, QGROUP, CAUSAL, HAS_WINDOW,
        HAS_SOFTCAP, HAS_ALIBI, True, False, HAS_KEY_MASK, DOT_DTYPE, DOT_PRECISION, ROUND_P_BF16, D_LO, INTERPRET)

    # ---- epilogue ----------------------------------------------------------------------------
    if HAS_SINKS:   # one more logit, with no value
        sink = tl.load(Sinks + head, mask=row_ok, other=0.0) * 1.4426950408889634
        m_f = tl.maximum(m_i, sink)
        m_f = tl.where(m_f == float("-inf"), 0.0, m_f)
        alpha = tl.exp2(m_i - m_f)
        l_i = l_i * alpha + tl.exp2(sink - m_f)
        acc = acc * alpha[:, None]
        m_i = m_f
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    inv_l = 1.0 / l_safe
    if KV_FMT == FMT_FP8:
        inv_l *= tl.load(VScale + kh * stride_ks)
    o = acc * inv_l[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    if OUT_FP8:
        o = tl.clamp(o / tl.load(OutScale), -448.0, 448.0)
    tok_rows = (q_start + tok).to(tl.int64)
    o_rows = tok_rows * stride_ot + head.to(tl.int64) * stride_oh
    dv = tl.arange(0, BLOCK_DV)
    tl.store(Out + o_rows[:, None] + dv[None, :] * stride_od, exact_cast(o, Out.dtype.element_ty, INTERPRET),
             mask=row_ok[:, None] & (dv < HEAD_DV)[None, :])
    tl.store(Lse + tok_rows * stride_lt + head * stride_lh, lse, mask=row_ok)


# =================================================================================================
# Launcher
# =================================================================================================


_FITTED: dict[tuple, dict] = {}   # (constants, requested config, device) -> the config that fit


def _launch_key(constants: dict, cfg: dict, device: torch.device) -> tuple:
    return tuple(sorted((k, str(v)) for k, v in constants.items())), tuple(sorted(cfg.items())), str(device)


def unsupported(query: torch.Tensor, kv_dtype: torch.dtype, value_dim: int | None = None) -> list[str]:
    """Reasons this kernel family cannot serve a call (the op front has validated the rest);
    `value_dim` (D_v) defaults to the query's head dim."""
    why = []
    d = query.shape[-1]
    if d > MAX_HEAD_DIM:
        why.append(f"head dim {d} > {MAX_HEAD_DIM} is not served by the Triton prefill kernel "
                   "(the fp32 accumulator and Q tile would not fit in registers)")
    if value_dim is not None and value_dim > MAX_HEAD_DIM:
        why.append(f"value head dim {value_dim} > {MAX_HEAD_DIM} is not served by the Triton prefill kernel "
                   "(the fp32 accumulator would not fit in registers)")
    try:
        kv_format(kv_dtype)
    except TypeError:
        why.append(f"KV dtype {kv_dtype} is not served")
    return why


def prepare(query, k, v, out, lse, *, cu_seqlens_q, cu_seqlens_k=None, block_tables=None, seq_lens=None,
            causal, scale, q_scaling, alibi_slopes, window_left, sink_tokens, sinks, softcap, out_scale,
            q_scale=None, k_scale=None, v_scale=None, max_queries=None, key_mask=None, num_blocks=None,
            block_error=errors.BLOCK_TABLES):
    """The launch of a call of this signature (only the arguments' metadata is read): `launch(query,
    k, v, out, lse, **tensors)`, with the tensor arguments of `prepare` by keyword, fills `out [T,
    Hq, D_v]` and `lse [T, Hq]` (only the rows of sequences of at most `max_queries` queries, if
    given: the caller serves the others).

    `query [T, Hq, D]`, `cu_seqlens_q [B + 1]`. Packed K/V (`cu_seqlens_k` given): `k [Tk, Hkv,
    D]`, `v [Tk, Hkv, D_v]`. Paged (`block_tables`, `seq_lens` given): `k [num_blocks, block_size,
    Hkv, D]`, `v [num_blocks, block_size, Hkv, D_v]` views. D_v is `out`'s last dim.
    `q_scale` (FP8 queries), `k_scale`/`v_scale` (FP8 queries or cache): fp32, 0-d or per head;
    INT8/INT4 caches: `k_scale`/`v_scale` are scale caches `[num_blocks, block_size, Hkv, D // group]`.
    Paged block ids outside `[0, num_blocks)` (default `k.shape[0]`) are absent blocks, flagged
    with the error bit `block_error` (0: none)."""
    t, hq, d = query.shape
    dv = out.shape[-1]
    num_seqs = cu_seqlens_q.shape[0] - 1
    if t == 0 or num_seqs <= 0:
        return no_launch
    paged = block_tables is not None
    hkv = k.shape[-2]
    group = hq // hkv
    q_fp8 = query.dtype == torch.float8_e4m3fn
    kv_fmt = kv_format(k.dtype)   # FP8 queries come with FP8 keys and values
    op_dtype = torch.float16 if q_fp8 else query.dtype
    interpret = interpreting()
    dot_dtype = _DOT_DTYPES[op_dtype]
    round_p_bf16 = interpret and op_dtype == torch.bfloat16
    if round_p_bf16:
        dot_dtype = tl.float32   # the interpreter's bf16 dot is wrong: fp32 operands holding bf16 values

    rows_per_seq = min(cdiv(t, num_seqs), max_queries if max_queries is not None else t) * group
    cfg = config(max(d, dv), op_dtype, causal, paged, rows_per_seq, group_scaled=kv_fmt.group_scaled)
    short_cfg = None
    if num_seqs > 1 and cfg["BLOCK_M"] > SHORT_BLOCK_M and group < SHORT_BLOCK_M:
        short_cfg = {**cfg, "BLOCK_M": SHORT_BLOCK_M, "num_warps": 4}

    scale_eff = (scale if scale is not None else 1.0 / math.sqrt(d)) / q_scaling
    qk_scale = scale_eff / softcap if softcap > 0 else scale_eff * LOG2E
    stride_ks, group_strides, qgroup = 0, (0,) * 6, 1
    scales = "none"   # how a call passes its K/V scales (`scale_operands`)
    if kv_fmt is KVFormat.FP8:
        scales = "given"
        if k_scale.dim() != v_scale.dim():   # one stride serves both: expand the 0-d one
            scales = "per_head"
        stride_ks = 1 if max(k_scale.dim(), v_scale.dim()) == 1 else 0
    elif kv_fmt.group_scaled:
        scales = "given"
        if k_scale.stride(-1) != 1 or v_scale.stride(-1) != 1:   # rare: a strided last dim
            k_scale, v_scale, scales = k_scale.contiguous(), v_scale.contiguous(), "contiguous"
        group_strides = (*k_scale.stride()[:3], *v_scale.stride()[:3])
        qgroup = d // k_scale.shape[-1]
    stride_qs = 1 if q_fp8 and q_scale.dim() == 1 else 0
    if paged:
        page = k.shape[1]
        num_blocks = k.shape[0] if num_blocks is None else num_blocks
        kv_cap = key_capacity(block_tables.shape[1], page, num_blocks)
        kv_strides = (k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2))
        bt_strides = (block_tables.stride(0), block_tables.stride(1))
    else:
        page, kv_cap, num_blocks = 1, k.shape[0], 0
        kv_strides = (0, k.stride(0), k.stride(1), 0, v.stride(0), v.stride(1))
        bt_strides = (0, 0)

    scalars = (
        float(qk_scale), float(softcap * LOG2E), int(window_left), int(sink_tokens), num_seqs,
        SHORT_BLOCK_M // group if short_cfg else 0,
        2**31 - 1 if max_queries is None else max_queries,   # None: a constant, one kernel specialization
        t, kv_cap, num_blocks,
        query.stride(0), query.stride(1), query.stride(2),
        *kv_strides, *bt_strides,
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        stride_qs, stride_ks, *group_strides,
        *((key_mask.stride(0), key_mask.shape[1]) if key_mask is not None else (0, 0)),
    )
    constants = dict(
        GROUP=group, NUM_KV_HEADS=hkv, HEAD_DIM=d, BLOCK_D=max(16, pow2(d)), HEAD_DV=dv, BLOCK_DV=max(16, pow2(dv)),
        PAGED=paged, PAGE=page,
        Q_FP8=q_fp8, KV_FMT=kv_fmt.code, E5M2=k.dtype == torch.float8_e5m2, QGROUP=qgroup,
        CAUSAL=bool(causal), HAS_WINDOW=window_left >= 0, HAS_SOFTCAP=softcap > 0,
        HAS_ALIBI=alibi_slopes is not None, HAS_SINKS=sinks is not None, OUT_FP8=out_scale is not None,
        DOT_DTYPE=dot_dtype, DOT_PRECISION="ieee" if op_dtype == torch.float32 else "tf32",
        ROUND_P_BF16=round_p_bf16, INTERPRET=interpret, HAS_KEY_MASK=key_mask is not None,
        BLOCK_ERR=block_error if paged else 0, D_LO=split_dims(d),
    )
    kernels = [_kernel(scalars, constants, cfg, t, num_seqs, hkv, short=False, device=query.device,
                       max_queries=max_queries)]
    if short_cfg:
        kernels.append(_kernel(scalars, constants, short_cfg, t, num_seqs, hkv, short=True, device=query.device))
    flag = errors.device_flag(query.device)

    def launch(query, k, v, out, lse, *, cu_seqlens_q, cu_seqlens_k=None, block_tables=None, seq_lens=None,
               alibi_slopes=None, sinks=None, out_scale=None, q_scale=None, k_scale=None, v_scale=None,
               key_mask=None, **_):
        if kv_fmt is KVFormat.FP8:
            k, v = k.view(torch.uint8), v.view(torch.uint8)
        if q_fp8:
            query = query.view(torch.uint8)
        k_scale, v_scale = scale_operands(scales, k_scale, v_scale, hkv, lse)
        tensors = (query, k, v, out, lse, cu_seqlens_q, seq_lens if paged else cu_seqlens_k,
                   block_tables if paged else lse, q_scale if q_fp8 else lse, k_scale, v_scale,
                   lse if alibi_slopes is None else alibi_slopes, lse if sinks is None else sinks,
                   lse if out_scale is None else out_scale, lse if key_mask is None else key_mask.view(torch.uint8),
                   flag)
        for kernel in kernels:
            kernel(*tensors)

    launch.describe = "Triton prefill, " + " + ".join(
        f"grid {k.grid[0]}: {k.meta['BLOCK_M']} x {k.meta['BLOCK_N']} tiles, {k.meta['num_warps']} warps, "
        f"{k.meta['num_stages']} stages{' (sequences of one tile)' if k.meta['SHORT'] else ''}" for k in kernels)
    launch.kernels = tuple(kernels)
    return launch


def work_slots(t: int, num_seqs: int, tok: int, max_queries: int | None) -> tuple[int, int]:
    """(slots, slots per sequence) of the work list for `t` query tokens in `num_seqs` sequences and
    tiles of `tok` tokens: the shared list (`T // TOK + B` slots, 0 per sequence), or, with
    `max_queries`, `cdiv(max_queries, TOK)` slots for each sequence where that makes fewer."""
    shared = t // tok + num_seqs
    per_seq = cdiv(max_queries, tok) if max_queries is not None else 0
    return (num_seqs * per_seq, per_seq) if 0 < per_seq and num_seqs * per_seq < shared else (shared, 0)


def _kernel(scalars, constants, cfg, t, num_seqs, hkv, *, short, device, max_queries=None) -> TritonLaunch:
    """The kernel with tile config `cfg`: over the work list (`short=False`), or one program per
    sequence and head for the sequences that fit one tile (`short=True`)."""
    block_m = cfg["BLOCK_M"]
    hpt = min(constants["GROUP"], block_m)
    head_chunks = cdiv(constants["GROUP"], hpt)
    slots, seq_slots = (num_seqs, 0) if short else work_slots(t, num_seqs, block_m // hpt, max_queries)
    constants = dict(constants, HPT=hpt, HEAD_CHUNKS=head_chunks, BLOCK_M=block_m, SHORT=short, SEQ_SLOTS=seq_slots)
    key = _launch_key(constants, cfg, device)
    fitted = _FITTED.get(key, cfg)

    def meta(c: dict) -> dict:
        return dict(constants, BLOCK_N=c["BLOCK_N"], ONE_PAGE=constants["PAGED"] and constants["PAGE"] % c["BLOCK_N"] == 0,
                    num_warps=c["num_warps"], num_stages=c["num_stages"])

    def shrink(m: dict) -> dict | None:
        smaller = _smaller({name: m[name] for name in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")})
        if smaller is None:
            return None
        _FITTED[key] = smaller
        return meta(smaller)

    return TritonLaunch(_prefill_kernel, (slots * hkv * head_chunks,), scalars, meta(fitted), shrink=shrink)
