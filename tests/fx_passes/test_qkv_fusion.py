"""`qkv_fusion`: the q/k/v projections of one input become one GEMM and a split, with the
weights concatenated once at compile time (freezing), never per call; declined without freezing."""

import copy
import logging
import re

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import fx_passes
from torch_ops.testing import assert_error_ratio

from .test_sdpa_to_attn import Attention, check_close


GEMMS = ("extern_kernels.mm(", "extern_kernels.addmm(", "aten.mm.default(", "aten.addmm.default(",
         "mkl._mkl_linear.default(", "mkldnn._linear_pointwise.default(")


def gemm_calls(code):
    """GEMM launches in Inductor's generated code (CPU: MKL/oneDNN packed linear; CUDA: extern mm)."""
    lines = [line for line in code.splitlines() if not line.lstrip().startswith("#")]
    return sum(line.count(g) for line in lines for g in GEMMS)


def compile_block(bias, *, freezing):
    model = Attention("sdpa").eval()
    if not bias:
        for proj in (model.q_proj, model.k_proj, model.v_proj):
            proj.bias = None
    x = torch.randn(2, 6, 32)
    with fx_passes.enabled(), torch.no_grad(), inductor_config.patch(freezing=freezing):
        out, code = run_and_get_code(torch.compile(model, fullgraph=True), x)
    return model, x, out, "\n".join(code)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_fuses_gqa_projections_with_weights_folded(bias):
    model, x, out, code = compile_block(bias, freezing=True)
    assert counters["attn"]["qkv_fusion_matched"] == 1
    assert counters["attn"]["sdpa_to_attn_matched"] == 1
    check_close(model, (x,), out)
    # Generated code: the concatenated weight is one frozen constant; no cat kernel runs per call,
    # and two GEMMs remain (qkv and o_proj) instead of four.
    assert not re.search(r"(^|[_.\s])cat([_.(\s]|$)", code), code
    assert gemm_calls(code) == 2, code


def test_declined_without_freezing(caplog):
    caplog.set_level(logging.DEBUG, logger="fx_passes")
    model, x, out, code = compile_block(True, freezing=False)
    assert "freezing is off" in caplog.text
    assert counters["attn"]["qkv_fusion_matched"] == 0
    check_close(model, (x,), out)


def test_hf_llama():
    """Both layers of a tiny Hugging Face Llama (GQA, no bias): fused, and logits as eager's.
    Dynamo and the passes only (no Inductor C++ compile); freezing is only read by the pass."""
    hf = pytest.importorskip("tests.fx_passes.test_hf_models", reason="transformers is not installed")
    model = hf.llama("sdpa").eval()
    ids = torch.randint(0, hf.VOCAB, (2, 7))
    ops = []
    with fx_passes.enabled(), torch.no_grad(), inductor_config.patch(freezing=True):
        out = torch.compile(model, fullgraph=True, backend=hf.passes_then_eager(ops))(ids, use_cache=False).logits
    assert counters["attn"]["qkv_fusion_matched"] == 2
    assert counters["attn"]["sdpa_to_attn_matched"] == 2
    with torch.no_grad():
        truth = copy.deepcopy(model).double()(ids, use_cache=False).logits
        assert_error_ratio(out, truth, model(ids, use_cache=False).logits)
