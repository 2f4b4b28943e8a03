"""`sdpa_to_attn` with ALiBi biases and key masks: slopes times key positions become the op's
`alibi_slopes`, masks of any pattern its `key_mask` (float ones checked on the device); what the
rewrite cannot serve exactly is declined, or fails the call where only the data can tell."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from fx_passes import sdpa_to_attn
from fx_passes.replacements import context_attention_bhsd

from .test_sdpa_to_attn import OP, check_close, check_declined, compile_and_run, hf_additive_mask, hf_index_mask, qkv


def alibi_slopes(h, device):
    """BLOOM's and Falcon's slopes for `h` heads (a power of two), as they compute them."""
    powers = torch.arange(1, h + 1, device=device, dtype=torch.int32)
    return torch.pow(torch.full((), 2 ** (-8 / h), device=device), powers)


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
    probs = F.softmax(scores.view(b, h, sq, -1) + padded_causal_mask(padding, sq, q.dtype), dim=-1,
                      dtype=torch.float32).to(q.dtype)
    return torch.bmm(probs.view(b * h, sq, -1), v.reshape(b * h, -1, d)).view(b, h, sq, d)


def padded_causal_mask(padding, sq, dtype):
    """`[B, 1, Sq, Sk]`: 0 where query i (at key position Sk - Sq + i) sees key k (`k` up to its
    position, `padding[b, k]` set), `finfo.min` elsewhere."""
    b, sk = padding.shape
    batch, key = torch.arange(b, device=padding.device)[:, None, None, None], torch.arange(sk, device=padding.device)
    keep = (key <= torch.arange(sk - sq, sk, device=padding.device)[:, None]) & padding.bool()[batch, key]
    return torch.where(keep, torch.zeros((), dtype=dtype, device=padding.device), torch.finfo(dtype).min)


def falcon_alibi_mask(q, k, padding):
    """Falcon's SDPA mask for a 0/1 padding mask `padding [B, Sk]`: bfloat16 slopes times the
    positions `(cumsum(padding) - 1) * padding`, over sqrt(D), folded into the padded causal mask
    (masked where it is below -1); the queries are the last Sq keys."""
    b, h, sq, d = q.shape
    sk = k.shape[2]
    positions = ((padding.cumsum(dim=-1) - 1) * padding)[:, None, :]
    alibi = (alibi_slopes(h, q.device)[..., None].bfloat16() * positions).reshape(b * h, 1, sk).to(q.dtype)
    alibi = alibi.reshape(b, -1, *alibi.shape[1:])
    return torch.masked_fill(alibi / math.sqrt(d), padded_causal_mask(padding, sq, q.dtype) < -1,
                             torch.finfo(q.dtype).min)


def sdpa_falcon_padding_alibi(q, k, v, padding):
    """Falcon with a 0/1 padding mask (`falcon_alibi_mask`)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=falcon_alibi_mask(q, k, padding))


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


@pytest.mark.parametrize("fn, reason", [
    pytest.param(sdpa_alibi_quadratic, "not recognized as where(causal mask", id="alibi_quadratic"),
    pytest.param(sdpa_alibi_per_query, "per-head factor along dim 2", id="alibi_per_query"),
    pytest.param(matmul_alibi_not_causal, "without a causal mask", id="alibi_not_causal"),
    pytest.param(bmm_alibi_data_positions_causal, "run-time positions without a mask", id="alibi_positions_causal"),
    pytest.param(sdpa_bias_not_from_positions, "not recognized as where(causal mask", id="bias_tensor"),
])
def test_declines_with_reason(fn, reason, caplog):
    check_declined(fn, {}, reason, caplog)


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


def two_layers_input_mask(q, k, v, mask):
    """Two attention layers over one float mask input, as every layer of a model gets it."""
    return matmul_softcap_input_mask(matmul_softcap_input_mask(q, k, v, mask), k, v, mask)


