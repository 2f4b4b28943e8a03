"""`cache_attention` (PPL caches) against the naive float64 loops: the cache after the write of the
current keys and values, and the attention over it, by docs/ops.md."""

from __future__ import annotations

import math

import pytest
import torch

from torch_ops import quant, reference
from torch_ops.testing import assert_error_ratio

from .reference_helpers import (
    D, F64, GROUP, assert_bitwise_equal, assert_matches_fp64, cumsum, dequant_vector, index, naive_attention, rand,
    store_vector, token_scale,
)

LAYOUT_DIMS = {0: "T L KV H", 1: "L T KV H", 2: "L KV T H", 3: "L KV H T"}  # Dh last; docs' shapes
PAGE = 2


def standard_alibi_slopes(n: int) -> list[float]:
    """ALiBi slopes of Press et al.: the power-of-two geometric series, interleaved for others."""
    if math.log2(n).is_integer():
        return [2 ** (-8 * (i + 1) / n) for i in range(n)]
    m = 2 ** math.floor(math.log2(n))
    return standard_alibi_slopes(m) + standard_alibi_slopes(2 * m)[0::2][: n - m]


def ppl_index(layout: int, row: int, layer: int, kv: int, h: int) -> tuple[int, ...]:
    """Index of the `[Dh]` vector of cache row `row` in a cache of `layout`."""
    at = {"T": row, "L": layer, "KV": kv, "H": h}
    return tuple(at[n] for n in LAYOUT_DIMS[layout].split())


def ppl_cache(max_t, num_layer, hkv, layout, quant_bit, int4_dtype):
    """A random multi-layer PPL cache (and scale) in `layout`, quantized with torch_ops.quant; INT4
    is stored in a tensor of `int4_dtype` (int8 as in PPL, or uint8)."""
    x = torch.randn(max_t, num_layer, 2, hkv, D)
    perm = ["T", "L", "KV", "H", "Dh"]
    order = [perm.index(n) for n in LAYOUT_DIMS[layout].split() + ["Dh"]]
    if quant_bit == 0:
        return x.to(torch.float16).permute(order).contiguous(), None
    stored, scale = quant.quantize_groupwise(x, quant_bit, GROUP, torch.float16)
    stored = stored.view(int4_dtype) if quant_bit == 4 else stored
    return stored.permute(order).contiguous(), scale.permute(order).contiguous()


