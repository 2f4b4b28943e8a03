"""Pure-PyTorch reference of every op: the test oracle and the `vanilla` backend.

Readable over fast: one Python loop over sequences, dense scores per sequence. It runs on any
device, reads metadata on the host (so it is not CUDA-graph safe), and computes in
`compute_dtype`: fp32 by default (the `vanilla` backend); the input dtype for the same-precision
baseline of the error-ratio tolerance; fp64 for ground truth, which returns the unrounded fp64
result (`out` and `lse` in fp64, no output cast and no FP8 output quantization). Optimized code
never imports this file. Semantics: docs/ops.md.
"""

from __future__ import annotations

import math

import torch

from . import quant
from .checks import paged_value_dim, ppl_cache_views
from .ops import alibi_slopes, attention_output_dtype, bucket
from .quant import KVFormat, kv_format


def _acc_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if compute_dtype == torch.float64 else torch.float32


def finish_output(out: torch.Tensor, dtype: torch.dtype, out_scale) -> torch.Tensor:
    """Cast the float result to the op's output dtype; FP8 output divides by `out_scale`.
    A float64 result (the oracle) stays as it is."""
    if out.dtype == torch.float64:
        return out
    if out_scale is None:
        return out.to(dtype)
    m = torch.finfo(torch.float8_e4m3fn).max
    return (out.float() / out_scale.float()).clamp(-m, m).to(torch.float8_e4m3fn)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    q_scaling: float = 1.0,
    alibi_slopes: torch.Tensor | None = None,
    window_left: int = -1,
    sink_tokens: int = 0,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
    bias: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one sequence.

    q `[Lq, Hq, D]`, k `[Lk, Hkv, D]`, v `[Lk, Hkv, D_v]` (already dequantized), `q_positions [Lq]`
    absolute positions of the queries (keys sit at 0..Lk-1), `bias` additive `[Hq or 1, Lq, Lk]`,
    `key_mask` bool `[Lq, Lk]` (False: the query does not see the key).
    Returns `out [Lq, Hq, D_v]` and `lse [Lq, Hq]`, fp32 (fp64 when `compute_dtype` is fp64).
    """
    lq, hq, d = q.shape
    lk, hkv = k.shape[0], k.shape[1]
    group = hq // hkv
    softmax_dtype = _acc_dtype(compute_dtype)
    qc = q.to(compute_dtype).transpose(0, 1)                                   # [Hq, Lq, D]
    kc = k.to(compute_dtype).repeat_interleave(group, dim=1).transpose(0, 1)   # [Hq, Lk, D]
    vc = v.to(compute_dtype).repeat_interleave(group, dim=1).transpose(0, 1)
    scale_eff = (scale if scale is not None else 1.0 / math.sqrt(d)) / q_scaling

    s = (qc @ kc.transpose(1, 2)).to(softmax_dtype) * scale_eff               # [Hq, Lq, Lk]
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    p = q_positions.to(q.device, torch.int64).view(1, lq, 1)
    j = torch.arange(lk, device=q.device).view(1, 1, lk)
    if alibi_slopes is not None:
        s = s - alibi_slopes.to(softmax_dtype).view(hq, 1, 1) * (p - j).abs()
    if bias is not None:
        s = s + bias.to(softmax_dtype)
    visible = torch.ones(1, lq, lk, dtype=torch.bool, device=q.device)
    if causal:
        visible &= j <= p
    if window_left >= 0:
        visible &= (j >= p - window_left) | (j < sink_tokens)
    if key_mask is not None:
        visible &= key_mask.to(q.device).view(1, lq, lk)
    s = s.masked_fill(~visible, float("-inf"))

    terms = s
    if sinks is not None:
        sink = sinks.to(softmax_dtype).view(hq, 1, 1).expand(hq, lq, 1)
        terms = torch.cat([s, sink], dim=-1)
    # normalized by the row max, not by lse: exp(s - lse) loses the precision of a large lse
    row_max = terms.amax(dim=-1, keepdim=True) if terms.shape[-1] else terms.new_zeros((*terms.shape[:-1], 1))
    row_max = row_max.masked_fill(row_max == -math.inf, 0.0)   # rows that see nothing; +inf and NaN propagate
    denom = torch.exp(terms - row_max).sum(dim=-1, keepdim=True)
    probs = torch.exp(s - row_max) / torch.where(denom == 0, torch.ones_like(denom), denom)   # 0 where masked
    lse = (row_max + denom.log()).squeeze(-1)                                  # [Hq, Lq]; -inf: nothing seen
    out = probs.to(compute_dtype) @ vc                                         # [Hq, Lq, D_v]
    return out.to(softmax_dtype).transpose(0, 1), lse.transpose(0, 1)


def _mask_rows(key_mask, q0: int, q1: int, num_keys: int):
    """`key_mask`'s rows `q0:q1` over a sequence's `num_keys` keys (keys past its width hidden)."""
    if key_mask is None:
        return None
    rows = torch.zeros(q1 - q0, num_keys, dtype=torch.bool, device=key_mask.device)
    n = min(num_keys, key_mask.shape[1])
    rows[:, :n] = key_mask[q0:q1, :n]
    return rows


def _ranges(bounds: list[int], size: int) -> list[tuple[int, int]]:
    """Each sequence's `[start, end)` from its boundaries, clamped into `[0, size]` as the kernels
    clamp them (a bad length touches nothing outside the tensor)."""
    out = []
    for lo, hi in zip(bounds, bounds[1:]):
        lo = min(max(lo, 0), size)
        out.append((lo, min(max(hi, lo), size)))
    return out


def _present_blocks(block_table, length: int, block_size: int, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The block ids of a sequence's first `length` tokens (those outside `[0, num_blocks)`
    replaced by 0) and which of the tokens lie in a block inside the cache, `[length]` bool:
    the kernels treat a block id outside the cache as an absent block."""
    blocks = block_table[: -(-length // block_size)].long()
    inside = (blocks >= 0) & (blocks < num_blocks)
    return torch.where(inside, blocks, 0), inside.repeat_interleave(block_size)[:length]


def _gather_paged(cache, scale, fmt: KVFormat, blocks, length: int, dtype: torch.dtype) -> torch.Tensor:
    """The first `length` tokens of one sequence in `blocks`, dequantized to `[length, Hkv, D]` in `dtype`
    (`D` of the cache: its last dim, twice that for packed INT4)."""
    x = cache[blocks].flatten(0, 1)[:length]
    s = scale
    if fmt.group_scaled:
        s = scale[blocks].flatten(0, 1)[:length]
    return quant.dequantize(x, s, fmt, dtype)


def _paged_attention(query, k_cache, v_cache, block_tables, q_starts, seq_lens, *, causal, k_scale,
                     v_scale, out_scale, compute_dtype, key_mask=None, **options):
    fmt = kv_format(k_cache.dtype)
    acc = _acc_dtype(compute_dtype)
    out = torch.zeros(*query.shape[:2], paged_value_dim(query, k_cache, v_cache), dtype=acc, device=query.device)
    lse = torch.full(query.shape[:2], float("-inf"), dtype=acc, device=query.device)
    capacity = block_tables.shape[1] * k_cache.shape[1]
    q_rows, lens = _ranges(q_starts.tolist(), query.shape[0]), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q0, q1 = q_rows[b]
        seq_len = min(max(seq_len, 0), capacity)
        if q1 == q0:
            continue
        blocks, present = _present_blocks(block_tables[b], seq_len, k_cache.shape[1], k_cache.shape[0])
        k = _gather_paged(k_cache, k_scale, fmt, blocks, seq_len, acc)
        v = _gather_paged(v_cache, v_scale, fmt, blocks, seq_len, acc)
        positions = torch.arange(seq_len - (q1 - q0), seq_len, device=query.device)
        mask = present.to(query.device).expand(q1 - q0, seq_len)
        if key_mask is not None:
            mask = mask & _mask_rows(key_mask, q0, q1, seq_len)
        o, l = attend(query[q0:q1], k, v, positions, causal=causal, key_mask=mask,
                      compute_dtype=compute_dtype, **options)
        out[q0:q1], lse[q0:q1] = o, l
    return finish_output(out, attention_output_dtype(query, out_scale), out_scale), lse


def paged_decode(query, k_cache, v_cache, block_tables, seq_lens, *, k_scale=None, v_scale=None,
                 out_scale=None, compute_dtype=torch.float32, **options):
    """`query [B * q_per_seq, Hq, D]` over a paged cache; returns `(out, lse)`."""
    num_seqs = seq_lens.shape[0]
    q_per_seq = query.shape[0] // num_seqs if num_seqs else 0
    q_starts = torch.arange(num_seqs + 1) * q_per_seq
    return _paged_attention(query, k_cache, v_cache, block_tables, q_starts, seq_lens, causal=True,
                            k_scale=k_scale, v_scale=v_scale, out_scale=out_scale,
                            compute_dtype=compute_dtype, **options)


def paged_prefill(query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, *, causal=True,
                  k_scale=None, v_scale=None, out_scale=None, compute_dtype=torch.float32, **options):
    """Varlen `query [T, Hq, D]` (`cu_seqlens_q [B + 1]`) over a paged cache (`k_cache [..., D]`,
    `v_cache [..., D_v]`); returns `(out [T, Hq, D_v], lse [T, Hq])`."""
    return _paged_attention(query, k_cache, v_cache, block_tables, cu_seqlens_q.cpu(), seq_lens, causal=causal,
                            k_scale=k_scale, v_scale=v_scale, out_scale=out_scale,
                            compute_dtype=compute_dtype, **options)


def context_attention(query, key, value, cu_seqlens_q, cu_seqlens_k, *, causal=False, q_scale=None,
                      k_scale=None, v_scale=None, out_scale=None, out_dtype=None, positions=None,
                      cos_sin_cache=None, rope_neox=True, key_mask=None, compute_dtype=torch.float32, **options):
    """Varlen attention on fresh `query [Tq, Hq, D]`, `key [Tk, Hkv, D]`, `value [Tk, Hkv, D_v]`;
    returns `(out [Tq, Hq, D_v], lse [Tq, Hq])`.
    With `positions [T]`, query and key are rotated first (RoPE), rounded to their dtype as a
    separate RoPE op would leave them (the float64 oracle keeps them unrounded)."""
    dtype = attention_output_dtype(query, out_scale, out_dtype)
    acc = _acc_dtype(compute_dtype)
    if positions is not None:
        rotated_dtype = torch.float64 if compute_dtype == torch.float64 else query.dtype
        query, key = (apply_rope(x, positions, cos_sin_cache, rope_neox, rotated_dtype) for x in (query, key))
    if query.dtype == torch.float8_e4m3fn:
        query, key, value = (quant.dequantize_fp8(x, s, acc) for x, s in ((query, q_scale), (key, k_scale), (value, v_scale)))
    t, hq, _ = query.shape
    out = torch.zeros(t, hq, value.shape[-1], dtype=acc, device=query.device)
    lse = torch.full((t, hq), float("-inf"), dtype=acc, device=query.device)
    q_rows, k_rows = _ranges(cu_seqlens_q.tolist(), t), _ranges(cu_seqlens_k.tolist(), key.shape[0])
    for b in range(len(q_rows)):
        (q0, q1), (k0, k1) = q_rows[b], k_rows[b]
        if q1 == q0:
            continue
        positions = torch.arange((k1 - k0) - (q1 - q0), k1 - k0, device=query.device)
        o, l = attend(query[q0:q1], key[k0:k1], value[k0:k1], positions, causal=causal,
                      key_mask=_mask_rows(key_mask, q0, q1, k1 - k0), compute_dtype=compute_dtype, **options)
        out[q0:q1], lse[q0:q1] = o, l
    return finish_output(out, dtype, out_scale), lse


def merge_states(out_a, lse_a, out_b, lse_b):
    """Merge two partial states over disjoint keys; returns `(out, lse)`."""
    top = torch.maximum(lse_a, lse_b)
    top = top.masked_fill(top == -math.inf, 0.0)                       # both empty; +inf and NaN propagate
    wa, wb = torch.exp(lse_a - top), torch.exp(lse_b - top)            # weights relative to the larger state
    total = wa + wb
    lse = top + total.log()
    total = torch.where(total == 0, torch.ones_like(total), total).unsqueeze(-1)
    out = (wa.unsqueeze(-1) * out_a.float() + wb.unsqueeze(-1) * out_b.float()) / total
    return out.to(out_a.dtype), lse


def rope_cos_sin_cache(max_position: int, rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    """`[max_position, rotary_dim]` fp32: cosines then sines of the standard RoPE frequencies."""
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.arange(max_position, dtype=torch.float64).unsqueeze(1) * inv_freq
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, neox: bool,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rotary embedding of `x [T, H, D]` at `positions [T]`, computed in `dtype` (fp32 or fp64)
    and returned in it; `[T, H, D]`.

    NeoX style rotates the pairs `(x[i], x[i + R/2])`, GPT-J style `(x[2i], x[2i+1])`, for
    `i < R/2` with `R = cos_sin_cache.shape[1]`; dims past `R` are unchanged. Positions outside
    the table's rows are clamped into them.
    """
    rot = cos_sin_cache.shape[1]
    math_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    rows = positions.long().clamp(0, cos_sin_cache.shape[0] - 1)    # as the kernels clamp them
    cos, sin = cos_sin_cache[rows].to(math_dtype).chunk(2, dim=-1)    # [T, R/2]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x = x.to(math_dtype)
    xr, rest = x[..., :rot], x[..., rot:]
    if neox:
        a, b = xr.chunk(2, dim=-1)
        rotated = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    else:
        a, b = xr[..., 0::2], xr[..., 1::2]
        rotated = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    return torch.cat([rotated, rest], dim=-1).to(dtype)


def _store(cache, scale, rows, x: torch.Tensor) -> None:
    """Quantize `x [N, H, D]` for `cache` and store it (and its group scales) at `cache[rows]`."""
    group = 0
    if kv_format(cache.dtype).group_scaled:
        group = x.shape[-1] // scale.shape[-1]
    stored, group_scales = quant.quantize(x, scale, cache.dtype, group, scale.dtype if group else torch.float32)
    cache[rows] = stored
    if group_scales is not None:
        scale[rows] = group_scales


def _last_of_each_slot(slot_mapping: torch.Tensor) -> torch.Tensor:
    """Bool `[T]`: True for the last token of each slot in `slot_mapping [T]` (the token that
    lands when several share a slot)."""
    slots, inverse = torch.unique(slot_mapping, return_inverse=True)
    order = torch.arange(slot_mapping.shape[0], device=slot_mapping.device)
    last = order.new_zeros(slots.shape[0]).scatter_reduce(0, inverse, order, "amax", include_self=False)
    return last[inverse] == order


def kv_cache_write(key, value, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None, query=None,
                   positions=None, cos_sin_cache=None, rope_neox=True):
    """Write `key/value [T, Hkv, D]` at `slot_mapping [T]` (RoPE on key and query first, if given).

    Mutates the caches (and INT8/INT4 scale caches); returns the rotated query or an empty tensor.
    """
    rotated_query = key.new_empty(0)
    k = key.float()
    if positions is not None:
        k = apply_rope(key, positions, cos_sin_cache, rope_neox)
        if query is not None:
            rotated_query = apply_rope(query, positions, cos_sin_cache, rope_neox).to(query.dtype)
    if k_cache.dtype in quant.FLOAT_DTYPES:
        k = k.to(key.dtype)  # a plain cache holds exactly what a separate RoPE op would produce
    block_size = k_cache.shape[1]
    keep = (slot_mapping >= 0) & (slot_mapping < k_cache.shape[0] * block_size)   # others skip the token
    keep &= _last_of_each_slot(slot_mapping)   # repeated slots: the last token lands, whole
    slots = slot_mapping[keep].long()
    rows = (slots // block_size, slots % block_size)
    _store(k_cache, k_scale, rows, k[keep])
    _store(v_cache, v_scale, rows, value[keep])
    return rotated_query


def cache_attention(query, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
                    decoding_batches, max_seqlen, max_kvlen, cache, scale=None, attn_mask=None, *,
                    num_heads, head_dim, is_causal=True, is_alibi=False, num_kv_heads=0, num_layer=1,
                    layer_idx=0, quant_bit=0, quant_group=8, cache_mode=0, cache_layout=0, page_size=128,
                    compute_dtype=torch.float32):
    """PPL `MultiHeadCacheAttention` (docs/ops.md): write current k/v into `cache`, then attend.
    `decoding_batches` needs no reading: a decode has one new token, which causality leaves alone.
    Out-of-range metadata as the kernels take it (docs/ops.md, "Errors")."""
    if quant_bit == 4:
        cache = cache.view(torch.uint8)  # packed INT4 may come as an int8 tensor
    k_rows, v_rows = ppl_cache_views(cache, layer_idx, cache_layout)
    k_scales, v_scales = ppl_cache_views(scale, layer_idx, cache_layout) if quant_bit else (None, None)
    fmt = kv_format(cache.dtype)
    acc = _acc_dtype(compute_dtype)
    kvs, pos = kvstarts.tolist(), start_pos.tolist()
    q_rows = _ranges(seqstarts.tolist(), query.shape[0])
    slopes = alibi_slopes(num_heads).to(query.device) if is_alibi else None
    out = torch.zeros(query.shape, dtype=acc, device=query.device)
    max_t = k_rows.shape[0]

    def rows_of(b: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache rows of positions of sequence `b` (0 where there is none) and which are inside
        the cache (page-table mode: in a page of `cachestarts` whose rows all are)."""
        if cache_mode == 0:
            rows = cachestarts[b].long() + positions
            inside = (rows >= 0) & (rows < max_t)
        else:
            page = positions // page_size
            inside = (positions >= 0) & (page < cachestarts.shape[1])
            starts = cachestarts[b, torch.where(inside, page, 0)].long()
            inside &= (starts >= 0) & (starts + page_size <= max_t)
            rows = starts + positions % page_size
        return torch.where(inside, rows, 0), inside

    for b in range(len(pos)):
        (q0, q1), kvlen = q_rows[b], min(max(kvs[b + 1] - kvs[b], 0), bucket(max_kvlen))
        if cache_mode == 0:   # keys past the cache's last row are cut off; none before its first
            start = int(cachestarts[b])
            kvlen = 0 if start < 0 else min(kvlen, max(max_t - start, 0))
        new, written = rows_of(b, torch.arange(pos[b], pos[b] + q1 - q0, device=query.device))
        _store(k_rows, k_scales, new[written], current_key[q0:q1][written])
        _store(v_rows, v_scales, new[written], current_value[q0:q1][written])
        if q1 == q0:
            continue
        past, present = rows_of(b, torch.arange(kvlen, device=query.device))
        k = quant.dequantize(k_rows[past], None if k_scales is None else k_scales[past], fmt, acc)
        v = quant.dequantize(v_rows[past], None if v_scales is None else v_scales[past], fmt, acc)
        bias = None
        if attn_mask is not None:
            m = attn_mask if attn_mask.dim() == 3 else attn_mask.unsqueeze(0)
            bias = m[:, q0:q1, kvs[b]:kvs[b] + kvlen]
        positions = torch.arange(kvlen - (q1 - q0), kvlen, device=query.device)
        o, _ = attend(query[q0:q1], k, v, positions, causal=is_causal, alibi_slopes=slopes, bias=bias,
                      key_mask=present.expand(q1 - q0, kvlen), compute_dtype=compute_dtype)
        out[q0:q1] = o
    return finish_output(out, query.dtype, None)
