"""Input validation for every op: shapes, dtypes, devices, head counts, layouts, scale shapes.

Metadata-only checks, and those of the Python-number options (`scale`, `q_scaling`, `softcap`),
run in both the fake and the real implementation, so bad input fails at trace time too. Checks
that read tensor data run only with `ATTN_DEBUG=1` (`check_data`): the fast path never
synchronizes with the device. Errors name the argument and the expectation.
"""

from __future__ import annotations

import math
import os

import torch

from .quant import FLOAT_DTYPES, KVFormat, kv_format

QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
SCALE_DTYPES = (torch.float16, torch.float32)
MAX_QUERIES_PER_DECODE_SEQ = 8
MAX_BLOCK_SIZE = 256  # paged_prefill, kv_cache_write; paged_decode takes any block size


def debug_checks_enabled() -> bool:
    return os.environ.get("ATTN_DEBUG", "0") not in ("", "0")


def _names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_dtype(t: torch.Tensor, name: str, allowed) -> None:
    if not t.dtype in allowed:
        raise TypeError(f"{name} must have dtype in ({_names(allowed)}), got {str(t.dtype).replace('torch.', '')}")


def check_tensor(
    t, name: str, ndim: int, desc: str, device: torch.device, dtypes=None
) -> None:
    """`t` is a tensor of rank `ndim` (described as `desc`, e.g. "[T, Hq, D]") on `device`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor {desc}")
    if not t.dim() == ndim:
        raise ValueError(f"{name} must be {ndim}-D {desc}, got shape {tuple(t.shape)}")
    if not t.device == device:
        raise ValueError(f"{name} must be on {device} (like query), got {t.device}")
    if dtypes is not None:
        check_dtype(t, name, dtypes)


def check_key_value(k, v, names: tuple[str, str], ndim: int, desc: str, device, dtypes=None,
                    same_last_dim: bool = True) -> None:
    """`k` and `v` (called `names`) are tensors `desc` on `device` with a contiguous last dim, of
    one shape (but for the last dim unless `same_last_dim`) and one dtype."""
    for name, t in zip(names, (k, v)):
        check_tensor(t, name, ndim, desc, device, dtypes)
        if not t.stride(-1) == 1:
            raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")
    if same_last_dim:
        if not v.shape == k.shape:
            raise ValueError(f"{names[1]} shape {tuple(v.shape)} must equal {names[0]} shape {tuple(k.shape)}")
    elif not (v.shape[:-1] == k.shape[:-1] and v.shape[-1] > 0):
        raise ValueError(f"{names[1]} shape {tuple(v.shape)} must equal {names[0]} shape {tuple(k.shape)} "
                         "but for a last dim > 0")
    if not v.dtype == k.dtype:
        raise TypeError(f"{names[1]} dtype {v.dtype} must equal {names[0]} dtype {k.dtype}")


def check_vector(t, name: str, length, device, dtypes, desc: str) -> None:
    check_tensor(t, name, 1, desc, device, dtypes)
    if not t.shape[0] == length:
        raise ValueError(f"{name} must have shape {desc} = ({length},), got {tuple(t.shape)}")
    check_unit_stride(t, name)


def check_unit_stride(t: torch.Tensor, name: str) -> None:
    """A 1-D index or parameter vector is read as consecutive elements by the kernels."""
    if t.shape[0] > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous (stride 1), got stride {t.stride(0)}; pass .contiguous()")


def check_options(
    query: torch.Tensor, *, scale, q_scaling, alibi_slopes, window_left, sink_tokens, sinks,
    softcap, out_scale,
) -> None:
    """The options shared by the attention ops (see docs/ops.md, "Common keyword options")."""
    hq, dev = query.shape[1], query.device
    if not (scale is None or 0 < scale < math.inf):
        raise ValueError(f"scale must be finite and > 0, or None, got {scale}")
    if not 0 < q_scaling < math.inf:
        raise ValueError(f"q_scaling must be finite and > 0, got {q_scaling}")
    if not window_left >= -1:
        raise ValueError(f"window_left must be -1 (no window) or >= 0, got {window_left}")
    if not sink_tokens >= 0:
        raise ValueError(f"sink_tokens must be >= 0, got {sink_tokens}")
    if not 0 <= softcap < math.inf:
        raise ValueError(f"softcap must be finite and >= 0 (0 disables it), got {softcap}")
    if alibi_slopes is not None:
        check_vector(alibi_slopes, "alibi_slopes", hq, dev, (torch.float32,), "[Hq]")
    if sinks is not None:
        check_vector(sinks, "sinks", hq, dev, (torch.float32,), "[Hq]")
    if out_scale is not None:
        if not isinstance(out_scale, torch.Tensor):
            raise TypeError("out_scale must be a 0-d float32 tensor")
        check_dtype(out_scale, "out_scale", (torch.float32,))
        if not (out_scale.numel() == 1 and out_scale.dim() <= 1):
            raise ValueError(f"out_scale must be a 0-d float32 tensor, got shape {tuple(out_scale.shape)}")
        if not out_scale.device == dev:
            raise ValueError(f"out_scale must be on {dev} (like query), got {out_scale.device}")


def check_per_head_scale(t, name: str, num_heads: int, device) -> None:
    """A dequantization scale: 0-d or `[num_heads]` float32."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a float32 tensor, 0-d or [{num_heads}]")
    check_dtype(t, name, (torch.float32,))
    if not t.device == device:
        raise ValueError(f"{name} must be on {device} (like query), got {t.device}")
    if not (t.dim() == 0 or (t.dim() == 1 and t.shape[0] == num_heads)):
        raise ValueError(f"{name} must be 0-d or [{num_heads}] (per head), got shape {tuple(t.shape)}")


