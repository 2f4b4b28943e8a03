"""Triton `attn::kv_cache_write` with a value head dim of its own (`value [T, Hkv, D_v]`, `v_cache
[..., D_v]`, D_v != D; plain and FP8 caches): the MLA latent cache in one launch.

A latent row of DeepSeek-V3 / Kimi K2 is 512 compressed dims then 64 RoPE dims. Its write is
`key` = the RoPE part `[T, 1, 64]` into `k_cache = latent[..., 512:]`, rotated (`positions`,
`cos_sin_cache [max_position, 64]`), and `value` = the compressed part `[T, 1, 512]` into
`v_cache = latent[..., :512]`; `query` (the queries' RoPE part, `[T, Hq, 64]`) is rotated alongside.
`paged_decode` then reads `latent` as keys and `latent[..., :512]` as values.

Programs `[0, n_kv)` each own `BT_KV` tokens x `BH_KV` heads of key and value; programs after them
own `BT_Q` tokens x `BH_Q` query heads (only with `query`). The numbers are those of
`kv_cache_write`'s kernel, whose RoPE (`_rope`), quantizing store (`_store`) and position clamp
(`rope_position`) this kernel calls: bit for bit the reference's. Slots and positions out of range
are skipped or clamped and flagged as there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import errors, gpu
from ...quant import KVFormat, kv_format
from . import cdiv, interpreting, pow2
from .formats import FMT_PLAIN
from .interpreter import exact_cast
from .kv_cache_write import _rope, _store, rope_position, tile, tuning
from .launcher import TritonLaunch

_ERR_SLOT = tl.constexpr(errors.SLOT_MAPPING)
MAX_HEAD_DIM = 1024


@triton.jit(do_not_specialize=["num_tokens", "num_kv_programs"])
def _latent_cache_write_kernel(
    Key, Value, KCache, VCache, KScale, VScale, Slots, Positions, CosSin, Query, QOut, Err,
    num_tokens, num_slots, max_position, num_kv_programs,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch, stride_ksh, stride_vsh,
    stride_slot, stride_pos, stride_cs, stride_csd,
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
    NUM_KV_HEADS: tl.constexpr, NUM_Q_HEADS: tl.constexpr, D_K: tl.constexpr, DP_K: tl.constexpr,
    D_V: tl.constexpr, DP_V: tl.constexpr, BLOCK_SIZE: tl.constexpr, FMT: tl.constexpr, FP8_MAX: tl.constexpr,
    ROPE: tl.constexpr, NEOX: tl.constexpr, ROT: tl.constexpr, HAS_QUERY: tl.constexpr,
    BT_KV: tl.constexpr, BH_KV: tl.constexpr, BT_Q: tl.constexpr, BH_Q: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """`Key [T, Hkv, D_K]`, `Value [T, Hkv, D_V]` into caches `[num_blocks, BLOCK_SIZE, Hkv, D_K | D_V]`
    at `Slots [T]`; `Query [T, Hq, D_K]` rotated into `QOut`. Tiles `[tokens, heads, 1, DP]`."""
    pid = tl.program_id(0)
    zero = tl.zeros((1, 1), tl.int32)
    if pid < num_kv_programs:
        HB: tl.constexpr = (NUM_KV_HEADS + BH_KV - 1) // BH_KV
        t = (pid // HB) * BT_KV + tl.arange(0, BT_KV)
        h = (pid % HB) * BH_KV + tl.arange(0, BH_KV)
        t_ok = t < num_tokens
        slot = tl.load(Slots + t.to(tl.int64) * stride_slot, mask=t_ok, other=-1).to(tl.int64)
        tl.atomic_or(Err + t * 0, _ERR_SLOT, mask=slot >= num_slots)
        w_ok = t_ok & (slot >= 0) & (slot < num_slots)
        block4 = (slot // BLOCK_SIZE)[:, None, None, None]
        offset4 = (slot % BLOCK_SIZE)[:, None, None, None]
        t4 = t.to(tl.int64)[:, None, None, None]
        h4 = h.to(tl.int64)[None, :, None, None]
        row_ok = w_ok[:, None, None, None] & (h4 < NUM_KV_HEADS)
        ek = tl.arange(0, DP_K)[None, :]
        ev = tl.arange(0, DP_V)[None, :]
        k_ptrs = Key + t4 * stride_kt + h4 * stride_kh + ek
        k = tl.load(k_ptrs, mask=row_ok & (ek < D_K), other=0.0)
        v = tl.load(Value + t4 * stride_vt + h4 * stride_vh + ev, mask=row_ok & (ev < D_V), other=0.0)
        if ROPE:
            pos, pos_ok = rope_position(Positions, t, t_ok, stride_pos, max_position, Err, True)
            k = _rope(k.to(tl.float32), k_ptrs, row_ok & (ek < D_K), 1, CosSin + pos * stride_cs, pos_ok,
                      stride_csd, zero, ek, BT_KV, BH_KV, 1, DP_K, D_K, ROT, NEOX)
        k_scale = KScale
        v_scale = VScale
        if FMT != FMT_PLAIN:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            hs = tl.where(h < NUM_KV_HEADS, h, 0)
            k_scale = tl.load(KScale + hs * stride_ksh)[None, :, None, None]
            v_scale = tl.load(VScale + hs * stride_vsh)[None, :, None, None]
        k_rows = KCache + block4 * stride_kcb + offset4 * stride_kct + h4 * stride_kch
        v_rows = VCache + block4 * stride_vcb + offset4 * stride_vct + h4 * stride_vch
        _store(k, KCache, k_rows, k_scale, 0, row_ok, zero, ek, FMT, FP8_MAX, 0.0, 0.0,
               BT_KV, BH_KV, 1, 1, DP_K, D_K, INTERPRETED, "")
        _store(v, VCache, v_rows, v_scale, 0, row_ok, zero, ev, FMT, FP8_MAX, 0.0, 0.0,
               BT_KV, BH_KV, 1, 1, DP_V, D_V, INTERPRETED, "")
    elif HAS_QUERY:
        HB_Q: tl.constexpr = (NUM_Q_HEADS + BH_Q - 1) // BH_Q
        qpid = pid - num_kv_programs
        tq = (qpid // HB_Q) * BT_Q + tl.arange(0, BT_Q)
        hq = ((qpid % HB_Q) * BH_Q + tl.arange(0, BH_Q)).to(tl.int64)[None, :, None, None]
        dq = tl.arange(0, DP_K)[None, :]
        tq_ok = tq < num_tokens
        tq4 = tq.to(tl.int64)[:, None, None, None]
        q_ok = tq_ok[:, None, None, None] & (hq < NUM_Q_HEADS) & (dq < D_K)
        q_ptrs = Query + tq4 * stride_qt + hq * stride_qh + dq * stride_qd
        q = tl.load(q_ptrs, mask=q_ok, other=0.0).to(tl.float32)
        q_pos, q_pos_ok = rope_position(Positions, tq, tq_ok, stride_pos, max_position, Err, False)
        q = _rope(q, q_ptrs, q_ok, stride_qd, CosSin + q_pos * stride_cs, q_pos_ok, stride_csd, zero, dq,
                  BT_Q, BH_Q, 1, DP_K, D_K, ROT, NEOX)
        o_ptrs = QOut + tq4 * stride_ot + hq * stride_oh + dq * stride_od
        tl.store(o_ptrs, exact_cast(q, QOut.dtype.element_ty, INTERPRETED), mask=q_ok)


def unsupported(key, value, k_cache, v_cache, slot_mapping, **options) -> list[str]:
    """Reasons this kernel cannot run a validated call with `D_v != D`."""
    d, dv = key.shape[-1], value.shape[-1]
    if max(d, dv) > MAX_HEAD_DIM:
        return [f"head dims above {MAX_HEAD_DIM} are not served by the Triton kv_cache_write kernel, got {d} and {dv}"]
    return []


def prepare(key, value, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None, query=None,
            positions=None, cos_sin_cache=None, rope_neox=True):
    """`launch(*args, **kwargs)` for calls of this signature (only the metadata is read)."""
    t, hkv, d = key.shape
    dv = value.shape[-1]
    fmt = kv_format(k_cache.dtype)
    dp_k, dp_v = pow2(d), pow2(dv)
    sms = gpu.sm_count(key.device, cpu=1)
    tile_elems = tuning.current.tile_elems[fmt]
    bt_kv, bh_kv = tile(t, hkv, pow2(dp_k + dp_v), sms, tile_elems)   # powers of two
    n_kv = cdiv(t, bt_kv) * cdiv(hkv, bh_kv)
    hq, bt_q, bh_q, n_q = 1, 1, 1, 0
    if query is not None:
        hq = query.shape[1]
        bt_q, bh_q = tile(t, hq, dp_k, sms, tile_elems)
        n_q = cdiv(t, bt_q) * cdiv(hq, bh_q)
    fp8 = fmt is KVFormat.FP8
    rope = positions is not None
    cs = cos_sin_cache if rope else key
    kernel = TritonLaunch(_latent_cache_write_kernel, (n_kv + n_q,), (
        t, k_cache.shape[0] * k_cache.shape[1], cs.shape[0] if rope else 0, n_kv,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        k_scale.stride(0) if fp8 and k_scale.dim() else 0, v_scale.stride(0) if fp8 and v_scale.dim() else 0,
        slot_mapping.stride(0), (positions if rope else slot_mapping).stride(0),
        cs.stride(0) if rope else 0, cs.stride(1) if rope else 0,
        *(query.stride() if query is not None else (0, 0, 0)),
        *(torch.empty_like(query).stride() if query is not None else (0, 0, 0)),   # the rotated query's
    ), dict(
        NUM_KV_HEADS=hkv, NUM_Q_HEADS=hq, D_K=d, DP_K=dp_k, D_V=dv, DP_V=dp_v, BLOCK_SIZE=k_cache.shape[1],
        FMT=fmt.code, FP8_MAX=float(torch.finfo(k_cache.dtype).max) if fp8 else 0.0,
        ROPE=rope, NEOX=bool(rope_neox), ROT=cs.shape[1] if rope else 0, HAS_QUERY=query is not None,
        BT_KV=bt_kv, BH_KV=bh_kv, BT_Q=bt_q, BH_Q=bh_q, INTERPRETED=interpreting(),
        num_warps=tuning.current.num_warps, enable_fp_fusion=False,
    ))
    flag = errors.device_flag(key.device)

    def launch(key, value, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None, query=None,
               positions=None, cos_sin_cache=None, **_):
        rotated = torch.empty_like(query) if query is not None else None
        kernel(key, value, k_cache, v_cache, k_scale if fp8 else k_cache, v_scale if fp8 else v_cache,
               slot_mapping, slot_mapping if positions is None else positions,
               key if cos_sin_cache is None else cos_sin_cache, key if query is None else query,
               key if rotated is None else rotated, flag)
        return rotated if rotated is not None else key.new_empty(0)

    return launch
