"""`sdpa_to_attn`: each spelling of attention compiles onto `attn::context_attention` with the
numerics of eager; what the op cannot serve is declined with its reason and compiles as before.
ALiBi biases and key masks: test_sdpa_to_attn_alibi.py."""

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


def hf_additive_mask(b, s, dtype, device):
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(hf_index_mask(b, s, device), zero, torch.finfo(dtype).min)


def sdpa_hf_float_mask(q, k, v):
    """Hugging Face's eager mask (`where(causal, 0, min)`) given to SDPA: a float causal mask."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=hf_additive_mask(q.shape[0], q.shape[2], q.dtype, q.device))


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


@pytest.mark.parametrize("fn, shapes", [(sdpa, dict(sq=5, sk=7)), (sdpa_causal_scale, {}),
                                        (sdpa_repeat_kv, dict(hkv=2, dtype=torch.bfloat16)),
                                        (matmul_hf_eager, dict(hkv=2, dtype=torch.bfloat16))],
                         ids=["sdpa", "sdpa_causal_scale", "sdpa_repeat_kv", "matmul_hf_eager"])
def test_values_of_their_own_head_dim(fn, shapes):
    """Values of 8 dims under queries and keys of 16 (MLA prefill over decompressed keys and
    values): the op's `D_v`, its output `[B, Hq, S, 8]`."""
    inputs = qkv(**shapes, dv=8)
    out, code = compile_and_run(fn, inputs)
    assert counters["attn"]["sdpa_to_attn_matched"] == 1
    assert OP in code and out.shape[-1] == 8
    check_close(fn, inputs, out)


@pytest.mark.parametrize("fn, shapes, reason", [
    pytest.param(sdpa_mask_per_head, {}, "nor a bool mask shared by the heads", id="mask_per_head"),
    pytest.param(sdpa_dropout, {}, "dropout_p", id="dropout"),
    pytest.param(sdpa, dict(dtype=torch.float64), "dtypes", id="float64"),
    pytest.param(sdpa_gqa, dict(hkv=2, sq=4, sk=6), "causal with Sq", id="causal_sq_ne_sk"),
    pytest.param(sdpa, dict(requires_grad=True), "autograd records it", id="requires_grad"),
    pytest.param(matmul_returns_weights, {}, "used outside the attention", id="returns_weights"),
    pytest.param(matmul_buffer_mask, {}, "not recognized as causal", id="buffer_mask"),
    pytest.param(matmul_mask_under_tanh, {}, "soft-capping before the mask", id="mask_under_tanh"),
    pytest.param(matmul_sinks_kept, {}, "the scores pass through cat", id="sink_column_kept"),
    pytest.param(matmul_additive_mask, {}, "pass through add", id="additive_mask"),
    pytest.param(sdpa, dict(sq=1, sk=9), "a decode step", id="decode_step_over_cache"),
])
def test_declines_with_reason(fn, shapes, reason, caplog):
    check_declined(fn, shapes, reason, caplog)


def check_declined(fn, shapes, reason, caplog):
    """`fn` on `qkv(**shapes)` compiles without the op, logs `reason`, and matches eager."""
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
