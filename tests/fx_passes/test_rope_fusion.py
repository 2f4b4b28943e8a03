"""`rope_fusion`: rotary embeddings of q and k in every spelling move into the attention op
(`attn::context_attention`'s RoPE) with the numerics of eager; other rotations are declined with
their reason and left as they are. (The cache-write fusion: `test_llama_paged.py`.)"""

import logging
import operator

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import fx_passes
from fx_passes import PassManager
from fx_passes.replacements import context_attention_bhsd
from torch_ops.testing import assert_error_ratio

B, H, S, D = 2, 4, 7, 16


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):
    return torch.stack((-x[:, :, :, 1::2], x[:, :, :, ::2]), dim=-1).flatten(-2)


def neox_tables(positions, rot, scaling=1.0):
    """Hugging Face Llama's rotary embedding: `[B, S, rot]` cos and sin, each half repeated."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rot, 2, dtype=torch.float32, device=positions.device) / rot)
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def gptj_tables(positions, rot):
    """GPT-J's: sin/cos `[B, S, rot/2]` gathered from one table, repeated pairwise at use."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rot, 2, dtype=torch.float32, device=positions.device) / rot)
    table = torch.arange(64, dtype=torch.float32, device=positions.device)[:, None] * inv_freq
    sincos = torch.cat([table.sin(), table.cos()], dim=-1)[positions]
    return torch.split(sincos, rot // 2, dim=-1)


# Spellings fused. Each takes q, k, v [B, H, S, D] and positions [B, S].


def llama_full(q, k, v, positions):
    cos, sin = (t.unsqueeze(1).to(q.dtype) for t in neox_tables(positions, D, scaling=1.0))
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def neox_partial_swapped_operands(q, k, v, positions):
    cos, sin = (t.unsqueeze(1) for t in neox_tables(positions, D // 2))
    r = cos.shape[-1]
    q = torch.cat([sin * rotate_half(q[..., :r]) + cos * q[..., :r], q[..., r:]], dim=-1)
    k = torch.cat([sin * rotate_half(k[..., :r]) + cos * k[..., :r], k[..., r:]], dim=-1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def gptj_partial_bshd(q, k, v, positions):
    """GPT-J: rotation in [B, S, H, D] before the permute to [B, H, S, D]; matmul attention."""
    sin, cos = gptj_tables(positions, D // 2)
    sin, cos = (torch.repeat_interleave(t[:, :, None, :], 2, 3) for t in (sin, cos))
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    r = D // 2
    q = torch.cat([q[:, :, :, :r] * cos + rotate_every_two(q[:, :, :, :r]) * sin, q[:, :, :, r:]], dim=-1)
    k = torch.cat([k[:, :, :, :r] * cos + rotate_every_two(k[:, :, :, :r]) * sin, k[:, :, :, r:]], dim=-1)
    q, k = q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) / 4.0
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)
    return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1).to(v.dtype) @ v


# Declined.


def table_not_repeated(q, k, v, positions):
    cos, sin = (t.unsqueeze(1) for t in neox_tables(positions, D))
    cos = cos * torch.linspace(0.9, 1.0, D)    # different values in the two halves
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def different_tables(q, k, v, positions):
    cos, sin = (t.unsqueeze(1) for t in neox_tables(positions, D))
    cos2, sin2 = (t.unsqueeze(1) for t in neox_tables(positions + 1, D))
    q, k = q * cos + rotate_half(q) * sin, k * cos2 + rotate_half(k) * sin2
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def only_query_rotated(q, k, v, positions):
    cos, sin = (t.unsqueeze(1) for t in neox_tables(positions, D))
    return F.scaled_dot_product_attention(q * cos + rotate_half(q) * sin, k, v, is_causal=True)


def inputs(dtype=torch.float32):
    positions = torch.arange(S).expand(B, S) + torch.randint(0, 20, (B, 1))   # < 64 rows of gptj_tables
    return (*(torch.randn(B, H, S, D, dtype=dtype) for _ in range(3)), positions)


def passes_then_eager(fn, args):
    """`fn(*args)` through Dynamo, the installed passes applied to its graph, run eagerly (no
    Inductor); returns (output, targets called by the rewritten graph)."""
    targets = set()

    def backend(gm, example_inputs):
        PassManager()(gm.graph)
        gm.recompile()
        targets.update(n.target for n in gm.graph.nodes)
        return gm.forward

    with torch.no_grad():
        return torch.compile(fn, backend=backend, fullgraph=True, dynamic=True)(*args), targets


def check_close(fn, args, out):
    with torch.no_grad():
        truth = fn(*(a.double() if a.is_floating_point() else a for a in args))
        assert_error_ratio(out, truth, fn(*args))


@pytest.mark.parametrize("fn", [llama_full, neox_partial_swapped_operands, gptj_partial_bshd])
def test_fused(fn):
    args = inputs()
    out, targets = passes_then_eager(fn, args)
    assert counters["attn"]["rope_into_context_attention"] == 1
    assert context_attention_bhsd in targets and operator.neg not in targets   # no rotation left
    check_close(fn, args, out)


@pytest.mark.parametrize("fn, reason", [
    (table_not_repeated, "not provably pair-repeated"),
    (different_tables, "different tables"),
    (only_query_rotated, "only one of query and key"),
])
def test_declined_with_reason(fn, reason, caplog):
    caplog.set_level(logging.DEBUG, logger="fx_passes")
    args = inputs()
    out, targets = passes_then_eager(fn, args)
    assert reason in caplog.text
    assert counters["attn"]["rope_fusion_matched"] == 0 and counters["attn"]["rope_fusion_declined"] == 1
    assert counters["attn"]["sdpa_to_attn_matched"] == 1     # the attention is still rewritten
    check_close(fn, args, out)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_inductor_bf16_one_op(device):
    """Through Inductor: the generated code calls the op with RoPE arguments; bf16 numerics."""
    args = tuple(a.to(device) for a in inputs(torch.bfloat16))
    with fx_passes.enabled(), torch.no_grad():
        out, code = run_and_get_code(torch.compile(llama_full, fullgraph=True), *args)
    assert "attn.context_attention" in "\n".join(code) and "cos_sin_cache" in "\n".join(code)
    assert counters["attn"]["rope_fusion_matched"] == 1
    check_close(llama_full, args, out)
