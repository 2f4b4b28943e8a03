"""`torch_ops/reference.py` against naive float64 loops written from docs/ops.md.

The expected values come from explicit Python loops over sequences, query tokens, heads and keys
with the softmax done by hand, and from this file's own dequantization and quantization of the
cache formats: nothing here is derived from reference.py. An attention test checks the float64
reference against the loops, and `torch.ops.attn.<op>` against them with the error-ratio
tolerance (the baseline being the reference computed in the input precision).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import torch_ops  # noqa: F401  (registers torch.ops.attn)
from torch_ops import quant, reference
from torch_ops.testing import assert_error_ratio, poison_

D = 8  # head dim
GROUP = 4  # INT8/INT4 quant group
F64 = torch.float64
HEADS = pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)], ids=["MHA", "GQA", "MQA"])
CAUSAL = pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
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
# Cross-attention lengths: more keys than queries, fewer (causal: the first queries see
# nothing), no queries, no keys, equal.
CROSS_Q, CROSS_K = [4, 3, 0, 2, 5], [6, 1, 3, 0, 5]


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


def standard_alibi_slopes(n: int) -> list[float]:
    """ALiBi slopes of Press et al.: the power-of-two geometric series, interleaved for others."""
    if math.log2(n).is_integer():
        return [2 ** (-8 * (i + 1) / n) for i in range(n)]
    m = 2 ** math.floor(math.log2(n))
    return standard_alibi_slopes(m) + standard_alibi_slopes(2 * m)[0::2][: n - m]


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


def naive_gather(cache, scale, table, length, dim=D) -> torch.Tensor:
    """Tokens `0..length-1` of one sequence (block `table[t // bs]`, offset `t % bs`),
    dequantized: float64 `[length, Hkv, dim]`."""
    bs, hkv = cache.shape[1], cache.shape[2]
    rows = []
    for t in range(length):
        block, off = int(table[t // bs]), t % bs
        rows.append([dequant_vector(cache[block, off, h], token_scale(scale, (block, off, h), h))
                     for h in range(hkv)])
    return torch.tensor(rows, dtype=F64).reshape(length, hkv, dim)


def dequant_packed(x, scale) -> torch.Tensor:
    """FP8 `[T, H, D]` with a 0-d or per-head scale -> float64 `x * scale[h]`."""
    t, h = x.shape[0], x.shape[1]
    rows = [[dequant_vector(x[i, j], token_scale(scale, None, j)) for j in range(h)] for i in range(t)]
    return torch.tensor(rows, dtype=F64).reshape(x.shape)


@dataclass
class PagedKV:
    """A paged K/V cache, its block table and lengths, and each sequence's keys and values as the
    naive side dequantizes them."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    scales: dict
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    keys: list
    values: list


def paged_kv(seq_lens, hkv, *, block_size=3, fmt="fp16", hnd=False, dv=D) -> PagedKV:
    """Random caches (values of head dim `dv`) whose blocks go to the sequences in a random order;
    two blocks stay unowned, and block-table entries past a sequence's blocks are random ids."""
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks, dtype=torch.int32)
    table = torch.randint(0, num_blocks, (len(seq_lens), max(need + [1])), dtype=torch.int32)
    for b, (start, n) in enumerate(zip(cumsum(need), need)):
        table[b, :n] = perm[start:start + n]
    k_cache, v_cache, k_scale, v_scale = make_cache(num_blocks, block_size, hkv, fmt, hnd, dv)
    scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
    keys = [naive_gather(k_cache, k_scale, table[b], n) for b, n in enumerate(seq_lens)]
    values = [naive_gather(v_cache, v_scale, table[b], n, dv) for b, n in enumerate(seq_lens)]
    return PagedKV(k_cache, v_cache, scales, table, torch.tensor(seq_lens, dtype=torch.int32), keys, values)


# --- inputs and checks of the attention ops -----------------------------------------------------


def naive_context(q, k, v, q_lens, k_lens, **opts):
    """Packed queries and packed keys/values, sequence `b` having `q_lens[b]`/`k_lens[b]`."""
    ck = cumsum(k_lens)
    return naive_varlen(q, cumsum(q_lens), [k[a:b] for a, b in zip(ck, ck[1:])],
                        [v[a:b] for a, b in zip(ck, ck[1:])], dv=v.shape[-1], **opts)


def context_inputs(q_lens, k_lens, hq, hkv, dtype=torch.float16, dv=D, **opts):
    """Random packed `context_attention` inputs (values of head dim `dv`): `(args, kwargs, naive (out, lse))`."""
    q = rand(sum(q_lens), hq, D, dtype=dtype)
    k, v = rand(sum(k_lens), hkv, D, dtype=dtype), rand(sum(k_lens), hkv, dv, dtype=dtype)
    return (q, k, v, index(q_lens), index(k_lens)), opts, naive_context(q, k, v, q_lens, k_lens, **opts)


