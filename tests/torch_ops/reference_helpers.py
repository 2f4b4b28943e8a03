"""Naive float64 attention and KV-cache formats, written from docs/ops.md, for the tests of
`torch_ops/reference.py` and `torch.ops.attn`.

The expected values come from explicit Python loops over sequences, query tokens, heads and keys
with the softmax done by hand, and from this module's own dequantization and quantization of the
cache formats: nothing here is derived from reference.py.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from torch_ops import quant

D = 8  # head dim
GROUP = 4  # INT8/INT4 quant group
F64 = torch.float64
HEADS = pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)], ids=["MHA", "GQA", "MQA"])
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
PLAIN = (torch.float16, torch.bfloat16, torch.float32)
# Cache formats: name -> (storage dtype, scale): "tensor"/"head" FP8 scales, the scale-cache
# dtype for INT8/INT4 (uint8 storage is packed INT4), None for plain caches.
FORMATS = {
    "fp16": (torch.float16, None),
    "bf16": (torch.bfloat16, None),
    "fp32": (torch.float32, None),
    "e4m3": (torch.float8_e4m3fn, "tensor"),
    "e4m3-per-head": (torch.float8_e4m3fn, "head"),
    "e5m2": (torch.float8_e5m2, "tensor"),
    "e5m2-per-head": (torch.float8_e5m2, "head"),
    "int8": (torch.int8, torch.float32),
    "int8-fp16-scale": (torch.int8, torch.float16),
    "int4": (torch.uint8, torch.float32),
    "int4-fp16-scale": (torch.uint8, torch.float16),
}


# --- naive attention ----------------------------------------------------------------------------


def visible(j: int, p: int, causal: bool, window_left: int, sink_tokens: int) -> bool:
    """docs "Which keys a query sees", for key `j < Lk` and query position `p`."""
    if causal and j > p:
        return False
    return window_left < 0 or j >= p - window_left or j < sink_tokens


def naive_attention(q, k, v, *, causal=False, scale=None, q_scaling=1.0, alibi_slopes=None,
                    window_left=-1, sink_tokens=0, sinks=None, softcap=0.0, bias=None):
    """One sequence in float64 scalar loops: q `[Lq, Hq, D]`, k `[Lk, Hkv, D]`, v `[Lk, Hkv, D_v]`
    (dequantized), `bias [Hq or 1, Lq, Lk]` additive. Returns float64 `(out [Lq, Hq, D_v], lse [Lq, Hq])`."""
    lq, hq, d = q.shape
    lk, hkv, dv = v.shape
    qs, ks, vs = (x.double().tolist() for x in (q, k, v))
    slopes = None if alibi_slopes is None else alibi_slopes.tolist()
    sink = None if sinks is None else sinks.tolist()
    mask = None if bias is None else bias.double().tolist()
    scale_eff = (scale if scale is not None else 1 / math.sqrt(d)) / q_scaling
    out = [[[0.0] * dv for _ in range(hq)] for _ in range(lq)]
    lse = [[-math.inf] * hq for _ in range(lq)]
    for i in range(lq):
        p = lk - lq + i
        for h in range(hq):
            g = h // (hq // hkv)
            logits = []
            for j in range(lk):
                if not visible(j, p, causal, window_left, sink_tokens):
                    continue
                s = scale_eff * sum(a * b for a, b in zip(qs[i][h], ks[j][g]))
                if softcap > 0:
                    s = softcap * math.tanh(s / softcap)
                if slopes is not None:
                    s += -slopes[h] * abs(p - j)
                if mask is not None:
                    s += mask[h if len(mask) > 1 else 0][i][j]
                logits.append((j, s))
            terms = [s for _, s in logits] + ([sink[h]] if sink is not None else [])
            if not terms:
                continue
            m = max(terms)
            lse[i][h] = m + math.log(sum(math.exp(t - m) for t in terms))
            for j, s in logits:
                w = math.exp(s - lse[i][h])
                for e in range(dv):
                    out[i][h][e] += w * vs[j][g][e]
    return torch.tensor(out, dtype=F64).reshape(lq, hq, dv), torch.tensor(lse, dtype=F64).reshape(lq, hq)


def naive_varlen(q, cu_q, keys, values, dv=D, **opts):
    """Packed queries (boundaries `cu_q`, a list) over per-sequence keys/values of head dim `dv`:
    `(out, lse)`."""
    out = torch.zeros(*q.shape[:2], dv, dtype=F64)
    lse = torch.full(q.shape[:2], -math.inf, dtype=F64)
    for b, (k, v) in enumerate(zip(keys, values)):
        q0, q1 = cu_q[b], cu_q[b + 1]
        out[q0:q1], lse[q0:q1] = naive_attention(q[q0:q1], k, v, **opts)
    return out, lse


# --- cache formats, from the docs' table --------------------------------------------------------


def cumsum(lens) -> list[int]:
    return [0, *itertools.accumulate(lens)]


def index(lens) -> torch.Tensor:
    return torch.tensor(cumsum(lens), dtype=torch.int32)


def rand(*shape, dtype=torch.float16) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


def token_scale(scale, where, h):
    """The scale of one cached vector: None (plain), a float (FP8, 0-d or per head), or the group
    scales at `where` of an INT8/INT4 scale cache."""
    if scale is None:
        return None
    if scale.dim() <= 1:
        return float(scale) if scale.dim() == 0 else float(scale[h])
    return scale[where].double().tolist()


def dequant_vector(x: torch.Tensor, scale) -> list[float]:
    """One stored vector (`[D]`, or `[D/2]` bytes for INT4) -> D floats, by the docs' table."""
    if x.dtype in PLAIN:
        return x.double().tolist()
    if x.dtype in FP8_MAX:
        return [e * scale for e in x.double().tolist()]
    if x.dtype == torch.int8:
        values = x.tolist()
    else:  # packed INT4: element 2i in the low nibble, 2i+1 in the high one, offset 8
        values = [n for byte in x.tolist() for n in ((byte & 0xF) - 8, (byte >> 4) - 8)]
    group = len(values) // len(scale)
    return [val * scale[e // group] for e, val in enumerate(values)]


def quant_fp8_vector(x: list[float], scale: float, dtype) -> torch.Tensor:
    """docs: `clamp(x / scale)` cast to FP8 (fp32 division, as a kernel does)."""
    m = FP8_MAX[dtype]
    values = [min(max(float(np.float32(e) / np.float32(scale)), -m), m) for e in x]
    return torch.tensor(values, dtype=torch.float32).to(dtype)


def quant_group_vector(x: list[float], bits: int, scale_dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """docs: per group `s = max(absmax / qmax, 1e-5)` (stored in `scale_dtype`), `q = round(x * r)`
    with `r = 1 / s` in fp32 and the product exact, clamped to `[-qmax, qmax]`; INT4 packed as
    `q + 8` nibbles. Returns (int8 `[D]` or uint8 `[D/2]` codes, scales `[D / GROUP]`)."""
    qmax = 127 if bits == 8 else 7
    codes, scales = [], []
    for g0 in range(0, len(x), GROUP):
        xs = [np.float32(e) for e in x[g0:g0 + GROUP]]
        s = max(max(abs(e) for e in xs) / np.float32(qmax), np.float32(1e-5))
        s = torch.tensor(float(s)).to(scale_dtype)
        scales.append(s)
        r = np.float32(1) / np.float32(s.item())
        codes += [min(max(round(float(e) * float(r)), -qmax), qmax) for e in xs]   # fp64: exact
    if bits == 4:
        packed = [(lo + 8) | ((hi + 8) << 4) for lo, hi in zip(codes[0::2], codes[1::2])]
        return torch.tensor(packed, dtype=torch.uint8), torch.stack(scales)
    return torch.tensor(codes, dtype=torch.int8), torch.stack(scales)


def strided(x: torch.Tensor, hnd: bool) -> torch.Tensor:
    """`x [nb, bs, H, ...]`, or a copy stored HND (`[nb, H, bs, ...]`) seen as NHD."""
    return x.transpose(1, 2).contiguous().transpose(1, 2) if hnd else x


def make_cache(num_blocks, block_size, hkv, fmt, hnd=False, dv=D):
    """Random caches `k [num_blocks, block_size, Hkv, D]`, `v [num_blocks, block_size, Hkv, dv]` of
    format `fmt`, quantized with torch_ops.quant (FP8 scales calibrated to the absmax); returns
    `(k, v, k_scale, v_scale)`."""
    dtype, kind = FORMATS[fmt]
    made = []
    for dim in (D, dv):
        x = torch.randn(num_blocks, block_size, hkv, dim) * torch.empty(hkv, 1).uniform_(0.5, 2)
        scale = None
        if dtype in FP8_MAX:
            scale = (x.abs().amax(dim=(0, 1, 3)) if kind == "head" else x.abs().amax()) / FP8_MAX[dtype]
            stored = quant.quantize_fp8(x, scale, dtype)
        elif kind is not None:
            stored, scale = quant.quantize_groupwise(x, 8 if dtype == torch.int8 else 4, GROUP, kind)
            scale = strided(scale, hnd)
        else:
            stored = x.to(dtype)
        made += [strided(stored, hnd), scale]
    return made[0], made[2], made[1], made[3]


def store_vector(cache, scale, where, x: list[float]) -> None:
    """Write one `[D]` vector at `cache[where]` in the cache's format (naive quantization)."""
    if cache.dtype in PLAIN:
        cache[where] = torch.tensor(x, dtype=F64).to(cache.dtype)
    elif cache.dtype in FP8_MAX:
        cache[where] = quant_fp8_vector(x, token_scale(scale, None, where[-1]), cache.dtype)
    else:
        cache[where], scale[where] = quant_group_vector(x, 8 if cache.dtype == torch.int8 else 4, scale.dtype)


# --- checks -------------------------------------------------------------------------------------


def assert_matches_fp64(actual, expected):
    """The float64 reference (`compute_dtype=float64`: fp64 throughout, dequantization included,
    results unrounded) agrees with the naive loops to float64 rounding."""
    assert actual.dtype == torch.float64
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12)


def assert_bitwise_equal(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(actual.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8))
