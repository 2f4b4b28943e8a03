"""`sdpa_to_attn`: each spelling of attention compiles onto `attn::context_attention` with the
numerics of eager; what the op cannot serve is declined with its reason and compiles as before."""

import copy
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import fx_passes
from fx_passes import sdpa_to_attn
from fx_passes.replacements import context_attention_bhsd
from torch_ops.testing import assert_error_ratio

OP = "attn.context_attention"


def repeat_kv(x, n):
    """Hugging Face's GQA expansion: `[B, Hkv, S, D]` to `[B, Hkv * n, S, D]`."""
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


# Spellings the pass rewrites.


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def sdpa_causal_scale(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)


def sdpa_gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def sdpa_repeat_interleave(q, k, v):
    n = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(n, dim=1), v.repeat_interleave(n, 1), is_causal=True)


def sdpa_repeat_kv(q, k, v):
    n = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, n), repeat_kv(v, n), is_causal=True)


def sdpa_mqa_expand(q, k, v):
    h = q.shape[1]
    return F.scaled_dot_product_attention(q, k.expand(-1, h, -1, -1), v.expand(-1, h, -1, -1), is_causal=True)


def matmul_div(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v


def matmul_causal_triu(q, k, v):
    s = q.shape[2]
    scores = torch.matmul(q, k.transpose(2, 3)) * 0.25
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=q.device), diagonal=1)
    return scores.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v


def matmul_hf_eager(q, k, v):
    """Hugging Face's `eager_attention_forward` with a causal mask, in eval mode."""
    s, n = q.shape[2], q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n), repeat_kv(v, n)
    scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.tril(torch.ones(s, s, device=q.device)) == 0, torch.finfo(scores.dtype).min)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    probs = F.dropout(probs, p=0.1, training=False)
    return torch.matmul(probs, v)


def matmul_permute_unsqueeze(q, k, v):
    b, h, s, d = k.shape
    n = q.shape[1] // h
    k = k.unsqueeze(2).expand(b, h, n, s, d).flatten(1, 2)
    v = v.unsqueeze(-3).expand(b, h, n, s, d).reshape(b, h * n, s, d)
    scores = (0.25 * torch.matmul(q, k.permute(0, 1, 3, 2))).float()
    mask = ~torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(mask, float("-inf")).softmax(-1).to(q.dtype) @ v


def matmul_logical_not(q, k, v):
    s = q.shape[2]
    mask = torch.logical_not(torch.tril(torch.ones(s, s, device=q.device), diagonal=0))
    return torch.softmax(torch.masked_fill(q @ k.swapaxes(2, 3), mask, float("-inf")) / 3, dim=3) @ v


def hf_index_mask(b, s, device, window=None):
    """Hugging Face's `sdpa_mask` (transformers 5, as compiled): a bool `[B, 1, S, S]` built from
    position ids, true where the key is visible; with `window`, a sliding window too."""
    pos = (torch.arange(s, device=device) + 0).unsqueeze(0).expand(b, -1)
    packed = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    bi = torch.arange(b, device=device)[:, None, None, None]
    qi, ki = torch.arange(s, device=device)[None, None, :, None], torch.arange(s, device=device)[None, None, None, :]
    mask = qi.new_ones((), dtype=torch.bool) & (packed[bi, qi] == packed[bi, ki]).to(device)
    mask = mask & (pos[bi, ki] <= pos[bi, qi])
    if window is not None:
        mask = mask & (pos[bi, ki] > pos[bi, qi] - window)
    return mask.expand(b, -1, s, s)


def sdpa_hf_index_mask(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=hf_index_mask(q.shape[0], q.shape[2], q.device))


def matmul_hf_additive_mask(q, k, v):
    bias = torch.where(hf_index_mask(q.shape[0], q.shape[2], q.device), torch.zeros((), dtype=q.dtype, device=q.device),
                       torch.finfo(q.dtype).min)
    return torch.softmax(torch.matmul(q, k.transpose(2, 3)) * 0.25 + bias, dim=-1) @ v


def sdpa_hf_sliding_window(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=hf_index_mask(q.shape[0], q.shape[2], q.device, 3))