def ppl_cachestarts(cache_mode: int, kvlens):
    """Random `cachestarts`, the cache rows needed, and `row_of(b, p)` by the docs: mode 0 gives
    each sequence a region (in random order, one spare), mode 1 pages of `PAGE` rows (random
    pages, two spare, random ids past a sequence's pages)."""
    b_count = len(kvlens)
    if cache_mode == 0:
        region = max(kvlens) + 1
        starts = torch.randperm(b_count + 1, dtype=torch.int32)[:b_count] * region
        return starts, (b_count + 1) * region, lambda b, p: int(starts[b]) + p
    need = [-(-n // PAGE) for n in kvlens]
    num_pages = sum(need) + 2
    perm = torch.randperm(num_pages, dtype=torch.int32)
    pages = torch.randint(0, num_pages, (b_count, max(need)), dtype=torch.int32)
    for b, (start, n) in enumerate(zip(cumsum(need), need)):
        pages[b, :n] = perm[start:start + n]
    starts = pages * PAGE
    return starts, num_pages * PAGE, lambda b, p: int(starts[b, p // PAGE]) + p % PAGE


def run_cache_attention(*, hq=4, hkv=2, seqlens=(1, 3, 4), start_pos=(5, 2, 0), decoding_batches=1,
                        is_causal=True, is_alibi=False, mask=None, cache_mode=0, cache_layout=0, quant_bit=0,
                        int4_dtype=torch.int8):
    """cache_attention against the naive loops: after the call the cache (and scales) hold the
    current k/v written per the docs, and the output is attention over positions 0..kvlen-1."""
    b_count, num_layer, layer = len(seqlens), 2, 1
    kvlens = [s + p for s, p in zip(seqlens, start_pos)]
    t = sum(seqlens)
    q, cur_k, cur_v = rand(t, hq, D), rand(t, hkv, D), rand(t, hkv, D)
    cachestarts, max_t, row_of = ppl_cachestarts(cache_mode, kvlens)
    cache, scale = ppl_cache(max_t, num_layer, hkv, cache_layout, quant_bit, int4_dtype)
    kv_total = cumsum(kvlens)[-1]
    attn_mask = None
    if mask is not None:  # a padded last dim: 3 columns past kvstarts[B]
        attn_mask = rand(*((hq,) if mask == "3d" else ()), t, kv_total + 3) * 2

    # The cache after the write, by the docs.
    exp_cache = cache.clone()
    exp_scale = None if scale is None else scale.clone()
    codes = exp_cache.view(torch.uint8) if quant_bit == 4 else exp_cache
    seq0, kv0 = cumsum(seqlens), cumsum(kvlens)
    for b in range(b_count):
        for i in range(seqlens[b]):
            row = row_of(b, start_pos[b] + i)
            for kv, x in ((0, cur_k), (1, cur_v)):
                for h in range(hkv):
                    where = ppl_index(cache_layout, row, layer, kv, h)
                    store_vector(codes, exp_scale, where, x[seq0[b] + i, h].tolist())

    # Attention over rows 0..kvlen-1 of each sequence, as dequantized from that cache.
    def cached(b, j, kv, h):
        where = ppl_index(cache_layout, row_of(b, j), layer, kv, h)
        return dequant_vector(codes[where], token_scale(exp_scale, where, h))

    out_t = torch.zeros(t, hq, D, dtype=F64)
    for b in range(b_count):
        kvs = [torch.tensor([[cached(b, j, kv, h) for h in range(hkv)] for j in range(kvlens[b])],
                            dtype=F64).reshape(kvlens[b], hkv, D) for kv in (0, 1)]
        bias = None
        if attn_mask is not None:
            m = attn_mask if attn_mask.dim() == 3 else attn_mask.unsqueeze(0)
            bias = m[:, seq0[b]:seq0[b + 1], kv0[b]:kv0[b] + kvlens[b]]
        slopes = torch.tensor(standard_alibi_slopes(hq), dtype=torch.float32) if is_alibi else None
        out_t[seq0[b]:seq0[b + 1]], _ = naive_attention(
            q[seq0[b]:seq0[b + 1]], *kvs, causal=is_causal and b >= decoding_batches, alibi_slopes=slopes, bias=bias)

    args = (cur_k, cur_v, index(seqlens), index(kvlens), cachestarts, torch.tensor(start_pos, dtype=torch.int32),
            torch.tensor([decoding_batches], dtype=torch.int32), max(seqlens), max(kvlens))
    kwargs = dict(num_heads=hq, head_dim=D, is_causal=is_causal, is_alibi=is_alibi,
                  num_kv_heads=0 if hkv == hq else hkv, num_layer=num_layer, layer_idx=layer,
                  quant_bit=quant_bit, quant_group=GROUP, cache_mode=cache_mode, cache_layout=cache_layout,
                  page_size=PAGE)

    def call(fn, query, **extra):
        c, s = cache.clone(), None if scale is None else scale.clone()
        out = fn(query, *args, c, s, attn_mask, **kwargs, **extra)
        assert_bitwise_equal(c, exp_cache)
        if s is not None:
            assert_bitwise_equal(s, exp_scale)
        return out

    assert_matches_fp64(call(reference.cache_attention, q.double(), compute_dtype=F64), out_t)
    out = call(torch.ops.attn.cache_attention, q)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_error_ratio(out, out_t, call(reference.cache_attention, q, compute_dtype=q.dtype))


@pytest.mark.parametrize("quant_bit", [0, 8, 4])
@pytest.mark.parametrize("cache_layout", [0, 1, 2, 3])
@pytest.mark.parametrize("cache_mode", [0, 1], ids=["offset", "paged"])
def test_cache_attention(cache_mode, cache_layout, quant_bit):
    """Every cache mode, layout and quantization: GQA, one decode then two causal prefills."""
    run_cache_attention(cache_mode=cache_mode, cache_layout=cache_layout, quant_bit=quant_bit)


CACHE_ATTENTION_CASES = {
    "MHA": dict(hkv=4),
    "MQA": dict(hkv=1, quant_bit=8),
    "alibi-6-heads": dict(hq=6, hkv=3, is_alibi=True),
    "alibi-12-heads": dict(hq=12, hkv=4, is_alibi=True, cache_mode=1),
    "not-causal": dict(is_causal=False, quant_bit=4),
    "int4-in-uint8": dict(quant_bit=4, int4_dtype=torch.uint8, cache_layout=1),
    "two-decodes": dict(seqlens=(1, 1, 4), start_pos=(5, 3, 0), decoding_batches=2),
    "mask-2d": dict(mask="2d", cache_layout=2),
    "mask-3d": dict(mask="3d", quant_bit=8, cache_layout=3),
    "mask-alibi": dict(mask="3d", is_alibi=True, quant_bit=4, cache_mode=1),
}


@pytest.mark.parametrize("case", list(CACHE_ATTENTION_CASES))
def test_cache_attention_options(case):
    """MHA/MQA, standard ALiBi slopes (non-power-of-two head counts), non-causal, INT4 in a uint8
    cache, two decodes, and additive masks `(T, >= kvstarts[B])` and `(Hq, T, >= kvstarts[B])`
    indexed by packed key."""
    run_cache_attention(**CACHE_ATTENTION_CASES[case])