def check_paged_cache(
    query: torch.Tensor, k_cache, v_cache, k_scale, v_scale, *, mutable_scales: bool = False,
    head_dim: int | None = None, max_block_size: int | None = MAX_BLOCK_SIZE, separate_value_dim: bool = False,
) -> KVFormat:
    """`k_cache [num_blocks, block_size, Hkv, D]`, `v_cache [num_blocks, block_size, Hkv, D]` (D/2
    bytes for INT4) and their scales; with `separate_value_dim`, a plain or FP8 `v_cache` may have
    its own head dim `D_v` (`[num_blocks, block_size, Hkv, D_v]`).

    Returns the cache format. `head_dim` defaults to the query's last dim; `max_block_size` None
    lifts the block size limit (paged_decode: one page per sequence, e.g. a static cache).
    """
    dev = query.device
    d = query.shape[-1] if head_dim is None else head_dim
    check_key_value(k_cache, v_cache, ("k_cache", "v_cache"), 4, "[num_blocks, block_size, Hkv, D]", dev,
                    same_last_dim=not separate_value_dim)
    fmt = kv_format(k_cache.dtype)
    if not (v_cache.shape[-1] == k_cache.shape[-1] or fmt in (KVFormat.PLAIN, KVFormat.FP8)):
        raise ValueError(f"v_cache head dim ({v_cache.shape[-1]}) must equal k_cache head dim "
                         f"({k_cache.shape[-1]}) in {fmt.value.upper()} caches (a separate value head dim "
                         "needs a plain or FP8 cache)")
    num_blocks, block_size, hkv, dc = k_cache.shape
    if not (block_size >= 1 and (max_block_size is None or block_size <= max_block_size)):
        expected = ">= 1" if max_block_size is None else f"in 1..{max_block_size}"
        raise ValueError(f"k_cache block_size (dim 1) must be {expected}, got {block_size}")
    expected_dc = d // 2 if fmt is KVFormat.INT4 else d
    if not dc == expected_dc:
        raise ValueError(f"k_cache last dim must be {expected_dc} for head dim {d} "
            f"({'packed INT4' if fmt is KVFormat.INT4 else fmt.value}), got {dc}")
    if fmt is KVFormat.PLAIN:
        if not k_cache.dtype == query.dtype:
            raise TypeError(f"k_cache dtype {k_cache.dtype} must equal query dtype {query.dtype} (or be FP8/INT8/INT4)")
        if not (k_scale is None and v_scale is None):
            raise ValueError(f"k_scale/v_scale are only for FP8/INT8/INT4 caches, not {k_cache.dtype}")
        return fmt
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not s is not None:
            raise ValueError(f"{name} is required for a {fmt.value} KV cache")
        if fmt is KVFormat.FP8:
            check_per_head_scale(s, name, hkv, dev)
            continue
        check_tensor(s, name, 4, "[num_blocks, block_size, Hkv, D // quant_group]", dev, SCALE_DTYPES)
        groups = s.shape[-1]
        if not (tuple(s.shape[:3]) == (num_blocks, block_size, hkv) and groups > 0 and d % groups == 0):
            raise ValueError(f"{name} must have shape [num_blocks, block_size, Hkv, D // quant_group] = "
                f"[{num_blocks}, {block_size}, {hkv}, G] with G dividing {d}, got {tuple(s.shape)}")
        if not (fmt is not KVFormat.INT4 or (d // groups) % 2 == 0):
            raise ValueError(f"{name}: INT4 quant_group must be even, got {d // groups}")
    if not v_scale.shape == k_scale.shape:
        raise ValueError(f"v_scale shape {tuple(v_scale.shape)} must equal k_scale shape {tuple(k_scale.shape)}")
    return fmt


def _check_heads(query: torch.Tensor, hkv: int, kv_name: str) -> None:
    hq = query.shape[1]
    if not (hkv > 0 and hq % hkv == 0):
        raise ValueError(f"query heads ({hq}) must be a multiple of the KV heads of {kv_name} ({hkv})")


def _check_query(query) -> None:
    if not isinstance(query, torch.Tensor):
        raise TypeError("query must be a tensor [T, Hq, D]")
    check_tensor(query, "query", 3, "[T, Hq, D]", query.device, QUERY_DTYPES)
    if not (query.shape[-1] > 0 and query.shape[1] > 0):
        raise ValueError(f"query must have Hq, D > 0, got {tuple(query.shape)}")


def _check_block_tables(block_tables, seq_lens, dev) -> None:
    check_tensor(seq_lens, "seq_lens", 1, "[B]", dev, INDEX_DTYPES)
    check_unit_stride(seq_lens, "seq_lens")
    check_tensor(block_tables, "block_tables", 2, "[B, max_blocks_per_seq]", dev, INDEX_DTYPES)
    if not block_tables.shape[0] == seq_lens.shape[0]:
        raise ValueError(f"block_tables must have one row per sequence (B = {seq_lens.shape[0]}), "
            f"got shape {tuple(block_tables.shape)}")


def check_key_mask(key_mask, query) -> None:
    """`key_mask`: None, or bool `[T, N]` on the query's device with unit stride along N."""
    if key_mask is None:
        return
    check_tensor(key_mask, "key_mask", 2, "[T, N] bool", query.device, (torch.bool,))
    if not (key_mask.shape[0] == query.shape[0] and key_mask.stride(-1) == 1):
        raise ValueError(f"key_mask must be [T, N] = [{query.shape[0]}, N] with unit stride along N, "
                         f"got shape {tuple(key_mask.shape)} and strides {key_mask.stride()}")


def check_paged_decode(query, k_cache, v_cache, block_tables, seq_lens, *, k_scale, v_scale, key_mask=None,
                       **options):
    _check_query(query)
    dev = query.device
    check_key_mask(key_mask, query)
    check_dtype(query, "query", (torch.float16, torch.bfloat16))
    _check_block_tables(block_tables, seq_lens, dev)
    fmt = check_paged_cache(query, k_cache, v_cache, k_scale, v_scale, max_block_size=None, separate_value_dim=True)
    _check_heads(query, k_cache.shape[2], "k_cache")
    b, t = seq_lens.shape[0], query.shape[0]
    if b == 0:
        if not t == 0:
            raise ValueError(f"query has {t} tokens but seq_lens is empty")
    else:
        if not (t % b == 0 and 1 <= t // b <= MAX_QUERIES_PER_DECODE_SEQ):
            raise ValueError(f"query tokens ({t}) must be B * q_per_seq with B = {b} sequences and q_per_seq in "
                f"1..{MAX_QUERIES_PER_DECODE_SEQ}")
    check_options(query, **options)
    return fmt


def check_paged_prefill(query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, *, causal,
                        k_scale, v_scale, key_mask=None, **options):
    _check_query(query)
    dev = query.device
    check_key_mask(key_mask, query)
    _check_block_tables(block_tables, seq_lens, dev)
    check_vector(cu_seqlens_q, "cu_seqlens_q", seq_lens.shape[0] + 1, dev, INDEX_DTYPES, "[B + 1]")
    fmt = check_paged_cache(query, k_cache, v_cache, k_scale, v_scale, separate_value_dim=True)
    _check_heads(query, k_cache.shape[2], "k_cache")
    check_options(query, **options)
    return fmt


def paged_value_dim(query, k_cache, v_cache) -> int:
    """The value head dim `D_v` of a checked paged call: the query's head dim when `v_cache`
    stores as many elements per token as `k_cache` (packed INT4 included), else `v_cache`'s."""
    return query.shape[-1] if v_cache.shape[-1] == k_cache.shape[-1] else v_cache.shape[-1]


def check_rope(positions, cos_sin_cache, tokens: int, head_dim: int, device) -> None:
    """RoPE arguments: both or neither of `positions [tokens]` int and
    `cos_sin_cache [max_position, rotary_dim]` float, `rotary_dim` even and at most `head_dim`."""
    if (positions is None) != (cos_sin_cache is None):
        raise ValueError("RoPE needs both positions and cos_sin_cache (or neither)")
    if positions is None:
        return
    check_vector(positions, "positions", tokens, device, INDEX_DTYPES, "[T]")
    check_tensor(cos_sin_cache, "cos_sin_cache", 2, "[max_position, rotary_dim]", device, QUERY_DTYPES)
    rot = cos_sin_cache.shape[1]
    if not (rot % 2 == 0 and 0 < rot <= head_dim):
        raise ValueError(f"cos_sin_cache rotary_dim (dim 1) must be even and in 2..{head_dim}, got {rot}")


def check_context_attention(query, key, value, cu_seqlens_q, cu_seqlens_k, *, causal, q_scale,
                            k_scale, v_scale, out_dtype, positions, cos_sin_cache, rope_neox, key_mask=None,
                            **options):
    if not isinstance(query, torch.Tensor):
        raise TypeError("query must be a tensor [Tq, Hq, D]")
    dev = query.device
    check_key_mask(key_mask, query)
    inputs = (("query", query, "[Tq, Hq, D]"), ("key", key, "[Tk, Hkv, D]"), ("value", value, "[Tk, Hkv, D_v]"))
    for name, t, desc in inputs:
        check_tensor(t, name, 3, desc, dev, QUERY_DTYPES + (torch.float8_e4m3fn,))
        if not t.stride(-1) == 1:
            raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")
    if not (key.dtype == query.dtype and value.dtype == query.dtype):
        raise TypeError(f"query, key and value must share one dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    if not (value.shape[:2] == key.shape[:2] and value.shape[2] > 0):
        raise ValueError(f"value must be [Tk, Hkv, D_v] = [{key.shape[0]}, {key.shape[1]}, D_v > 0] (like key), "
                         f"got {tuple(value.shape)}")
    if not key.shape[2] == query.shape[2]:
        raise ValueError(f"key head dim ({key.shape[2]}) must equal query head dim ({query.shape[2]})")
    _check_heads(query, key.shape[1], "key")
    check_tensor(cu_seqlens_q, "cu_seqlens_q", 1, "[B + 1]", dev, INDEX_DTYPES)
    check_unit_stride(cu_seqlens_q, "cu_seqlens_q")
    b1 = cu_seqlens_q.shape[0]
    if not b1 >= 1:
        raise ValueError("cu_seqlens_q must have B + 1 >= 1 entries")
    check_vector(cu_seqlens_k, "cu_seqlens_k", b1, dev, INDEX_DTYPES, "[B + 1]")
    fp8 = query.dtype == torch.float8_e4m3fn
    scales = (("q_scale", q_scale, query.shape[1]), ("k_scale", k_scale, key.shape[1]),
              ("v_scale", v_scale, key.shape[1]))
    for name, s, heads in scales:
        if fp8:
            if not s is not None:
                raise ValueError(f"{name} is required for float8_e4m3fn inputs")
            check_per_head_scale(s, name, heads, dev)
        else:
            if not s is None:
                raise ValueError(f"{name} is only for float8_e4m3fn inputs, not {query.dtype}")
    if out_dtype is not None:
        if not out_dtype in FLOAT_DTYPES:
            raise TypeError(f"out_dtype must be one of ({_names(FLOAT_DTYPES)}), got {out_dtype}")
        if not options.get("out_scale") is None:
            raise ValueError("give out_dtype or out_scale (FP8 output), not both")
    if positions is not None:
        if fp8:
            raise ValueError("RoPE (positions) is for fp16/bf16/fp32 inputs, not float8_e4m3fn")
        if not query.shape[0] == key.shape[0]:
            raise ValueError(f"RoPE (positions) is for self-attention: query and key need one token count, got "
                f"{query.shape[0]} and {key.shape[0]}")
    check_rope(positions, cos_sin_cache, key.shape[0], query.shape[2], dev)
    check_options(query, **options)


def check_kv_cache_write(key, value, k_cache, v_cache, slot_mapping, *, k_scale, v_scale, query,
                         positions, cos_sin_cache, rope_neox):
    if not isinstance(key, torch.Tensor):
        raise TypeError("key must be a tensor [T, Hkv, D]")
    dev = key.device
    check_key_value(key, value, ("key", "value"), 3, "[T, Hkv, D]", dev, QUERY_DTYPES, same_last_dim=False)
    t, hkv, d = key.shape
    fmt = check_paged_cache(key, k_cache, v_cache, k_scale, v_scale, separate_value_dim=True)
    if not k_cache.shape[2] == hkv:
        raise ValueError(f"k_cache has {k_cache.shape[2]} KV heads, key has {hkv}")
    dv = value.shape[-1]
    if not v_cache.shape[-1] == (k_cache.shape[-1] if dv == d else dv):
        raise ValueError(f"v_cache last dim must be {k_cache.shape[-1] if dv == d else dv} for value head dim {dv} "
                         f"(key head dim {d}), got {v_cache.shape[-1]}")
    check_vector(slot_mapping, "slot_mapping", t, dev, INDEX_DTYPES, "[T]")
    check_rope(positions, cos_sin_cache, t, d, dev)
    if query is not None:
        check_tensor(query, "query", 3, "[T, Hq, D]", dev, QUERY_DTYPES)
        if not (query.shape[0] == t and query.shape[2] == d):
            raise ValueError(f"query must be [T, Hq, D] = [{t}, Hq, {d}], got {tuple(query.shape)}")
        if not positions is not None:
            raise ValueError("query is only rotated by RoPE: pass positions and cos_sin_cache too")
    return fmt


def check_merge_states(out_a, lse_a, out_b, lse_b):
    if not isinstance(out_a, torch.Tensor):
        raise TypeError("out_a must be a tensor [T, H, D]")
    dev = out_a.device
    for name, o in (("out_a", out_a), ("out_b", out_b)):
        check_tensor(o, name, 3, "[T, H, D]", dev, QUERY_DTYPES)
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        check_tensor(lse, name, 2, "[T, H]", dev, (torch.float32,))
        if not tuple(lse.shape) == tuple(out_a.shape[:2]):
            raise ValueError(f"{name} must have shape [T, H] = {tuple(out_a.shape[:2])}, got {tuple(lse.shape)}")
    if not (out_b.shape == out_a.shape and out_b.dtype == out_a.dtype):
        raise ValueError(f"out_b ({tuple(out_b.shape)}, {out_b.dtype}) must match out_a ({tuple(out_a.shape)}, {out_a.dtype})")


CACHE_LAYOUT_SHAPES = {
    0: "(MaxT, L, 2, Hkv, Dh)", 1: "(L, MaxT, 2, Hkv, Dh)", 2: "(L, 2, MaxT, Hkv, Dh)", 3: "(L, 2, Hkv, MaxT, Dh)",
}


def cache_layout_dims(cache_layout: int) -> tuple[int, int, int, int, int]:
    """Positions of (MaxT, L, 2, H, Dh) in a PPL cache of `cache_layout`."""
    return {0: (0, 1, 2, 3, 4), 1: (1, 0, 2, 3, 4), 2: (2, 0, 1, 3, 4), 3: (3, 0, 1, 2, 4)}[cache_layout]


def ppl_cache_views(cache: torch.Tensor, layer_idx: int, cache_layout: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views `(k, v)` of shape `[MaxT, Hkv, last]` of one layer of a PPL cache (or scale) tensor."""
    rows = cache.permute(*cache_layout_dims(cache_layout))[:, layer_idx]   # [MaxT, 2, Hkv, last]
    return rows[:, 0], rows[:, 1]


def check_cache_attention(query, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
                          decoding_batches, max_seqlen, max_kvlen, cache, scale, attn_mask, *, num_heads,
                          head_dim, is_causal, is_alibi, num_kv_heads, num_layer, layer_idx, quant_bit,
                          quant_group, cache_mode, cache_layout, page_size):
    _check_query(query)
    dev = query.device
    hkv = num_kv_heads or num_heads
    t = query.shape[0]
    if not tuple(query.shape[1:]) == (num_heads, head_dim):
        raise ValueError(f"query must be [seqstarts[B], num_heads, head_dim] = [T, {num_heads}, {head_dim}], got {tuple(query.shape)}")
    if not num_heads % hkv == 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({hkv})")
    for name, x in (("current_key", current_key), ("current_value", current_value)):
        check_tensor(x, name, 3, "[seqstarts[B], num_kv_heads, head_dim]", dev)
        if not tuple(x.shape) == (t, hkv, head_dim):
            raise ValueError(f"{name} must be [{t}, {hkv}, {head_dim}], got {tuple(x.shape)}")
        if not x.dtype == query.dtype:
            raise TypeError(f"{name} dtype {x.dtype} must equal query dtype {query.dtype}")
    check_tensor(seqstarts, "seqstarts", 1, "[B + 1]", dev, INDEX_DTYPES)
    b = seqstarts.shape[0] - 1
    if not b >= 0:
        raise ValueError("seqstarts must have B + 1 >= 1 entries")
    check_vector(kvstarts, "kvstarts", b + 1, dev, INDEX_DTYPES, "[B + 1]")
    check_vector(start_pos, "start_pos", b, dev, INDEX_DTYPES, "[B]")
    if not (isinstance(decoding_batches, torch.Tensor) and decoding_batches.numel() == 1
            and decoding_batches.dtype in INDEX_DTYPES):
        raise TypeError("decoding_batches must be a one-element int32/int64 tensor")
    if not (max_seqlen >= 0 and max_kvlen >= 0):
        raise ValueError(f"max_seqlen/max_kvlen must be >= 0, got {max_seqlen}, {max_kvlen}")
    if not cache_mode in (0, 1):
        raise ValueError(f"cache_mode must be 0 (offset) or 1 (page table), got {cache_mode}")
    if cache_mode == 0:
        check_vector(cachestarts, "cachestarts", b, dev, INDEX_DTYPES, "[B] (offset mode)")
    else:
        check_tensor(cachestarts, "cachestarts", 2, "[B, MaxP] (page-table mode)", dev, INDEX_DTYPES)
        if not cachestarts.shape[0] == b:
            raise ValueError(f"cachestarts must be [B, MaxP] with B = {b}, got {tuple(cachestarts.shape)}")
        if not page_size > 0:
            raise ValueError(f"page_size must be > 0, got {page_size}")
    if not cache_layout in CACHE_LAYOUT_SHAPES:
        raise ValueError(f"cache_layout must be one of {sorted(CACHE_LAYOUT_SHAPES)}, got {cache_layout}")
    if not (num_layer > 0 and 0 <= layer_idx < num_layer):
        raise ValueError(f"layer_idx must be in 0..num_layer-1 = 0..{num_layer - 1}, got {layer_idx}")
    if not quant_bit in (0, 4, 8):
        raise ValueError(f"quant_bit must be 0, 4 or 8, got {quant_bit}")
    if quant_bit:
        if not (quant_group > 0 and head_dim % quant_group == 0):
            raise ValueError(f"quant_group ({quant_group}) must divide head_dim ({head_dim})")
        if not (quant_bit == 8 or quant_group % 2 == 0):
            raise ValueError(f"INT4 needs an even quant_group, got {quant_group}")
    check_tensor(cache, "cache", 5, CACHE_LAYOUT_SHAPES[cache_layout], dev)
    dims = cache_layout_dims(cache_layout)
    stored_dh = head_dim // 2 if quant_bit == 4 else head_dim
    want = {dims[1]: num_layer, dims[2]: 2, dims[3]: hkv, dims[4]: stored_dh}
    if not all(cache.shape[i] == n for i, n in want.items()):
        raise ValueError(f"cache must be {CACHE_LAYOUT_SHAPES[cache_layout]} with L = {num_layer}, Hkv = {hkv}, "
            f"Dh = {stored_dh}{' (packed INT4)' if quant_bit == 4 else ''}, got {tuple(cache.shape)}")
    if quant_bit == 0:
        if not cache.dtype == query.dtype:
            raise TypeError(f"cache dtype {cache.dtype} must equal query dtype {query.dtype} "
                "when quant_bit is 0")
        if not scale is None:
            raise ValueError("scale is only for quantized caches (quant_bit 4 or 8)")
    else:
        allowed = (torch.int8,) if quant_bit == 8 else (torch.int8, torch.uint8)
        check_dtype(cache, "cache", allowed)
        if not scale is not None:
            raise ValueError(f"scale is required when quant_bit is {quant_bit}")
        check_tensor(scale, "scale", 5, CACHE_LAYOUT_SHAPES[cache_layout], dev, SCALE_DTYPES)
        scale_shape = list(cache.shape)
        scale_shape[dims[4]] = head_dim // quant_group
        if not list(scale.shape) == scale_shape:
            raise ValueError(f"scale must have the cache's layout with Dh / quant_group = {head_dim // quant_group} last, "
                f"i.e. {tuple(scale_shape)}, got {tuple(scale.shape)}")
    if attn_mask is not None:
        if not attn_mask.dim() in (2, 3):
            raise ValueError(f"attn_mask must be 2-D or 3-D, got shape {tuple(attn_mask.shape)}")
        if not attn_mask.device == dev:
            raise ValueError(f"attn_mask must be on {dev} (like query), got {attn_mask.device}")
        check_dtype(attn_mask, "attn_mask", QUERY_DTYPES)
        if not (attn_mask.shape[-2] == t and (attn_mask.dim() == 2 or attn_mask.shape[0] == num_heads)):
            raise ValueError(f"attn_mask must be (num_heads, seqstarts[B], >= kvstarts[B]) or (seqstarts[B], >= kvstarts[B]) "
                f"with seqstarts[B] = {t}, num_heads = {num_heads}, got {tuple(attn_mask.shape)}")


def check_out_buffers(out, lse, out_shape, out_dtype, lse_shape, device) -> None:
    """Caller-provided buffers of the `.out` overloads."""
    check_tensor(out, "out", len(out_shape), str(list(out_shape)), device)
    if not tuple(out.shape) == tuple(out_shape):
        raise ValueError(f"out must have shape {tuple(out_shape)}, got {tuple(out.shape)}")
    if not out.dtype == out_dtype:
        raise TypeError(f"out must have dtype {out_dtype}, got {out.dtype}")
    check_tensor(lse, "lse", len(lse_shape), str(list(lse_shape)), device, (torch.float32,))
    if not tuple(lse.shape) == tuple(lse_shape):
        raise ValueError(f"lse must have shape {tuple(lse_shape)}, got {tuple(lse.shape)}")


def _check_cu_seqlens(cu: torch.Tensor, name: str, total: int) -> torch.Tensor:
    cu = cu.cpu().long()
    lens = cu[1:] - cu[:-1]
    if not (int(cu[0]) == 0 and bool((lens >= 0).all()) and int(cu[-1]) == total):
        raise ValueError(f"{name} must start at 0, never decrease and end at {total}, got {cu.tolist()}")
    return lens


def check_paged_data(k_cache, block_tables, seq_lens, q_lens: torch.Tensor | None = None) -> None:
    """Block ids within the cache, lengths within the block table and above the query lengths."""
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    capacity = block_tables.shape[1] * block_size
    lens = seq_lens.cpu().long()
    if not (bool((lens >= 0).all()) and bool((lens <= capacity).all())):
        raise ValueError(f"seq_lens must be in 0..max_blocks_per_seq * block_size = 0..{capacity}, got {lens.tolist()}")
    if q_lens is not None:
        if not bool(((q_lens <= lens) | (lens == 0)).all()):
            raise ValueError(f"query lengths {q_lens.tolist()} must not exceed seq_lens {lens.tolist()} (0 marks padding)")
    used = (torch.arange(block_tables.shape[1]) * block_size).unsqueeze(0) < lens.unsqueeze(1)
    ids = block_tables.cpu()[used]
    if not bool(((ids >= 0) & (ids < num_blocks)).all()):
        raise ValueError(f"block_tables entries used by seq_lens must be in 0..{num_blocks - 1}, got {ids.unique().tolist()}")


def check_data(op: str, args: tuple, kwargs: dict) -> None:
    """The data-dependent checks of `op` (ATTN_DEBUG=1 only: they synchronize with the device)."""
    if op == "paged_decode":
        seq_lens = args[4]
        new_tokens = args[0].shape[0] // max(1, seq_lens.shape[0])
        check_paged_data(args[1], args[3], seq_lens, torch.full(seq_lens.shape, new_tokens))
    elif op == "paged_prefill":
        q_lens = _check_cu_seqlens(args[4], "cu_seqlens_q", args[0].shape[0])
        check_paged_data(args[1], args[3], args[5], q_lens)
    elif op == "context_attention":
        q_lens = _check_cu_seqlens(args[3], "cu_seqlens_q", args[0].shape[0])
        k_lens = _check_cu_seqlens(args[4], "cu_seqlens_k", args[1].shape[0])
        if not (kwargs.get("positions") is None or torch.equal(q_lens, k_lens)):
            raise ValueError("RoPE (positions) is for self-attention: cu_seqlens_q must equal cu_seqlens_k")
    elif op == "kv_cache_write":
        capacity = args[2].shape[0] * args[2].shape[1]
        slots = args[4].cpu()
        if not bool((slots < capacity).all()):
            raise ValueError(f"slot_mapping entries must be < num_blocks * block_size = {capacity}")
        written = slots[slots >= 0]
        if written.unique().numel() != written.numel():
            raise ValueError("slot_mapping must not repeat a slot (which token's write would win is undefined)")
    elif op == "merge_states":
        for name, lse in (("lse_a", args[1]), ("lse_b", args[3])):
            if bool((lse.isnan() | (lse == math.inf)).any()):
                raise ValueError(f"{name} must be finite or -inf (an empty state), got NaN or +inf")
    elif op == "cache_attention":
        _check_cache_attention_data(*args, **kwargs)
    if kwargs.get("positions") is not None and kwargs.get("cos_sin_cache") is not None:
        positions, rows = kwargs["positions"].cpu(), kwargs["cos_sin_cache"].shape[0]
        if not bool(((positions >= 0) & (positions < rows)).all()):
            raise ValueError(f"positions must be in 0..{rows - 1} (the rows of cos_sin_cache)")
    if kwargs.get("out_scale") is not None and not 0 < float(kwargs["out_scale"]) < math.inf:
        raise ValueError(f"out_scale must be finite and > 0, got {float(kwargs['out_scale'])}")
    for name in ("sinks", "alibi_slopes", "q_scale", "k_scale", "v_scale"):
        t = kwargs.get(name)
        if t is not None and t.dim() <= 1 and not bool(t.isfinite().all()):   # not an INT8/INT4 scale cache
            raise ValueError(f"{name} must be finite, got {t.tolist()}")


def _check_cache_attention_data(query, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
                                decoding_batches, max_seqlen, max_kvlen, cache, scale, attn_mask, *,
                                cache_mode, cache_layout, page_size, **_):
    seqlens = _check_cu_seqlens(seqstarts, "seqstarts", query.shape[0])
    kvlens = _check_cu_seqlens(kvstarts, "kvstarts", int(kvstarts.cpu()[-1]))
    pos = start_pos.cpu().long()
    if not bool((pos >= 0).all()):
        raise ValueError(f"start_pos must be >= 0, got {pos.tolist()}")
    if not torch.equal(kvlens, pos + seqlens):
        raise ValueError(f"kvstarts must hold start_pos + seqlen keys per sequence: kv lengths {kvlens.tolist()}, "
            f"start_pos {pos.tolist()}, seqlens {seqlens.tolist()}")
    longest_q, longest_kv = max(seqlens.tolist(), default=0), max(kvlens.tolist(), default=0)
    if not (longest_q <= max_seqlen and longest_kv <= max_kvlen):
        raise ValueError(f"max_seqlen/max_kvlen ({max_seqlen}/{max_kvlen}) must bound the lengths ({longest_q}/{longest_kv})")
    decodes = int(decoding_batches.reshape(-1)[0])
    if not (0 <= decodes <= len(seqlens) and bool((seqlens[:decodes] <= 1).all())):
        raise ValueError(f"decoding_batches ({decodes}) must count the first sequences, each with at most one new token "
            f"(seqlens {seqlens.tolist()})")
    max_t = cache.shape[cache_layout_dims(cache_layout)[0]]
    starts = cachestarts.cpu().long()
    if cache_mode == 0:
        first_row, last_row = starts[kvlens > 0], (starts + kvlens - 1)[kvlens > 0]
    else:
        if not bool((kvlens <= starts.shape[1] * page_size).all()):
            raise ValueError(f"kv lengths {kvlens.tolist()} exceed MaxP * page_size = {starts.shape[1] * page_size}")
        used = torch.arange(starts.shape[1]) * page_size < kvlens.unsqueeze(1)
        first_row, last_row = starts[used], starts[used] + page_size - 1
    if not (bool((first_row >= 0).all()) and bool((last_row < max_t).all())):
        raise ValueError(f"cachestarts must address rows within MaxT = {max_t} (the pages the kv lengths use)")
    if attn_mask is not None:
        if not attn_mask.shape[-1] >= int(kvlens.sum()):
            raise ValueError(f"attn_mask last dim must be >= kvstarts[B] = {int(kvlens.sum())}, got {attn_mask.shape[-1]}")