def matmul_hf_additive_sliding_window(q, k, v):
    bias = torch.where(hf_index_mask(q.shape[0], q.shape[2], q.device, 2), torch.zeros((), dtype=q.dtype, device=q.device),
                       torch.finfo(q.dtype).min)
    return torch.softmax(torch.matmul(q, k.transpose(2, 3)) * 0.25 + bias, dim=-1) @ v


def matmul_inplace_div_additive_mask(q, k, v):
    """Falcon's eager spelling: `scores /= sqrt(D)` in place, then the additive causal mask."""
    scores = q @ k.transpose(-1, -2)
    scores /= math.sqrt(q.shape[-1])
    bias = torch.where(hf_index_mask(q.shape[0], q.shape[2], q.device), torch.zeros((), dtype=q.dtype, device=q.device),
                       torch.finfo(q.dtype).min)
    return torch.softmax(scores + bias, dim=-1) @ v


def matmul_softcap_causal(q, k, v):
    """Gemma 2's eager spelling with a constant soft-cap of 5: scale, `c * tanh(s / c)`, then the mask."""
    s = q.shape[2]
    scores = torch.matmul(q, k.transpose(2, 3)) * 0.25
    scores = torch.tanh(scores / 5.0) * 5.0
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=q.device), diagonal=1)
    return torch.softmax(scores.masked_fill(mask, float("-inf")).float(), dim=-1).to(q.dtype) @ v


SINKS = torch.randn(4)


def matmul_sinks(q, k, v):
    """gpt-oss's eager spelling: a sink logit per head joins each row of scores, the row max is
    subtracted, and the sink's probability column is dropped before `@ v`."""
    s = q.shape[2]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=q.device), diagonal=1)
    scores = (q @ k.transpose(2, 3) * 0.25).masked_fill(mask, float("-inf"))
    sinks = SINKS.to(q.device).reshape(1, -1, 1, 1).expand(q.shape[0], -1, s, -1)
    combined = torch.cat([scores, sinks], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1)[..., :-1] @ v


def alibi_slopes(h, device):
    """BLOOM's and Falcon's slopes for `h` heads (a power of two), as they compute them."""
    powers = torch.arange(1, h + 1, device=device, dtype=torch.int32)
    return torch.pow(torch.full((), 2 ** (-8 / h), device=device), powers)


def hf_additive_mask(b, s, dtype, device):
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(hf_index_mask(b, s, device), zero, torch.finfo(dtype).min)