def prefill_inputs(q_lens, seq_lens, hq, hkv, *, causal=True, block_size=3, fmt="fp16", hnd=False, dv=D, **opts):
    """Random `paged_prefill` inputs (query dtype: the plain cache's, else fp16; values of head dim `dv`)."""
    kv = paged_kv(seq_lens, hkv, block_size=block_size, fmt=fmt, hnd=hnd, dv=dv)
    dtype = kv.k_cache.dtype if kv.k_cache.dtype in PLAIN else torch.float16
    q = rand(sum(q_lens), hq, D, dtype=dtype)
    truth = naive_varlen(q, cumsum(q_lens), kv.keys, kv.values, dv, causal=causal, **opts)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, index(q_lens), kv.seq_lens)
    return args, {"causal": causal, **opts, **kv.scales}, truth


def decode_inputs(seq_lens, q_per_seq, hq, hkv, *, block_size=3, fmt="fp16", **opts):
    """Random `paged_decode` inputs: `q_per_seq` new tokens per sequence, causal among them."""
    kv = paged_kv(seq_lens, hkv, block_size=block_size, fmt=fmt)
    q = rand(len(seq_lens) * q_per_seq, hq, D)
    truth = naive_varlen(q, cumsum([q_per_seq] * len(seq_lens)), kv.keys, kv.values, causal=True, **opts)
    return (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens), {**opts, **kv.scales}, truth


INPUTS = {  # op -> builder(**options) of GQA inputs
    "paged_decode": lambda **opts: decode_inputs([5, 0, 9, 3], 3, 4, 2, **opts),
    "paged_prefill": lambda **opts: prefill_inputs([3, 0, 1, 5], [7, 4, 9, 5], 4, 2, **opts),
    "context_attention": lambda **opts: context_inputs(CROSS_Q, CROSS_K, 4, 2, causal=True, **opts),
}


def reference64(op, args, kwargs):
    """`reference.<op>` computing in float64 (a float64 query, or fp32 output for FP8 inputs)."""
    fn = getattr(reference, op)
    if args[0].dtype == torch.float8_e4m3fn:
        return fn(*args, **kwargs, out_dtype=torch.float32, compute_dtype=F64)
    return fn(args[0].double(), *args[1:], **kwargs, compute_dtype=F64)


def reference_low(op, args, kwargs):
    """`reference.<op>` in the input precision (bf16 for FP8 inputs): the error-ratio baseline."""
    dtype = torch.bfloat16 if args[0].dtype == torch.float8_e4m3fn else args[0].dtype
    return getattr(reference, op)(*args, **kwargs, compute_dtype=dtype)


def assert_matches_fp64(actual, expected):
    """The float64 reference (`compute_dtype=float64`: fp64 throughout, dequantization included,
    results unrounded) agrees with the naive loops to float64 rounding."""
    assert actual.dtype == torch.float64
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12)


def check_attention(op, args, kwargs, truth):
    """The float64 reference matches the naive `truth`; `torch.ops.attn.<op>` is within the error
    ratio of it. Returns the op's `(out, lse)`."""
    out64, lse64 = reference64(op, args, kwargs)
    assert_matches_fp64(out64, truth[0])
    assert_matches_fp64(lse64, truth[1])
    out, lse = getattr(torch.ops.attn, op)(*args, **kwargs)
    base_out, base_lse = reference_low(op, args, kwargs)
    assert out.dtype == base_out.dtype and lse.dtype == torch.float32
    assert_error_ratio(out, truth[0], base_out)
    assert_error_ratio(lse, truth[1], base_lse, name="lse")
    return out, lse


# --- attention ops ------------------------------------------------------------------------------


@HEADS
@CAUSAL
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_context_attention_varlen(hq, hkv, causal, dtype):
    """Packed self-attention over sequences of different lengths, one of them empty."""
    lens = [3, 0, 5, 1]
    check_attention("context_attention", *context_inputs(lens, lens, hq, hkv, dtype, causal=causal))


@HEADS
@CAUSAL
def test_context_attention_cross(hq, hkv, causal):
    """Independent q/kv lengths, bottom-right causal: with Lk < Lq the first queries (and all
    queries of a sequence without keys) see nothing and get zeros and lse -inf."""
    args, kwargs, truth = context_inputs(CROSS_Q, CROSS_K, hq, hkv, causal=causal)
    out, lse = check_attention("context_attention", args, kwargs, truth)
    empty = [7, 8] + ([4, 5] if causal else [])  # seq 3 (no keys); the first two of seq 1
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert bool((lse[empty] == -math.inf).all())


@HEADS
@CAUSAL
@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
def test_paged_prefill(hq, hkv, causal, hnd):
    """Varlen queries over a paged cache: the new tokens are the last positions of their sequence
    (a decode, a prefix-cached chunk, a full prefill, and a sequence without new tokens)."""
    check_attention("paged_prefill", *prefill_inputs([3, 0, 1, 5], [7, 4, 9, 5], hq, hkv, causal=causal, hnd=hnd))