@pytest.mark.parametrize("sq", [6, 1], ids=["prefill", "decode"])
def test_layers_share_the_input_mask_check(sq):
    """The float mask's conversion to key_mask and its device check run once, not once per layer."""
    inputs = (*qkv(sq=sq, sk=6, hq=2, hkv=2, dtype=torch.bfloat16), input_mask(2, sq, 6, torch.bfloat16))
    out, code = compile_and_run(two_layers_input_mask, inputs)
    assert counters["attn"]["decode_to_paged_matched" if sq == 1 else "sdpa_to_attn_matched"] == 2
    assert code.count("holds values other than 0 and -inf") == 1, code
    check_close(two_layers_input_mask, inputs, out)


@pytest.mark.parametrize("fn", [bmm_bloom_padding_alibi, sdpa_falcon_padding_alibi], ids=["bloom", "falcon"])
@pytest.mark.parametrize("sq,op", [(6, OP), (1, "attn.paged_decode")], ids=["prefill", "decode"])
def test_alibi_of_padding_positions(fn, sq, op):
    """BLOOM and Falcon with a padding mask over a static cache: the mask built in the graph is
    the op's key_mask, the slopes its alibi_slopes; the positions from the padding mask are the
    key index less the padding on the keys each query sees (checked on the device)."""
    inputs = (*qkv(sq=sq, sk=9, dtype=torch.bfloat16), padding_mask(2, 9, 3))
    out, code = compile_and_run(fn, inputs)
    assert counters["attn"]["decode_to_paged_matched" if sq == 1 else "sdpa_to_attn_matched"] == 1
    assert op in code and "alibi_slopes" in code
    check_close(fn, inputs, out)


@pytest.mark.parametrize("fn", [bmm_bloom_padding_alibi, sdpa_falcon_padding_alibi], ids=["bloom", "falcon"])
@pytest.mark.parametrize("sq", [6, 1], ids=["prefill", "decode"])
def test_alibi_of_padding_positions_with_a_hole_fails_the_call(fn, sq):
    """A hole in the padding mask shifts the positions after it: not the key index plus one
    number on a query's keys, the rewrite would not be exact, the call fails."""
    padding = padding_mask(2, 9, 3)
    padding[1, 5] = 0
    with pytest.raises(RuntimeError, match="ALiBi positions"):
        compile_and_run(fn, (*qkv(sq=sq, sk=9, dtype=torch.bfloat16), padding))
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


def two_layers_bloom(q, k, v, padding):
    """Two layers of `bmm_bloom_padding_alibi` over one set of positions, ALiBi and mask (as BLOOM
    builds them once per forward)."""
    b, h, sq, d = q.shape
    sk = k.shape[2]
    positions = ((padding.cumsum(-1) - 1) * padding)[:, None, :]
    alibi = (alibi_slopes(h, q.device)[..., None] * positions).reshape(b * h, 1, sk).to(q.dtype)
    mask = padded_causal_mask(padding, sq, q.dtype)
    for _ in range(2):
        scores = alibi.baddbmm(batch1=q.reshape(b * h, -1, d), batch2=k.reshape(b * h, -1, d).transpose(-1, -2),
                               beta=1.0, alpha=d ** -0.5)
        probs = F.softmax(scores.view(b, h, sq, -1) + mask, dim=-1, dtype=torch.float32).to(q.dtype)
        q = torch.bmm(probs.view(b * h, sq, -1), v.reshape(b * h, -1, d)).view(b, h, sq, d)
    return q


def two_layers_falcon(q, k, v, padding):
    """Two layers of `sdpa_falcon_padding_alibi` over one ALiBi mask (as Falcon builds it once)."""
    mask = falcon_alibi_mask(q, k, padding)
    for _ in range(2):
        q = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return q


@pytest.mark.parametrize("model", [two_layers_bloom, two_layers_falcon], ids=["bloom", "falcon"])
@pytest.mark.parametrize("sq", [6, 1], ids=["prefill", "decode"])
def test_layers_share_the_alibi_check(model, sq):
    """Layers over one padding mask and its ALiBi positions check them on the device once, not
    once per layer."""
    inputs = (*qkv(sq=sq, sk=9, hq=4, hkv=4, dtype=torch.bfloat16), padding_mask(2, 9, 3))
    out, code = compile_and_run(model, inputs)
    assert counters["attn"]["decode_to_paged_matched" if sq == 1 else "sdpa_to_attn_matched"] == 2
    assert code.count("a query sees a key after its position") == 1, code
    check_close(model, inputs, out)