def sdpa_hf_float_mask(q, k, v):
    """Hugging Face's eager mask (`where(causal, 0, min)`) given to SDPA: a float causal mask."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=hf_additive_mask(q.shape[0], q.shape[2], q.dtype, q.device))


def sdpa_falcon_alibi(q, k, v):
    """Falcon's spelling: bfloat16 slopes times positions, over sqrt(D), folded into the float causal
    mask SDPA gets (masked where `where(causal, 0, min) < -1`)."""
    b, h, s, d = q.shape
    ones = torch.ones(b, s, dtype=torch.long, device=q.device)
    positions = ((ones.cumsum(dim=-1) - 1) * ones)[:, None, :]
    alibi = (alibi_slopes(h, q.device)[..., None].bfloat16() * positions).reshape(b * h, 1, s).to(q.dtype)
    alibi = alibi.reshape(b, -1, *alibi.shape[1:])
    causal = hf_additive_mask(b, s, q.dtype, q.device)
    mask = torch.masked_fill(alibi / math.sqrt(d), causal < -1, torch.finfo(q.dtype).min)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def bmm_bloom_alibi(q, k, v):
    """BLOOM's spelling: `baddbmm(alibi, q, k^T)` over `[B*H, S, D]` views, the alibi `slopes *
    arange(S)` repeated over the batch, the causal mask added to a `[B, H, S, S]` view."""
    b, h, s, d = q.shape
    alibi = (alibi_slopes(h, q.device)[:, None, None] * torch.arange(s, device=q.device)).repeat(b, 1, 1).to(q.dtype)
    scores = alibi.baddbmm(batch1=q.reshape(b * h, -1, d), batch2=k.reshape(b * h, -1, d).transpose(-1, -2),
                           beta=2.0, alpha=d ** -0.5)
    probs = F.softmax(scores.view(b, h, s, -1) + hf_additive_mask(b, s, q.dtype, q.device), dim=-1, dtype=torch.float32)
    probs = F.dropout(probs.to(q.dtype), p=0.1, training=False)
    return torch.bmm(probs.view(b * h, s, -1), v.reshape(b * h, -1, d)).view(b, h, s, d)


class RelativeAlibi(torch.nn.Module):
    """Slopes in a buffer times relative positions `k - q`, after the scaling, then `triu` masked."""

    def __init__(self, heads=4):
        super().__init__()
        self.register_buffer("slopes", torch.tensor([0.5, 0.3, 0.2, 0.1][:heads]))

    def forward(self, q, k, v):
        s = q.shape[2]
        i = torch.arange(s, device=q.device)
        scores = q @ k.transpose(-1, -2) * 0.25 + self.slopes.view(1, -1, 1, 1) * (i[None, :] - i[:, None])
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=q.device), diagonal=1)
        return scores.masked_fill(mask, float("-inf")).softmax(-1) @ v


# Declined spellings.


def matmul_sinks_kept(q, k, v):
    """A sink column whose probability is not dropped: not the op's sinks."""
    sinks = SINKS.to(q.device).reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], -1)
    probs = torch.softmax(torch.cat([q @ k.transpose(2, 3), sinks], dim=-1), dim=-1)
    return probs @ torch.cat([v, v[:, :, :1]], dim=2)


def matmul_mask_under_tanh(q, k, v):
    """A mask inside the soft-cap: tanh(-inf) is -1, nothing is masked."""
    s = q.shape[2]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=q.device), diagonal=1)
    scores = torch.tanh(torch.matmul(q, k.transpose(2, 3)).masked_fill(mask, float("-inf")) / 5.0) * 5.0
    return torch.softmax(scores, dim=-1) @ v


def sdpa_band_mask(q, k, v):
    """A window on both sides of the query (not causal)."""
    i = torch.arange(q.shape[2], device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(i[None, :] > i[:, None] - 3) & (i[None, :] < i[:, None] + 3))


def sdpa_tril_mask(q, k, v):
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def sdpa_mask_per_head(q, k, v):
    """A bool mask that differs between heads."""
    mask = torch.ones(q.shape[1], q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    mask[0] = True
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def sdpa_dropout(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)


def matmul_returns_weights(q, k, v):
    probs = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
    return probs @ v, probs


CAUSAL_BUFFER = torch.ones(16, 16).tril().view(1, 1, 16, 16)


def matmul_buffer_mask(q, k, v):
    """nanoGPT's spelling: the mask is a slice of a buffer, whose values the pass cannot see."""
    s = q.shape[2]
    scores = q @ k.transpose(-2, -1)
    return scores.masked_fill(CAUSAL_BUFFER[:, :, :s, :s] == 0, float("-inf")).softmax(-1) @ v


def matmul_additive_mask(q, k, v):
    s = q.shape[2]
    mask = torch.triu(torch.full((s, s), float("-inf"), device=q.device), diagonal=1)
    return torch.softmax(q @ k.transpose(-2, -1) + mask, dim=-1) @ v


def causal_bias(b, s, bias, device):
    """`bias` where Hugging Face's causal mask is true, -inf elsewhere."""
    return torch.where(hf_index_mask(b, s, device), bias, -math.inf)


def sdpa_alibi_quadratic(q, k, v):
    """Slopes times the square of the key position: not ALiBi."""
    b, h, s, _ = q.shape
    j = torch.arange(s, device=q.device)
    bias = alibi_slopes(h, q.device)[:, None, None] * (j * j)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_bias(b, s, bias, q.device))


def sdpa_alibi_per_query(q, k, v):
    """Slopes that vary with the query, not with the head."""
    b, _, s, _ = q.shape
    slopes = torch.linspace(0.1, 1.0, s, device=q.device)[:, None]
    bias = slopes * torch.arange(s, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_bias(b, s, bias, q.device))


def matmul_alibi_not_causal(q, k, v):
    """ALiBi without a causal mask: `slope * k` differs from `-slope * |q - k|` past the diagonal."""
    b, h, s, _ = q.shape
    bias = alibi_slopes(h, q.device)[:, None, None] * torch.arange(s, device=q.device)
    return torch.softmax(q @ k.transpose(-1, -2) * 0.25 + bias, dim=-1) @ v


def bmm_alibi_data_positions_causal(q, k, v):
    """BLOOM's spelling with positions `(cumsum(m) - 1) * m` of a mask computed from the data
    (`k == k`), not provably all ones, and the causal mask only."""
    b, h, s, d = q.shape
    m = (k[:, 0, :, 0] == k[:, 0, :, 0]).long()
    alibi = (alibi_slopes(h, q.device)[..., None] * ((m.cumsum(-1) - 1) * m)[:, None, :]).reshape(b * h, 1, s)
    scores = alibi.to(q.dtype).baddbmm(q.reshape(b * h, -1, d), k.reshape(b * h, -1, d).transpose(-1, -2))
    probs = F.softmax(scores.view(b, h, s, -1) + hf_additive_mask(b, s, q.dtype, q.device), dim=-1)
    return torch.bmm(probs.view(b * h, s, -1), v.reshape(b * h, -1, d)).view(b, h, s, d)


def bmm_bloom_padding_alibi(q, k, v, padding):
    """BLOOM with a 0/1 padding mask `padding [B, Sk]`: the ALiBi positions `(cumsum(padding) - 1)
    * padding` and the mask `k <= q & padding[b, k]` built in the graph; the queries are the last
    Sq keys (a static cache's prefill, or a decode step when Sq = 1)."""
    b, h, sq, d = q.shape
    sk = k.shape[2]
    positions = ((padding.cumsum(-1) - 1) * padding)[:, None, :]
    alibi = (alibi_slopes(h, q.device)[..., None] * positions).reshape(b * h, 1, sk).to(q.dtype)
    scores = alibi.baddbmm(batch1=q.reshape(b * h, -1, d), batch2=k.reshape(b * h, -1, d).transpose(-1, -2),
                           beta=1.0, alpha=d ** -0.5)
    batch, key = torch.arange(b, device=q.device)[:, None, None, None], torch.arange(sk, device=q.device)
    keep = (key <= torch.arange(sk - sq, sk, device=q.device)[:, None]) & padding.bool()[batch, key]
    mask = torch.where(keep, torch.zeros((), dtype=q.dtype, device=q.device), torch.finfo(q.dtype).min)
    probs = F.softmax(scores.view(b, h, sq, -1) + mask, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(probs.view(b * h, sq, -1), v.reshape(b * h, -1, d)).view(b, h, sq, d)


def padding_mask(b, sk, pad):
    """`[B, Sk]` 0/1: sequence 1 left-padded by `pad`."""
    mask = torch.ones(b, sk, dtype=torch.long)
    mask[1, :pad] = 0
    return mask


def matmul_alibi_input_mask(q, k, v, keep):
    """ALiBi `slope * k` on scores masked by a bool graph input `keep` of any pattern."""
    b, h, s, _ = q.shape
    bias = alibi_slopes(h, q.device)[:, None, None] * torch.arange(s, device=q.device)
    return torch.softmax(q @ k.transpose(-1, -2) * 0.25 + bias + torch.where(keep.bool(), 0.0, -math.inf), dim=-1) @ v


BIAS = torch.randn(4, 1, 6)


def sdpa_bias_not_from_positions(q, k, v):
    """A bias tensor whose values the pass cannot see (not slopes times positions)."""
    b, _, s, _ = q.shape
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_bias(b, s, BIAS, q.device))


def matmul_softcap_input_mask(q, k, v, mask):
    """Gemma 2's eager spelling under `generate()`: soft-capped scores plus a float mask input."""
    scores = torch.tanh(q @ k.transpose(-2, -1) * 0.25 / 5.0) * 5.0 + mask
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def input_mask(b, sq, sk, dtype):
    """Hugging Face's eager mask `[B, 1, Sq, Sk]`: 0 where a random pattern keeps the key (every
    row keeps key 0), `finfo.min` elsewhere."""
    keep = torch.rand(b, 1, sq, sk) < 0.7
    keep[..., 0] = True
    return torch.where(keep, 0.0, torch.finfo(dtype).min).to(dtype)


def qkv(b=2, hq=4, hkv=4, sq=6, sk=6, d=16, dv=None, dtype=torch.float32, requires_grad=False):
    def randn(*shape):
        return torch.randn(*shape, dtype=dtype, requires_grad=requires_grad)

    return randn(b, hq, sq, d), randn(b, hkv, sk, d), randn(b, hkv, sk, dv or d)


def compile_and_run(fn, inputs, *, grad=False):
    """`fn` compiled with the passes enabled, run on `inputs`; returns (output, generated code)."""
    with fx_passes.enabled(), torch.set_grad_enabled(grad):
        out, code = run_and_get_code(torch.compile(fn, fullgraph=True), *inputs)
    return out, "\n".join(code)


def check_close(fn, inputs, out):
    """`out` is as close to a float64 run of `fn` as eager `fn` in the inputs' precision is."""
    with torch.no_grad():
        baseline = fn(*inputs)
        fn64 = copy.deepcopy(fn).double() if isinstance(fn, torch.nn.Module) else fn
        truth = fn64(*(x.double() for x in inputs))
    for o, b, t in zip(*(x if isinstance(x, tuple) else (x,) for x in (out, baseline, truth))):
        assert_error_ratio(o.detach(), t, b)


REWRITTEN = [
    (sdpa, dict(sq=5, sk=7)),
    (sdpa_causal_scale, {}),
    (sdpa_gqa, dict(hkv=2)),
    (sdpa_repeat_interleave, dict(hkv=2)),
    (sdpa_repeat_kv, dict(hkv=2, dtype=torch.bfloat16)),
    (sdpa_mqa_expand, dict(hkv=1)),
    (matmul_div, dict(sq=5, sk=7)),
    (matmul_causal_triu, {}),
    (matmul_hf_eager, dict(hkv=2, dtype=torch.bfloat16)),
    (sdpa_tril_mask, {}),   # bool masks of other patterns: the op's key_mask
    (sdpa_band_mask, {}),
]


@pytest.mark.parametrize("fn, shapes", REWRITTEN, ids=[fn.__name__ for fn, _ in REWRITTEN])
def test_rewrites_onto_context_attention(fn, shapes):
    inputs = qkv(**shapes)
    out, code = compile_and_run(fn, inputs)
    assert counters["attn"]["sdpa_to_attn_matched"] == 1
    assert OP in code
    check_close(fn, inputs, out)


@pytest.mark.parametrize("fn, shapes, reason", [
    pytest.param(sdpa_mask_per_head, {}, "nor a bool mask shared by the heads", id="mask_per_head"),
    pytest.param(sdpa_dropout, {}, "dropout_p", id="dropout"),
    pytest.param(sdpa, dict(dtype=torch.float64), "dtypes", id="float64"),
    pytest.param(sdpa, dict(dv=8), "head dims differ", id="value_head_dim"),
    pytest.param(sdpa_gqa, dict(hkv=2, sq=4, sk=6), "causal with Sq", id="causal_sq_ne_sk"),
    pytest.param(sdpa, dict(requires_grad=True), "autograd records it", id="requires_grad"),
    pytest.param(matmul_returns_weights, {}, "used outside the attention", id="returns_weights"),
    pytest.param(matmul_buffer_mask, {}, "not recognized as causal", id="buffer_mask"),
    pytest.param(matmul_mask_under_tanh, {}, "soft-capping before the mask", id="mask_under_tanh"),
    pytest.param(matmul_sinks_kept, {}, "the scores pass through cat", id="sink_column_kept"),
    pytest.param(matmul_additive_mask, {}, "pass through add", id="additive_mask"),
    pytest.param(sdpa, dict(sq=1, sk=9), "a decode step", id="decode_step_over_cache"),
    pytest.param(sdpa_alibi_quadratic, {}, "not recognized as where(causal mask", id="alibi_quadratic"),
    pytest.param(sdpa_alibi_per_query, {}, "per-head factor along dim 2", id="alibi_per_query"),
    pytest.param(matmul_alibi_not_causal, {}, "without a causal mask", id="alibi_not_causal"),
    pytest.param(bmm_alibi_data_positions_causal, {}, "run-time positions without a mask", id="alibi_positions_causal"),
    pytest.param(sdpa_bias_not_from_positions, {}, "not recognized as where(causal mask", id="bias_tensor"),
])
def test_declines_with_reason(fn, shapes, reason, caplog):
    caplog.set_level(logging.DEBUG, logger="fx_passes")
    inputs = qkv(**shapes)
    out, code = compile_and_run(fn, inputs, grad=shapes.get("requires_grad", False))
    assert reason in caplog.text
    assert counters["attn"]["sdpa_to_attn_matched"] == 0
    assert OP not in code
    if fn is not sdpa_dropout:
        check_close(fn, inputs, out)


def run_pass_without_inductor(fn, inputs):
    """`fn(*inputs)` through Dynamo with only `sdpa_to_attn` applied to its graph, run eagerly;
    returns (output, number of rewrites, targets called by the rewritten graph)."""
    seen = []

    def backend(gm, example_inputs):
        seen.append(sdpa_to_attn.apply(gm.graph))
        gm.recompile()
        seen.append({n.target for n in gm.graph.nodes})
        return gm.forward

    out = torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    return out, *seen


@pytest.mark.parametrize("fn, shapes", [
    (matmul_permute_unsqueeze, dict(hkv=2, dtype=torch.bfloat16)),
    (matmul_logical_not, {}),
    (sdpa_hf_index_mask, {}),
    (matmul_hf_additive_mask, {}),
    (matmul_inplace_div_additive_mask, {}),
    (matmul_sinks, {}),
    (sdpa_hf_float_mask, {}),
], ids=["permute_unsqueeze_invert", "logical_not_swapaxes", "hf_index_mask", "hf_additive_mask", "inplace_div",
        "sinks", "sdpa_float_mask"])
def test_more_spellings_without_inductor(fn, shapes):
    inputs = qkv(**shapes)
    out, rewrites, targets = run_pass_without_inductor(fn, inputs)
    assert rewrites == 1 and context_attention_bhsd in targets
    assert not {"softmax", torch.softmax, torch.matmul, F.scaled_dot_product_attention} & targets
    check_close(fn, inputs, out)


@pytest.mark.parametrize("fn, window_left", [(sdpa_hf_sliding_window, 2), (matmul_hf_additive_sliding_window, 1)],
                         ids=["sdpa", "additive"])
def test_sliding_window_masks_become_window_left(fn, window_left):
    """Hugging Face's sliding-window mask (`k > q - W`, with causal) is the op's `window_left = W - 1`."""
    inputs = qkv()
    seen = []

    def backend(gm, example_inputs):
        sdpa_to_attn.apply(gm.graph)
        gm.recompile()
        seen.extend(n.kwargs.get("window_left") for n in gm.graph.nodes if n.target is context_attention_bhsd)
        return gm.forward

    out = torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    assert seen == [window_left] and inputs[0].shape[2] > window_left + 1   # the window cuts keys
    check_close(fn, inputs, out)


class Attention(torch.nn.Module):
    """A Llama-style causal self-attention block with GQA, in one of the two spellings."""

    def __init__(self, spelling, hidden=32, heads=4, kv_heads=2):
        super().__init__()
        self.spelling, self.heads, self.kv_heads, self.head_dim = spelling, heads, kv_heads, hidden // heads
        self.q_proj = torch.nn.Linear(hidden, hidden)
        self.k_proj = torch.nn.Linear(hidden, kv_heads * self.head_dim)
        self.v_proj = torch.nn.Linear(hidden, kv_heads * self.head_dim)
        self.o_proj = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        n = self.heads // self.kv_heads
        k, v = repeat_kv(k, n), repeat_kv(v, n)
        if self.spelling == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            o = matmul_causal_triu(q, k, v)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))


@pytest.mark.parametrize("spelling", ["sdpa", "matmul"])
def test_dynamic_sequence_length_compiles_once(spelling):
    model = Attention(spelling).eval()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    with fx_passes.enabled(), torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        for s in (5, 7, 9):
            x = torch.randn(2, s, 32)
            check_close(model, (x,), compiled(x))
    assert counters["attn"]["sdpa_to_attn_matched"] == 1
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.gpu
@pytest.mark.parametrize("spelling", ["sdpa", "matmul"])
def test_cuda_half_precision(spelling):
    model = Attention(spelling).cuda().half().eval()
    x = torch.randn(2, 8, 32, device="cuda", dtype=torch.float16)
    out, code = compile_and_run(model, (x,))
    assert counters["attn"]["sdpa_to_attn_matched"] == 1
    assert OP in code
    check_close(model, (x,), out)


class ScaledByAttribute(torch.nn.Module):
    """A float attribute as the scale: `dynamic=True` lifts it to a graph input (read by `.item()`)."""

    def __init__(self, spelling):
        super().__init__()
        self.spelling, self.scaling = spelling, 0.3

    def forward(self, q, k, v):
        if self.spelling == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling)
        return torch.softmax(torch.matmul(q, k.transpose(2, 3)) * self.scaling, dim=-1) @ v


@pytest.mark.parametrize("spelling", ["sdpa", "matmul"])
def test_symbolic_scale_multiplies_the_query(spelling):
    model = ScaledByAttribute(spelling)
    factors = []

    def backend(gm, example_inputs):
        assert sdpa_to_attn.apply(gm.graph) == 1
        gm.recompile()
        factors.extend(n.kwargs["q_factor"] for n in gm.graph.nodes if n.target is context_attention_bhsd)
        return gm.forward

    inputs = qkv()
    with torch.no_grad():
        out = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)(*inputs)
    assert len(factors) == 1   # torch 2.13 lifts the attribute (a q_factor); a version that specializes it, not
    check_close(model, inputs, out)


def test_soft_capping_becomes_softcap():
    inputs = qkv()
    seen = []

    def backend(gm, example_inputs):
        sdpa_to_attn.apply(gm.graph)
        gm.recompile()
        seen.extend((n.kwargs["scale"], n.kwargs["softcap"], n.kwargs["causal"]) for n in gm.graph.nodes
                    if n.target is context_attention_bhsd)
        return gm.forward

    out = torch.compile(matmul_softcap_causal, backend=backend, fullgraph=True)(*inputs)
    assert seen == [(0.25, 5.0, True)]
    check_close(matmul_softcap_causal, inputs, out)


def run_recording_slopes(fn, calls):
    """`fn` through Dynamo (automatic dynamic shapes) with `sdpa_to_attn` applied, run eagerly on
    each input tuple of `calls`; returns (outputs, the `alibi_slopes` each rewritten attention got,
    rewrites per compiled graph)."""
    slopes, rewrites = [], []

    def recording(*args, **kwargs):
        slopes.append(kwargs["alibi_slopes"])
        return context_attention_bhsd(*args, **kwargs)

    def backend(gm, example_inputs):
        rewrites.append(sdpa_to_attn.apply(gm.graph))
        for n in gm.graph.nodes:
            if n.target is context_attention_bhsd:
                n.target = recording
        gm.recompile()
        return gm.forward

    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    with torch.no_grad():
        outs = [compiled(*inputs) for inputs in calls]
    return outs, slopes, rewrites


def standard_slopes(h):
    return 2.0 ** (-8.0 / h * torch.arange(1, h + 1))


class Unbound(torch.nn.Module):
    """`fn(q, k, v)` on one `[3, B, H, S, D]` input: q, k and v share their (symbolic) sizes."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(*x.unbind(0))


@pytest.mark.parametrize("fn, slopes", [
    (sdpa_falcon_alibi, standard_slopes(4).bfloat16().float() / 4),
    (bmm_bloom_alibi, standard_slopes(4) * 2.0),
    (RelativeAlibi(), torch.tensor([0.5, 0.3, 0.2, 0.1])),
], ids=["falcon_sdpa_mask", "bloom_baddbmm", "relative_buffer"])
def test_alibi_becomes_alibi_slopes(fn, slopes):
    """The bias's slopes (times its scaling: BLOOM's `beta`, Falcon's `1 / sqrt(D)`) reach the op;
    the second length recompiles with a symbolic one."""
    model = Unbound(fn)
    calls = [(torch.randn(3, 2, 4, s, 16),) for s in (6, 9)]
    outs, seen, rewrites = run_recording_slopes(model, calls)
    assert rewrites == [1, 1] and len(seen) == 2
    for got, inputs, out in zip(seen, calls, outs):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, slopes.float())
        check_close(model, inputs, out)


def test_alibi_inductor():
    inputs = qkv()
    out, code = compile_and_run(sdpa_falcon_alibi, inputs)
    assert counters["attn"]["sdpa_to_attn_matched"] == 1
    assert OP in code and "alibi_slopes" in code
    check_close(sdpa_falcon_alibi, inputs, out)


@pytest.mark.parametrize("sq,op", [(6, OP), (1, "attn.paged_decode")], ids=["prefill", "decode"])
def test_float_input_mask_becomes_key_mask(sq, op):
    """A float mask that is a graph input: `== 0` is the op's key_mask, checked on the device."""
    inputs = (*qkv(sq=sq, sk=6, dtype=torch.bfloat16), input_mask(2, sq, 6, torch.bfloat16))
    out, code = compile_and_run(matmul_softcap_input_mask, inputs)
    assert counters["attn"]["decode_to_paged_matched" if sq == 1 else "sdpa_to_attn_matched"] == 1
    assert op in code
    check_close(matmul_softcap_input_mask, inputs, out)


@pytest.mark.parametrize("sq,op", [(6, OP), (1, "attn.paged_decode")], ids=["prefill", "decode"])
def test_alibi_of_padding_positions(sq, op):
    """BLOOM with a padding mask over a static cache: the mask built in the graph is the op's
    key_mask, the slopes its alibi_slopes; the positions from the padding mask are the key index
    less the padding on the keys each query sees (checked on the device)."""
    inputs = (*qkv(sq=sq, sk=9, dtype=torch.bfloat16), padding_mask(2, 9, 3))
    out, code = compile_and_run(bmm_bloom_padding_alibi, inputs)
    assert counters["attn"]["decode_to_paged_matched" if sq == 1 else "sdpa_to_attn_matched"] == 1
    assert op in code and "alibi_slopes" in code
    check_close(bmm_bloom_padding_alibi, inputs, out)


@pytest.mark.parametrize("sq", [6, 1], ids=["prefill", "decode"])
def test_alibi_of_padding_positions_with_a_hole_fails_the_call(sq):
    """A hole in the padding mask shifts the positions after it: not the key index plus one
    number on a query's keys, the rewrite would not be exact, the call fails."""
    padding = padding_mask(2, 9, 3)
    padding[1, 5] = 0
    with pytest.raises(RuntimeError, match="ALiBi positions"):
        compile_and_run(bmm_bloom_padding_alibi, (*qkv(sq=sq, sk=9, dtype=torch.bfloat16), padding))
    assert counters["attn"]["decode_to_paged_matched" if sq == 1 else "sdpa_to_attn_matched"] == 1


def random_keep(causal: bool):
    """A bool `[2, 1, 6, 6]` mask of random kept keys, key 0 in every row; `causal`: none after the query."""
    keep = torch.rand(2, 1, 6, 6) < 0.7
    keep[..., 0] = True
    return keep & torch.ones(6, 6, dtype=torch.bool).tril() if causal else keep


def test_alibi_with_a_causal_input_mask():
    """ALiBi with a bool mask passed in (causal, with holes): the op measures `|p - k|` from each
    query's position, the model `k`, the same up to a constant per row where no query sees a key
    after its own."""
    inputs = (*qkv(), random_keep(causal=True))
    out, code = compile_and_run(matmul_alibi_input_mask, inputs)
    assert OP in code and "alibi_slopes" in code
    check_close(matmul_alibi_input_mask, inputs, out)


def test_alibi_with_an_input_mask_past_the_query_fails_the_call():
    with pytest.raises(RuntimeError, match="a query sees a key after its position"):
        compile_and_run(matmul_alibi_input_mask, (*qkv(), random_keep(causal=False)))
    assert counters["attn"]["sdpa_to_attn_matched"] == 1


def test_float_input_mask_of_other_values_fails_the_call():
    """A mask value other than 0 and -inf would make the rewrite inexact: the call fails."""
    q, k, v = qkv(dtype=torch.bfloat16)
    mask = input_mask(2, 6, 6, torch.bfloat16)
    mask[1, 0, 3, 2] = -1.0
    with pytest.raises(RuntimeError, match="values other than 0 and -inf"):
        compile_and_run(matmul_softcap_input_mask, (q, k, v, mask))
    assert counters["attn"]["sdpa_to_attn_matched"] == 1