@CAUSAL
@pytest.mark.parametrize("fmt", ["bf16", "e4m3-per-head"])
def test_value_head_dim(causal, fmt):
    """Values of their own head dim (D_v = 3 D / 2 and D / 2, MLA prefill): `out [T, Hq, D_v]`,
    the scale 1/sqrt(D) of the query/key head dim."""
    args, kwargs, truth = context_inputs(CROSS_Q, CROSS_K, 4, 2, dv=3 * D // 2, causal=causal)
    out, _ = check_attention("context_attention", args, kwargs, truth)
    assert out.shape == (sum(CROSS_Q), 4, 3 * D // 2)
    args, kwargs, truth = prefill_inputs([3, 0, 1, 5], [7, 4, 9, 5], 4, 2, causal=causal, fmt=fmt, dv=D // 2)
    out, _ = check_attention("paged_prefill", args, kwargs, truth)
    assert out.shape == (9, 4, D // 2)


@HEADS
@pytest.mark.parametrize("q_per_seq", [1, 3])
def test_paged_decode(hq, hkv, q_per_seq):
    """Decode (and speculative decode), with a padding sequence of length 0 that yields zeros."""
    args, kwargs, truth = decode_inputs([5, 0, 9, 3], q_per_seq, hq, hkv)
    out, _ = check_attention("paged_decode", args, kwargs, truth)
    assert not out[q_per_seq:2 * q_per_seq].any()


@CAUSAL
@pytest.mark.parametrize("sink_tokens", [0, 2])
@pytest.mark.parametrize("window_left", [0, 3])
def test_sliding_window(window_left, sink_tokens, causal):
    """`window_left` keys before each query stay visible, plus the first `sink_tokens` keys."""
    check_attention("paged_prefill", *prefill_inputs([4, 1, 0, 6], [12, 9, 3, 6], 4, 2, causal=causal,
                                                     window_left=window_left, sink_tokens=sink_tokens))


@HEADS
@CAUSAL
def test_alibi(hq, hkv, causal):
    """ALiBi adds `-slope_h * |p_i - j|` (both sides of the query when not causal)."""
    check_attention("context_attention", *context_inputs(CROSS_Q, CROSS_K, hq, hkv, causal=causal,
                                                         alibi_slopes=torch.rand(hq) + 0.05))


@HEADS
def test_learned_sinks(hq, hkv):
    """A sink logit per head enters the softmax denominator (out and lse) with no value; a query
    that sees no key gets zeros and lse = sinks[h]."""
    sinks = torch.randn(hq) * 2
    args, kwargs, truth = context_inputs(CROSS_Q, CROSS_K, hq, hkv, causal=True, sinks=sinks)
    out, lse = check_attention("context_attention", args, kwargs, truth)
    empty = [4, 5, 7, 8]
    assert not out[empty].any()
    assert torch.equal(lse[empty], sinks.expand(len(empty), hq))


@CAUSAL
def test_softcap(causal):
    """`softcap * tanh(s / softcap)` on large logits."""
    check_attention("context_attention", *context_inputs(CROSS_Q, CROSS_K, 4, 2, causal=causal, scale=1.0, softcap=1.5))


def test_extreme_logits_keep_the_softmax_exact():
    """Logits near 46,000 (FlashInfer's extreme-logits regression): with all values 1 the exact
    output is 1, which an fp32 softmax normalized by the row max keeps to rounding; normalizing by
    an fp32 lse would be off by up to exp(ulp(46000)) - 1, 0.2%."""
    d = 64
    q = torch.full((3, 2, d), 1.0)
    k = torch.randn(40, 2, d) * 0.01 + 5750.0   # <q, k> / sqrt(D) around 46,000
    v = torch.ones(40, 2, d)
    cu_q, cu_k = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 40], dtype=torch.int32)
    out, lse = reference.context_attention(q, k, v, cu_q, cu_k, compute_dtype=torch.float32)
    assert (lse > 45_000).all() and (out - 1).abs().max() < 1e-5


def dominant_key_inputs(op: str, top: float):
    """`INPUTS[op]` (scale 1) with the logits of keys 0 and 1 of every sequence `top`, both keys
    holding one value row, and the other logits at least 1,000 below `top` (their exp underflows
    to 0 in fp32 and fp64). Returns `(args, kwargs, seen [T], value0 [T, Hq, D])`: how many of the
    two keys each query row sees (causal), and its sequence's shared value row per query head."""
    args, kwargs, _ = INPUTS[op](scale=1.0)
    q, k, v = args[:3]
    group = q.shape[1] // k.shape[-2]
    q.zero_()[..., 0] = 1
    k[..., 0] = top - 1024 * (1 + torch.rand(k.shape[:-1]))
    if op == "context_attention":
        q_bounds, k_bounds = args[3].tolist(), args[4].tolist()
        k_lens = [b - a for a, b in zip(k_bounds, k_bounds[1:])]
        where = lambda b, j: (k_bounds[b] + j,)
    else:
        k_lens, block_size = args[-1].tolist(), k.shape[1]
        q_bounds = (torch.arange(len(k_lens) + 1) * (q.shape[0] // len(k_lens))).tolist() if op == "paged_decode" \
            else args[4].tolist()
        where = lambda b, j: (int(args[3][b, j // block_size]), j % block_size)
    seen = torch.zeros(q.shape[0], dtype=torch.long)
    value0 = torch.zeros(q.shape, dtype=v.dtype)
    for b, k_len in enumerate(k_lens):
        q0, q1 = q_bounds[b], q_bounds[b + 1]
        dominant = [where(b, j) for j in range(min(k_len, 2))]
        for key in dominant:
            k[key][:, 0] = top
            v[key] = v[dominant[0]]
        if dominant:
            value0[q0:q1] = v[dominant[0]].repeat_interleave(group, dim=0)
            seen[q0:q1] = (torch.arange(k_len - (q1 - q0), k_len) + 1).clamp(0, len(dominant))
    return args, kwargs, seen, value0


@pytest.mark.parametrize("top", [46080.0, -46080.0])
@pytest.mark.parametrize("op", list(INPUTS))
def test_extreme_dominant_logits_give_their_value_row_exactly(op, top):
    """Max logits of +-46,080 (one or two keys with one value row) and the others far below:
    every row that sees them is that value row bit for bit, in the input precision, fp32 and fp64
    (normalizing by an fp32 lse, `exp(s - lse)`, would miss 1/2 by up to 0.2% for two keys); lse
    is `top + log(keys seen)` to its rounding; rows that see no key are zeros with lse -inf."""
    args, kwargs, seen, value0 = dominant_key_inputs(op, top)
    sees = seen > 0
    assert (seen == 2).any()
    for dtype in (args[0].dtype, torch.float32, F64):
        query = args[0].double() if dtype == F64 else args[0]
        out, lse = getattr(reference, op)(query, *args[1:], **kwargs, compute_dtype=dtype)
        assert torch.equal(out[sees].double(), value0[sees].double()), dtype
        expected_lse = top + seen[sees].double().log().unsqueeze(1)   # every head
        assert (lse[sees].double() - expected_lse).abs().max() <= abs(top) * torch.finfo(lse.dtype).eps, dtype
        assert not out[~sees].any() and bool((lse[~sees] == -math.inf).all()), dtype


def test_merge_states_at_extreme_lse_keeps_the_weights_exact():
    lse_a, lse_b = torch.full((4, 2), 46000.25), torch.full((4, 2), 46000.0) + torch.rand(4, 2)
    ones = torch.ones(4, 2, 8)
    out, lse = reference.merge_states(ones, lse_a, ones, lse_b)
    assert (out - 1).abs().max() < 1e-6
    assert torch.allclose(lse.double(), torch.logaddexp(lse_a.double(), lse_b.double()), rtol=0, atol=0.01)


def _poisoned(case: str, q, k, v):
    """Copies of `q, k, v` with one non-finite element in sequence 0 of CROSS_Q/CROSS_K (4 causal
    queries over 6 keys, all seeing keys 0..2), and the affected `(out mask, lse mask)` of
    `[T, Hq(, D)]`, Hq = 4 over Hkv = 2."""
    q, k, v = q.clone(), k.clone(), v.clone()
    out_hit, lse_hit = torch.zeros(q.shape, dtype=torch.bool), torch.zeros(q.shape[:2], dtype=torch.bool)
    if case == "nan-query":
        q[1, 3, 5] = math.nan
        out_hit[1, 3], lse_hit[1, 3] = True, True
    elif case == "inf-logit":   # q[..., 0] > 0: key 0's logit is +inf for query heads 0 and 1
        k[0, 0, 0] = math.inf
        out_hit[0:4, 0:2], lse_hit[0:4, 0:2] = True, True
    elif case == "nan-key":
        k[2, 1, 4] = math.nan
        out_hit[0:4, 2:4], lse_hit[0:4, 2:4] = True, True
    elif case == "inf-value":
        v[1, 0, 6] = math.inf
        out_hit[0:4, 0:2, 6] = True
    return (q, k, v), out_hit, lse_hit


@pytest.mark.parametrize("compute_dtype", [torch.float32, F64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("case", ["nan-query", "inf-logit", "nan-key", "inf-value"])
def test_non_finite_inputs_reach_exactly_the_rows_that_read_them(case, compute_dtype):
    """docs "Non-finite values": a NaN or +inf logit makes its row's out and lse NaN, a NaN/inf
    in a weighted value row reaches out; every other row is as without it, bit for bit."""
    (q, k, v, cu_q, cu_k), kwargs, _ = context_inputs(CROSS_Q, CROSS_K, 4, 2, causal=True)
    q[..., 0] = q[..., 0].abs() + 0.25
    run = lambda q, k, v: reference.context_attention(q, k, v, cu_q, cu_k, **kwargs, compute_dtype=compute_dtype)
    out0, lse0 = run(q, k, v)
    (q, k, v), out_hit, lse_hit = _poisoned(case, q, k, v)
    out, lse = run(q, k, v)
    if case == "inf-value":
        assert bool(out[out_hit].isinf().all())
    else:
        assert bool(out[out_hit].isnan().all()) and bool(lse[lse_hit].isnan().all())
    assert torch.equal(out[~out_hit], out0[~out_hit]) and torch.equal(lse[~lse_hit], lse0[~lse_hit])


def test_a_minus_inf_logit_is_a_key_not_seen():
    """A logit of -inf (an -inf key element against a positive query element) hides that key,
    like `key_mask`."""
    (q, k, v, cu_q, cu_k), kwargs, _ = context_inputs(CROSS_Q, CROSS_K, 4, 4, causal=True)
    q[..., 0] = q[..., 0].abs() + 0.25
    k[2, :, 0] = -math.inf
    mask = torch.ones(q.shape[0], max(CROSS_K), dtype=torch.bool)
    mask[0:4, 2] = False
    out, lse = reference.context_attention(q, k, v, cu_q, cu_k, **kwargs)
    out_m, lse_m = reference.context_attention(q, k, v, cu_q, cu_k, **kwargs, key_mask=mask)
    assert torch.equal(out, out_m) and torch.equal(lse, lse_m)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_merge_states_of_a_non_finite_lse_is_nan(bad):
    """An lse of +inf or NaN (not a partial state) gives NaN out and lse for its row, as the
    kernel's; the other rows merge as usual."""
    out_a, out_b = rand(4, 3, D, dtype=torch.float32), rand(4, 3, D, dtype=torch.float32)
    lse_a, lse_b = torch.randn(4, 3), torch.randn(4, 3)
    out0, lse0 = reference.merge_states(out_a, lse_a, out_b, lse_b)
    lse_b[2, 1] = bad
    out, lse = reference.merge_states(out_a, lse_a, out_b, lse_b)
    assert bool(out[2, 1].isnan().all()) and math.isnan(lse[2, 1])
    out[2, 1], lse[2, 1] = out0[2, 1], lse0[2, 1]
    assert torch.equal(out, out0) and torch.equal(lse, lse0)


@pytest.mark.parametrize("scale,q_scaling", [(None, 1.0), (0.37, 1.0), (None, 2.5), (0.9, 0.6)])
def test_scale_and_q_scaling(scale, q_scaling):
    """Logits are scaled by `(scale or 1/sqrt(D)) / q_scaling`."""
    check_attention("paged_prefill", *prefill_inputs([3, 1, 5], [7, 9, 5], 4, 2, scale=scale, q_scaling=q_scaling))


@pytest.mark.parametrize("op", list(INPUTS))
def test_all_options_together(op):
    """Scale, q_scaling, softcap (applied before ALiBi), ALiBi, a window with a sink token and
    learned sinks in one call."""
    hq = 4
    check_attention(op, *INPUTS[op](scale=1.0, q_scaling=1.3, softcap=2.0, alibi_slopes=torch.rand(hq) * 0.5,
                                    window_left=2, sink_tokens=1, sinks=torch.randn(hq)))


@pytest.mark.parametrize("op", list(INPUTS))
def test_lse_and_out_overload(op):
    """lse is the natural-log denominator; the `.out` overload fully writes both caller buffers
    with the functional result."""
    args, kwargs, truth = INPUTS[op]()
    out, lse = check_attention(op, args, kwargs, truth)
    out_buf, lse_buf = poison_(torch.empty_like(out)), poison_(torch.empty_like(lse))
    getattr(torch.ops.attn, op).out(*args, **kwargs, out=out_buf, lse=lse_buf)
    assert torch.equal(out_buf, out) and torch.equal(lse_buf, lse)


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_paged_cache_formats(fmt, block_size):
    """Plain, FP8 (per-tensor and per-head scales), INT8 and INT4 caches, dequantized by the
    docs' table, with blocks in a random order."""
    check_attention("paged_prefill", *prefill_inputs([2, 1, 4], [9, 20, 4], 4, 2, block_size=block_size, fmt=fmt))


def assert_fp8_output(out, out_scale, truth):
    """`out` is `e4m3(clamp(truth / out_scale, -448, 448))` up to e4m3 rounding (half an ulp:
    2^-4 relative, 2^-10 in the subnormals), saturating exactly at +-448."""
    assert out.dtype == torch.float8_e4m3fn
    target = truth / out_scale.item()
    clamped = target.clamp(-448, 448)
    got = out.double()
    bound = torch.clamp(clamped.abs() * 2**-4, min=2**-10) * 1.001
    assert bool(((got - clamped).abs() <= bound).all()), (got - clamped).abs().max()
    saturated = target.abs() > 448
    assert saturated.any() and torch.equal(got[saturated], clamped[saturated])


@pytest.mark.parametrize("op", list(INPUTS))
def test_fp8_output(op):
    """With `out_scale`, out is FP8 e4m3 `clamp(out / out_scale)`: compare after dequantizing."""
    args, kwargs, truth = INPUTS[op]()
    kwargs["out_scale"] = torch.tensor(truth[0].abs().max().item() / 600, dtype=torch.float32)
    out, lse = getattr(torch.ops.attn, op)(*args, **kwargs)
    out64, lse64 = reference64(op, args, kwargs)
    assert_fp8_output(out, kwargs["out_scale"], truth[0])
    assert_matches_fp64(out64, truth[0])  # the oracle returns the unquantized result
    assert_matches_fp64(lse64, truth[1])
    assert_error_ratio(lse, truth[1], reference_low(op, args, kwargs)[1], name="lse")


@CAUSAL
@pytest.mark.parametrize("per_head", [False, True], ids=["per-tensor", "per-head"])
def test_context_attention_fp8_inputs(per_head, causal):
    """FP8 e4m3 q/k/v with q/k/v scales: inputs dequantize to `x * scale[h]`, out is bf16."""
    hq, hkv = 4, 2
    stored, scales = [], []
    for n, h in ((sum(CROSS_Q), hq), (sum(CROSS_K), hkv), (sum(CROSS_K), hkv)):
        x = torch.randn(n, h, D) * torch.empty(h, 1).uniform_(0.5, 2)
        s = (x.abs().amax(dim=(0, 2)) if per_head else x.abs().amax()) / 448
        stored.append(quant.quantize_fp8(x, s, torch.float8_e4m3fn))
        scales.append(s)
    truth = naive_context(*(dequant_packed(x, s) for x, s in zip(stored, scales)), CROSS_Q, CROSS_K, causal=causal)
    kwargs = dict(causal=causal, q_scale=scales[0], k_scale=scales[1], v_scale=scales[2])
    out, _ = check_attention("context_attention", (*stored, index(CROSS_Q), index(CROSS_K)), kwargs, truth)
    assert out.dtype == torch.bfloat16


# --- merge_states -------------------------------------------------------------------------------


@HEADS
def test_merge_states_of_two_halves(hq, hkv):
    """Merged states of the two halves of a key set (split at a random key) equal attention over
    the whole set; learned sinks are added once, after merging."""
    q = torch.randn(5, hq, D, dtype=F64)
    k, v = torch.randn(9, hkv, D, dtype=F64), torch.randn(9, hkv, D, dtype=F64)
    sinks = torch.randn(hq)
    cut = int(torch.randint(1, 9, ()))
    (out_a, lse_a), (out_b, lse_b) = naive_attention(q, k[:cut], v[:cut]), naive_attention(q, k[cut:], v[cut:])
    whole_out, whole_lse = naive_attention(q, k, v)
    out, lse = torch.ops.attn.merge_states(out_a.float(), lse_a.float(), out_b.float(), lse_b.float())
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    fp32_math = dict(rtol=1e-5, atol=1e-5)  # fp32 inputs and math, on lse values of a few units
    torch.testing.assert_close(out.double(), whole_out, **fp32_math)
    torch.testing.assert_close(lse.double(), whole_lse, **fp32_math)

    sink_out, sink_lse = naive_attention(q, k, v, sinks=sinks)
    with_sink = torch.logaddexp(lse.double(), sinks.double())
    torch.testing.assert_close(with_sink, sink_lse, **fp32_math)
    torch.testing.assert_close(out.double() * (lse.double() - with_sink).exp().unsqueeze(-1), sink_out, **fp32_math)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_merge_states_empty(dtype):
    """Two empty states (lse -inf) merge to zeros and -inf, never NaN; merging with one empty
    state returns the other; otherwise `logaddexp` and the lse-weighted sum."""
    out_a, out_b = rand(4, 3, D, dtype=dtype), rand(4, 3, D, dtype=dtype)
    lse_a, lse_b = torch.randn(4, 3), torch.randn(4, 3)
    lse_a[0], lse_b[0], lse_a[1], lse_b[2] = -math.inf, -math.inf, -math.inf, -math.inf
    out, lse = torch.ops.attn.merge_states(out_a, lse_a, out_b, lse_b)
    assert not out[0].any() and bool((lse[0] == -math.inf).all())
    assert torch.equal(out[1], out_b[1]) and torch.equal(lse[1], lse_b[1])
    assert torch.equal(out[2], out_a[2]) and torch.equal(lse[2], lse_a[2])
    for h in range(3):
        la, lb = lse_a[3, h].item(), lse_b[3, h].item()
        both = math.log(math.exp(la) + math.exp(lb))
        expect = [math.exp(la - both) * a + math.exp(lb - both) * b
                  for a, b in zip(out_a[3, h].tolist(), out_b[3, h].tolist())]
        assert lse[3, h].item() == pytest.approx(both, rel=1e-6, abs=2e-6)  # fp32 math
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(out[3, h].double(), torch.tensor(expect, dtype=F64), rtol=eps, atol=max(eps, 1e-5))


# --- kv_cache_write -----------------------------------------------------------------------------


def random_slots(num_tokens, capacity, num_skipped=3) -> torch.Tensor:
    """Distinct random slots, `num_skipped` of them negative (-1 or another negative value)."""
    slots = torch.randperm(capacity)[:num_tokens]
    skipped = torch.randperm(num_tokens)[:num_skipped]
    slots[skipped] = -torch.randint(1, 9, (num_skipped,))
    return slots.int()


def assert_bitwise_equal(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(actual.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8))


def store_vector(cache, scale, where, x: list[float]) -> None:
    """Write one `[D]` vector at `cache[where]` in the cache's format (naive quantization)."""
    if cache.dtype in PLAIN:
        cache[where] = torch.tensor(x, dtype=F64).to(cache.dtype)
    elif cache.dtype in FP8_MAX:
        cache[where] = quant_fp8_vector(x, token_scale(scale, None, where[-1]), cache.dtype)
    else:
        cache[where], scale[where] = quant_group_vector(x, 8 if cache.dtype == torch.int8 else 4, scale.dtype)


@pytest.mark.parametrize("repeated", [False, True], ids=["distinct", "repeated"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_kv_cache_write(fmt, repeated):
    """Tokens land at `slot = block * block_size + offset` in the cache format (FP8 saturating,
    INT8/INT4 with new group scales, the 1e-5 scale floor on a tiny head); negative slots are
    skipped and the rest of the cache is untouched. key/value are views of a fused QKV tensor.
    Of tokens sharing a slot, the last one lands, whole (values and group scales)."""
    hkv, block_size, num_blocks, t = 2, 3, 5, 7
    dtype, kind = FORMATS[fmt]
    k_cache, v_cache, k_scale, v_scale = make_cache(num_blocks, block_size, hkv, fmt)
    qkv = rand(t, 4 + 2 * hkv, D, dtype=dtype if dtype in PLAIN else torch.bfloat16) * 3
    key, value = qkv[:, 4:4 + hkv], qkv[:, 4 + hkv:]
    key[2, 1] *= 1e-6
    if dtype in FP8_MAX:  # scales that make the largest values saturate
        for x, s in ((key, k_scale), (value, v_scale)):
            amax = x.float().abs().amax(dim=(0, 2)) if kind == "head" else x.float().abs().amax()
            s.copy_(amax / (1.25 * FP8_MAX[dtype]))
    slots = random_slots(t, num_blocks * block_size)
    if repeated:
        written = (slots >= 0).nonzero().flatten()
        slots[written[-1]] = slots[written[-3]] = slots[written[0]]
    expected = [x.clone() if x is not None else None for x in (k_cache, v_cache, k_scale, v_scale)]
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        for h in range(hkv):
            where = (slot // block_size, slot % block_size, h)
            store_vector(expected[0], expected[2], where, key[i, h].tolist())
            store_vector(expected[1], expected[3], where, value[i, h].tolist())
    scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
    ret = torch.ops.attn.kv_cache_write(key, value, k_cache, v_cache, slots, **scales)
    assert ret.numel() == 0
    for actual, expect in zip((k_cache, v_cache, k_scale, v_scale), expected):
        if expect is not None:
            assert_bitwise_equal(actual, expect)


def random_cos_sin(max_position: int, rotary_dim: int) -> torch.Tensor:
    """A `[max_position, rotary_dim]` fp32 table: cosines of random angles, then their sines."""
    angles = torch.rand(max_position, rotary_dim // 2, dtype=F64) * 2 * math.pi
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def naive_rope(x, positions, cos_sin, neox: bool) -> torch.Tensor:
    """docs: NeoX rotates `(x[i], x[i + R/2])`, GPT-J `(x[2i], x[2i+1])`, as
    `(a, b) -> (a cos - b sin, b cos + a sin)` with `cos_sin[pos] = [cos..., sin...]`; float64."""
    half = cos_sin.shape[1] // 2
    out = []
    for t, pos in enumerate(positions.tolist()):
        row = cos_sin[pos].double().tolist()
        cos, sin = row[:half], row[half:]
        heads = []
        for vec in x[t].double().tolist():
            rotated = list(vec)
            for i in range(half):
                ia, ib = (i, i + half) if neox else (2 * i, 2 * i + 1)
                a, b = vec[ia], vec[ib]
                rotated[ia], rotated[ib] = a * cos[i] - b * sin[i], b * cos[i] + a * sin[i]
            heads.append(rotated)
        out.append(heads)
    return torch.tensor(out, dtype=F64)


def assert_rounded(actual, exact, magnitude):
    """`actual` is `exact` rounded to its dtype, up to fp32 arithmetic on values of `magnitude`."""
    eps = torch.finfo(actual.dtype).eps
    torch.testing.assert_close(actual.double(), exact, rtol=eps, atol=4 * 2**-24 * magnitude)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("rotary_dim", [D, D // 2], ids=["full", "partial"])
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
def test_kv_cache_write_rope(neox, rotary_dim, dtype):
    """RoPE on key (before it is written) and query (returned as a new tensor); dims past
    `rotary_dim` pass through; values are written unrotated."""
    t, hq, hkv, block_size, num_blocks = 5, 4, 2, 3, 4
    cos_sin = random_cos_sin(16, rotary_dim)
    positions = torch.randint(0, 16, (t,), dtype=torch.int32)
    q, key, value = rand(t, hq, D, dtype=dtype), rand(t, hkv, D, dtype=dtype), rand(t, hkv, D, dtype=dtype)
    q_before = q.clone()
    k_cache, v_cache, _, _ = make_cache(num_blocks, block_size, hkv, "fp16" if dtype == torch.float16 else "fp32")
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = random_slots(t, num_blocks * block_size, num_skipped=1)
    rq = torch.ops.attn.kv_cache_write(key, value, k_cache, v_cache, slots, query=q, positions=positions,
                                       cos_sin_cache=cos_sin, rope_neox=neox)
    assert rq.dtype == dtype and rq.shape == q.shape and torch.equal(q, q_before)
    assert_rounded(rq, naive_rope(q, positions, cos_sin, neox), q.abs().max().item())
    assert torch.equal(rq[..., rotary_dim:], q[..., rotary_dim:])
    rotated_key = naive_rope(key, positions, cos_sin, neox)
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, off = divmod(slot, block_size)
        written[block, off] = True
        assert_rounded(k_cache[block, off], rotated_key[i], key.abs().max().item())
        assert torch.equal(k_cache[block, off, :, rotary_dim:], key[i, :, rotary_dim:])
        assert torch.equal(v_cache[block, off], value[i])
    assert torch.equal(k_cache[~written], k_before[~written]) and torch.equal(v_cache[~written], v_before[~written])


def assert_quantizes(cache, scale, where, x: list[float], magnitude: float) -> None:
    """`cache[where]` holds `x` quantized per the docs, up to which side of a rounding boundary
    an fp32 error of `magnitude * 1e-6` lands on: INT8/INT4 group scales are
    `max(absmax / qmax, 1e-5)` and elements within half a step; FP8 elements are within half an
    ulp of `clamp(x / scale)`."""
    stored = cache[where]
    if stored.dtype in FP8_MAX:
        s = token_scale(scale, where, where[-1])
        half_ulp, half_tiny = {torch.float8_e4m3fn: (2**-4, 2**-10), torch.float8_e5m2: (2**-3, 2**-17)}[stored.dtype]
        m = FP8_MAX[stored.dtype]
        for code, e in zip(stored.double().tolist(), x):
            target = min(max(e / s, -m), m)
            assert abs(code - target) <= max(abs(target) * half_ulp, half_tiny) * 1.001 + magnitude * 1e-6 / s
        return
    qmax = 127 if stored.dtype == torch.int8 else 7
    scales = token_scale(scale, where, where[-1])
    got = dequant_vector(stored, scales)
    for g, s in enumerate(scales):
        xs = x[g * GROUP:(g + 1) * GROUP]
        assert s == pytest.approx(max(max(map(abs, xs)) / qmax, 1e-5), rel=1e-6)
        for value, e in zip(got[g * GROUP:(g + 1) * GROUP], xs):
            assert abs(value - e) <= s / 2 + magnitude * 1e-6


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("fmt", ["e4m3-per-head", "e5m2", "int8", "int4"])
def test_kv_cache_write_rope_quantized(fmt, neox):
    """fp32 keys rotated (partial rotary dim) and then quantized into FP8/INT8/INT4 caches; values
    quantized unrotated."""
    t, hkv, block_size, num_blocks, rotary_dim = 5, 2, 3, 4, D // 2
    cos_sin = random_cos_sin(16, rotary_dim)
    positions = torch.randint(0, 16, (t,), dtype=torch.int32)
    key, value = torch.randn(t, hkv, D) * 2, torch.randn(t, hkv, D) * 2
    k_cache, v_cache, k_scale, v_scale = make_cache(num_blocks, block_size, hkv, fmt)
    slots = random_slots(t, num_blocks * block_size, num_skipped=1)
    torch.ops.attn.kv_cache_write(key, value, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale,
                                  positions=positions, cos_sin_cache=cos_sin, rope_neox=neox)
    rotated = naive_rope(key, positions, cos_sin, neox)
    magnitude = max(key.abs().max().item(), value.abs().max().item())
    for i, slot in enumerate(slots.tolist()):
        for h in range(hkv):
            if slot >= 0:
                where = (slot // block_size, slot % block_size, h)
                assert_quantizes(k_cache, k_scale, where, rotated[i, h].tolist(), magnitude)
                assert_quantizes(v_cache, v_scale, where, value[i, h].tolist(), magnitude)


# --- cache_attention (PPL) ----------------------------------------------------------------------

LAYOUT_DIMS = {0: "T L KV H", 1: "L T KV H", 2: "L KV T H", 3: "L KV H T"}  # Dh last; docs' shapes
PAGE = 2


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


def test_paged_decode_key_mask_is_attention_over_the_visible_keys():
    hq, hkv, d, bs, n = 4, 2, 16, 4, 11
    k, v = torch.randn(2, 3 * bs, hkv, d).unbind(0)
    q = torch.randn(1, hq, d)
    mask = torch.rand(1, 16) < 0.5
    mask[0, 2] = True
    tables = torch.arange(3, dtype=torch.int32).view(1, 3)
    out, lse = reference.paged_decode(q, k.view(3, bs, hkv, d), v.view(3, bs, hkv, d), tables,
                                      torch.tensor([n], dtype=torch.int32), key_mask=mask,
                                      compute_dtype=torch.float64)
    seen = mask[0, :n].nonzero().squeeze(1)   # keys past the length stay hidden
    want_o, want_l = reference.attend(q, k[seen], v[seen], torch.tensor([len(seen) - 1]), causal=False,
                                      compute_dtype=torch.float64)
    torch.testing.assert_close(out, want_o.to(out.dtype))
    torch.testing.assert_close(lse, want_l.to(lse.dtype))
