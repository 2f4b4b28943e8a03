"""The Triton `paged_decode` kernels: `_paged_decode_kernel` (one program per (sequence, KV head,
M tile, split)) and `_merge_kernel` (split-K partials -> out/lse). Design: the module docstring of
`torch_ops.kernels.triton.paged_decode`, which launches them."""

from __future__ import annotations

import triton
import triton.language as tl

from .block_table import any_absent_block, clamped_seq_len
from .formats import FMT_FP8, FMT_PLAIN
from .interpreter import exact_cast
from .online_softmax import softmax_step
from .paged_decode_dequant import _load_lanes


@triton.jit
def _split_geometry(L, window_left, split, num_splits, min_split, QPS, HAS_WINDOW: tl.constexpr, BLOCK_N):
    """Key range of split `split` of a sequence of `L` keys: (kv_lo, start, end, n_active).

    The visible span [kv_lo, L) (kv_lo: the first query's window start, aligned down to BLOCK_N)
    is cut into parts of `per` keys, a multiple of BLOCK_N and >= min_split. QPS and BLOCK_N are
    the attention kernels' constexprs, and the merge's run-time integers."""
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


@triton.jit
def _load_plain(Base, rows, n_ok, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    return tl.load(Base + rows[:, None] + d[None, :], mask=n_ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)


@triton.jit
def _tile(it, acc0, acc1, acc2, acc3, m_i, l_i, q0, q1, q2, q3, qk_scale, softcap, window_left, sink_tokens,
          n_sink, sink_hi, start, end, pos, rep, alibi2, bt_row, stride_btp, km_rows, km_len,
          K, V, KS, VS, k_head, v_head, ks_head, vs_head,
          stride_kb, stride_kt, stride_vb, stride_vt, stride_ksb, stride_kst, stride_vsb, stride_vst,
          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, R: tl.constexpr,
          PAGE: tl.constexpr, ONE_PAGE: tl.constexpr, ROWS32: tl.constexpr, CLAMP_REPLICAS: tl.constexpr,
          FMT: tl.constexpr, E5M2: tl.constexpr, NG: tl.constexpr, NGP: tl.constexpr, GW: tl.constexpr,
          QGROUP: tl.constexpr, SCALE_PER_GRP: tl.constexpr, ASM: tl.constexpr,
          HAS_ALIBI: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
          DOT_F32: tl.constexpr, SVEC: tl.constexpr, SCALE_F16: tl.constexpr, HAS_KEY_MASK: tl.constexpr):
    """Chunk `it` of this program's key ranges (sink chunks first): R tiles of BLOCK_N keys, tile
    j scored by the rows of replica j (`rep`), then one online-softmax step per row. The block ids
    it reads are known to lie in the cache (`any_absent_block`). Chunks start on multiples of
    CHUNK, so a replica's tile can start past the table row only when the row's keys are not a
    multiple of CHUNK: then (CLAMP_REPLICAS) it reads the entry of the last key instead."""
    CHUNK: tl.constexpr = R * BLOCK_N
    if HAS_WINDOW:
        in_sink = it < n_sink
        t0 = tl.where(in_sink, it * CHUNK, start + (it - n_sink) * CHUNK)
        hi = tl.where(in_sink, sink_hi, end)
    else:
        t0 = start + it * CHUNK
        hi = end

    s = tl.zeros([rep.shape[0], BLOCK_N], tl.float32)
    v_tiles = ()
    for j in tl.static_range(R):
        offs_n = t0 + j * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        if ONE_PAGE:
            first = t0 + j * BLOCK_N
            if CLAMP_REPLICAS and j > 0:
                first = tl.minimum(first, hi - 1)
            page = tl.load(bt_row + (first // PAGE) * stride_btp)
        else:
            page = tl.load(bt_row + (offs_n // PAGE) * stride_btp, mask=n_ok, other=0)
        page = page.to(tl.int64)
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
        else:
            s = tl.where((rep == j)[:, None], qk, s)

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
    vis = (key < hi) & (dist >= 0)
    if HAS_WINDOW:
        vis = vis & ((dist <= window_left) | (key < sink_tokens))
    if HAS_KEY_MASK:   # km_rows: each row's key_mask row (row 0 for rows past the query's)
        vis = vis & (tl.load(km_rows[:, None] + key, mask=vis & (key < km_len), other=0) != 0)
    s = tl.where(vis, s, float("-inf"))
    p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, True)

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
    return acc0, acc1, acc2, acc3, m_i, l_i


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
    PAGE: tl.constexpr, ONE_PAGE: tl.constexpr, ROWS32: tl.constexpr, CLAMP_REPLICAS: tl.constexpr,
    QPS: tl.constexpr, GROUP: tl.constexpr,
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
    L = clamped_seq_len(SeqLens, b, kv_cap, Err, True)
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
    # a bad block id among the ones this program reads: it reads none (its rows stay empty)
    absent = tl.maximum(
        any_absent_block(bt_row, stride_btp, 0, tl.cdiv(sink_hi, PAGE), num_blocks, 256, not DYNAMIC_LOOP),
        any_absent_block(bt_row, stride_btp, start // PAGE, tl.cdiv(tl.maximum(end, start), PAGE), num_blocks,
                         256, not DYNAMIC_LOOP))
    if BLOCK_ERR != 0:
        tl.atomic_or(Err, BLOCK_ERR, mask=absent != 0, sem="relaxed")
    n_iter = tl.where(absent != 0, 0, n_sink + n_main)
    if DYNAMIC_LOOP:
        for it in range(0, n_iter):
            acc0, acc1, acc2, acc3, m_i, l_i = _tile(
                it, acc0, acc1, acc2, acc3, m_i, l_i, q0, q1, q2, q3, qk_scale, softcap, window_left,
                sink_tokens, n_sink, sink_hi, start, end, pos, rep, alibi2, bt_row, stride_btp, km_rows, km_len,
                K, V, KS, VS, k_head, v_head, ks_head, vs_head,
                stride_kb, stride_kt, stride_vb, stride_vt, stride_ksb, stride_kst, stride_vsb, stride_vst,
                HEAD_DIM, BLOCK_D, BLOCK_N, R, PAGE, ONE_PAGE, ROWS32, CLAMP_REPLICAS, FMT, E5M2, NG, NGP, GW, QGROUP,
                SCALE_PER_GRP, ASM, HAS_ALIBI, HAS_WINDOW, HAS_SOFTCAP, DOT_F32, SVEC, SCALE_F16, HAS_KEY_MASK)
    else:
        # Triton's interpreter cannot take a loaded value as a loop bound (numpy >= 2.4): a fixed
        # trip count with the tail skipped; same arithmetic
        for it in range(0, MAX_ITERS):
            if it < n_iter:
                acc0, acc1, acc2, acc3, m_i, l_i = _tile(
                    it, acc0, acc1, acc2, acc3, m_i, l_i, q0, q1, q2, q3, qk_scale, softcap, window_left,
                    sink_tokens, n_sink, sink_hi, start, end, pos, rep, alibi2, bt_row, stride_btp, km_rows, km_len,
                    K, V, KS, VS, k_head, v_head, ks_head, vs_head,
                    stride_kb, stride_kt, stride_vb, stride_vt, stride_ksb, stride_kst, stride_vsb, stride_vst,
                    HEAD_DIM, BLOCK_D, BLOCK_N, R, PAGE, ONE_PAGE, ROWS32, CLAMP_REPLICAS, FMT, E5M2, NG, NGP, GW, QGROUP,
                    SCALE_PER_GRP, ASM, HAS_ALIBI, HAS_WINDOW, HAS_SOFTCAP, DOT_F32, SVEC, SCALE_F16, HAS_KEY_MASK)

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
    VScale = VS + kh * stride_fp8s
    _store_rows(acc, m_i, l_i, tok, head, row_ok, tl.arange(0, BLOCK_D) < HEAD_DIM, split, VScale, Sinks, OutScale,
                Out, Lse, POut, PLse, stride_ot, stride_oh, stride_od, stride_lt, stride_lh,
                stride_ps, stride_pt, stride_ph, stride_pls, stride_plt,
                FMT == FMT_FP8, HAS_SINKS, OUT_FP8, SPLIT, BLOCK_D, not DYNAMIC_LOOP)


@triton.jit
def _store_rows(acc, m_i, l_i, tok, head, row_ok, d_ok, split, VScale, Sinks, OutScale,
                Out, Lse, POut, PLse, stride_ot, stride_oh, stride_od, stride_lt, stride_lh,
                stride_ps, stride_pt, stride_ph, stride_pls, stride_plt,
                V_SCALED: tl.constexpr, HAS_SINKS: tl.constexpr, OUT_FP8: tl.constexpr, SPLIT: tl.constexpr,
                BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr):
    """The epilogue of a decode program's query rows (token `tok`, head `head`; `row_ok`): `acc
    [rows, BLOCK_D]` over `l_i` (times the FP8 value scale at `VScale` if V_SCALED) and the
    log-sum-exp from `m_i` (log2 units), into split `split`'s partials, or, with learned sinks
    joined and FP8 output quantized, into `Out`/`Lse`; columns where `d_ok`. Rows that saw no key
    write zeros and -inf."""
    empty = l_i == 0.0
    inv_l = 1.0 / tl.where(empty, 1.0, l_i)
    if V_SCALED:
        inv_l = inv_l * tl.load(VScale)
    o = acc * inv_l[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    d = tl.arange(0, BLOCK_D)
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
        o = exact_cast(o, Out.dtype.element_ty, INTERPRET)
        tl.store(Out + o_rows[:, None] + d[None, :] * stride_od, o,
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(Lse + tok.to(tl.int64) * stride_lt + head * stride_lh, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits", "min_split", "qps", "chunk"])   # one compiled merge per tile shape
def _merge_kernel(
    POut, PLse, Out, Lse, SeqLens, Sinks, OutScale,
    window_left, num_splits, min_split, qps, chunk,
    stride_ps, stride_pt, stride_ph, stride_pls, stride_plt,
    stride_ot, stride_oh, stride_od, stride_lt, stride_lh, kv_cap,
    NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    NS_P: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, OUT_FP8: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Combine the active splits' partial (out, lse) of BLOCK_H heads and BLOCK_D head dims of one
    query token (`qps` per sequence; splits cut in steps of `chunk` keys); add the learned sinks;
    write out (query dtype or FP8) and lse (the first dim block writes it)."""
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < NUM_HEADS
    L = clamped_seq_len(SeqLens, t // qps, kv_cap, SeqLens, False)
    _, _, _, n_active = _split_geometry(L, window_left, 0, num_splits, min_split, qps, HAS_WINDOW, chunk)
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
