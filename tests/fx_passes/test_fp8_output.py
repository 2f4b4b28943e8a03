"""`fp8_output`: static FP8 quantization of an attention output, in its spellings, becomes the
op's `out_scale`; what the op cannot take is declined with its reason."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import fx_passes
from fx_passes import PassManager
from torch_ops.testing import assert_error_ratio

E4M3 = torch.float8_e4m3fn
B, H, S, D = 2, 4, 6, 16
SCALE = 0.01


def attention(q, k, v):
    """`[B, S, H * D]` causal attention output, as an o_proj would read it."""
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return o.transpose(1, 2).reshape(B, S, H * D)


def div_clamp_to(q, k, v, scale):
    return (attention(q, k, v) / scale).clamp(-448, 448).to(E4M3)


def torch_clamp_float_scale(q, k, v, scale):
    return torch.clamp(attention(q, k, v) / SCALE, min=-448.0, max=448.0).to(dtype=E4M3)


def clamp_min_max_finfo(q, k, v, scale):
    m = torch.finfo(E4M3).max
    return (attention(q, k, v) / scale).clamp_max(m).clamp_min(-m).to(E4M3)


def explicit_op(q, k, v, scale):
    """An explicit `attn::context_attention` call on packed `[T, H, D]` tensors."""
    packed = [x.transpose(1, 2).reshape(B * S, H, D) for x in (q, k, v)]
    cu = torch.arange(B + 1, dtype=torch.int32) * S
    out, _ = torch.ops.attn.context_attention(*packed, cu, cu, causal=True)
    return (out.view(B, S, H * D) / scale).clip(-448, 448).to(E4M3)


def scale_made_inline(q, k, v, scale):
    """The scale tensor made after the attention (Dynamo records it at its first use)."""
    o = attention(q, k, v)
    return (o / torch.tensor(SCALE)).clamp(-448, 448).to(E4M3)


def also_used_unquantized(q, k, v, scale):
    o = attention(q, k, v)
    return (o / scale).clamp(-448, 448).to(E4M3), o.sum()


def other_bounds(q, k, v, scale):
    return (attention(q, k, v) / scale).clamp(-400, 400).to(E4M3)


def bf16_scale(q, k, v, scale):
    return (attention(q, k, v) / scale.bfloat16()).clamp(-448, 448).to(E4M3)


def run(fn, args):
    """`fn` through Dynamo with the passes applied to its graph, run eagerly (no Inductor)."""
    def backend(gm, example_inputs):
        PassManager()(gm.graph)
        gm.recompile()
        return gm.forward

    with torch.no_grad():
        return torch.compile(fn, backend=backend, fullgraph=True)(*args)


def inputs():
    return (*(torch.randn(B, H, S, D) for _ in range(3)), torch.tensor(SCALE))


def check_fp8(out, args):
    """FP8 `out` against the float64 attention / scale: at most twice eager's error (one FP8
    rounding) plus the FP8 rounding floor."""
    q, k, v, scale = args
    truth = (attention(*(x.double() for x in (q, k, v))) / SCALE).clamp(-448, 448)
    eager = div_clamp_to(q, k, v, scale).double()
    floor = 2 * (truth.to(E4M3).double() - truth).abs().max().item()
    assert out.dtype == E4M3
    assert_error_ratio(out.double(), truth, eager, floor=floor, name="fp8 out")


@pytest.mark.parametrize("fn", [div_clamp_to, torch_clamp_float_scale, clamp_min_max_finfo, scale_made_inline,
                                explicit_op])
def test_fused(fn):
    args = inputs()
    check_fp8(run(fn, args), args)
    assert counters["attn"]["fp8_output_matched"] == 1


@pytest.mark.parametrize("fn, reason", [
    (also_used_unquantized, "also used outside the quantization"),
    (other_bounds, "not the e4m3 range"),
    (bf16_scale, "not one fp32 element"),
])
def test_declined_with_reason(fn, reason, caplog):
    caplog.set_level(logging.DEBUG, logger="fx_passes")
    args = inputs()
    out = run(fn, args)
    want = fn(*args)
    assert reason in caplog.text
    assert counters["attn"]["fp8_output_matched"] == 0 and counters["attn"]["fp8_output_declined"] == 1
    first = out[0] if isinstance(out, tuple) else out
    expected = want[0] if isinstance(want, tuple) else want
    assert first.dtype == E4M3 and (first.float() - expected.float()).abs().max() <= 0.125 * 448


def test_inductor_module_with_scale_buffer():
    """A module whose FP8 scale is a buffer, through Inductor: the op gets `out_scale`."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.tensor(SCALE))

        def forward(self, q, k, v):
            return div_clamp_to(q, k, v, self.scale)

    args = inputs()
    with fx_passes.enabled(), torch.no_grad():
        out, code = run_and_get_code(torch.compile(Block(), fullgraph=True), *args[:3])
    assert "out_scale" in "\n".join(code)
    assert counters["attn"]["fp8_output_matched"] == 1
    check_fp8(out, args)


def test_literal_scales_become_one_constant():
    """Two attentions quantized with a number and with `torch.tensor(number)` share one
    `out_scale` constant made at the start of the graph (not a tensor made per layer)."""
    graphs = []

    def backend(gm, example_inputs):
        PassManager()(gm.graph)
        gm.recompile()
        graphs.append(gm.graph)
        return gm.forward

    def two_layers(q, k, v, scale):
        return torch_clamp_float_scale(q, k, v, scale), scale_made_inline(q, k, v, scale)

    args = inputs()
    with torch.no_grad():
        outs = torch.compile(two_layers, backend=backend, fullgraph=True)(*args)
    for out in outs:
        check_fp8(out, args)
    scales = {n.kwargs["out_scale"] for n in graphs[0].nodes if "out_scale" in n.kwargs}
    assert len(scales) == 1
    (scale,) = scales
    assert scale.target is torch.tensor and scale.args == (SCALE,) and scale.kwargs["dtype"] == torch.float32
