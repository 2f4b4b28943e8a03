"""`torch_ops/reference.py`'s attention ops (context_attention, paged_prefill, paged_decode)
against the naive float64 loops of reference_helpers.py.

An attention test checks the float64 reference against the loops, and `torch.ops.attn.<op>`
against them with the error-ratio tolerance (the baseline being the reference computed in the
input precision).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from torch_ops import quant, reference
from torch_ops.testing import assert_error_ratio, poison_

from .reference_helpers import (
    D, F64, FORMATS, HEADS, PLAIN, assert_matches_fp64, cumsum, dequant_vector, index, make_cache, naive_varlen, rand,
    token_scale,
)

CAUSAL = pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
# Cross-attention lengths: more keys than queries, fewer (causal: the first queries see
# nothing), no queries, no keys, equal.
CROSS_Q, CROSS_K = [4, 3, 0, 2, 5], [6, 1, 3, 0, 5]


# --- paged caches as the naive side reads them --------------------------------------------------


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
