"""`decode_to_paged`: one query over a `[B, H, S, D]` KV cache (a static cache's decode step)
compiles onto `attn::paged_decode` reading the cache in place, with the numerics of eager; what
it cannot prove or serve is declined with its reason and compiles as before."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import fx_passes
from torch_ops.testing import assert_error_ratio

from .test_sdpa_to_attn import repeat_kv

OP = "attn.paged_decode"
CAPACITY, WINDOW = 40, 8


class StaticCacheDecode(torch.nn.Module):
    """Hugging Face's static-cache decode step in miniature: write the new k/v at the filled
    length, advance it, attend over the whole cache with the mask `key <= position`."""

    def __init__(self, spelling="repeat_kv", mask="prefix", b=2, hkv=2, d=16, filled=23, dtype=torch.bfloat16,
                 device="cpu"):
        super().__init__()
        self.spelling, self.mask = spelling, mask
        self.register_buffer("k_cache", torch.randn(b, hkv, CAPACITY, d, dtype=dtype, device=device))
        self.register_buffer("v_cache", torch.randn(b, hkv, CAPACITY, d, dtype=dtype, device=device))
        self.register_buffer("length", torch.tensor([filled], device=device))

    def forward(self, q, k, v):
        b, hq = q.shape[:2]
        position = torch.arange(1, device=q.device) + self.length
        keys = torch.arange(CAPACITY, device=q.device)[None, None, None, :]
        mask = keys <= position[None, None, :, None]
        if self.mask.startswith("window"):
            mask = mask & (keys > position[None, None, :, None] - WINDOW)
        self.k_cache.index_copy_(2, position, k)
        self.v_cache.index_copy_(2, position, v)
        self.length.add_(1)
        mask = None if self.mask == "none" else mask.expand(b, hq if self.mask == "window_per_head" else -1, 1, CAPACITY)
        n = hq // self.k_cache.shape[1]
        if self.spelling == "repeat_kv":
            k, v = repeat_kv(self.k_cache, n), repeat_kv(self.v_cache, n)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
        if self.spelling == "enable_gqa":
            return F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)
        return F.scaled_dot_product_attention(q, repeat_kv(self.k_cache, n), repeat_kv(self.v_cache, n),
                                              is_causal=True)


def step_inputs(b=2, hq=4, hkv=2, d=16, dtype=torch.bfloat16, device="cpu"):
    return tuple(torch.randn(b, h, 1, d, dtype=dtype, device=device) for h in (hq, hkv, hkv))


def truth(model: StaticCacheDecode, q: torch.Tensor) -> torch.Tensor:
    """The step's attention in float64 over `model`'s cache after the step (keys < length)."""
    n = q.shape[1] // model.k_cache.shape[1]
    keys = torch.arange(CAPACITY, device=q.device).view(1, 1, 1, CAPACITY)
    visible = keys < (1 if model.spelling == "causal" else model.length)  # is_causal: top-left, key 0 only
    if model.mask.startswith("window"):
        visible = visible & (keys >= model.length - WINDOW)
    k, v = (repeat_kv(c.double(), n) for c in (model.k_cache, model.v_cache))
    none = model.mask == "none" and model.spelling != "causal"
    return F.scaled_dot_product_attention(q.double(), k, v, attn_mask=None if none else visible,
                                          scale=0.3 if model.spelling == "repeat_kv" else None)


def run_steps(model: StaticCacheDecode, steps=3):
    """`steps` calls of one compiled graph, each checked against an eager twin that keeps its
    own copy of the cache; returns the generated code of the first call."""
    twin = StaticCacheDecode(model.spelling, model.mask, dtype=model.k_cache.dtype, device=model.k_cache.device)
    twin.load_state_dict(model.state_dict())
    codes = []
    with fx_passes.enabled(), torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        compiled = torch.compile(model, fullgraph=True)
        for _ in range(steps):
            inputs = step_inputs(dtype=model.k_cache.dtype, device=model.k_cache.device)
            if codes:
                out = compiled(*inputs)
            else:
                out, code = run_and_get_code(compiled, *inputs)
                codes.append("\n".join(code))
            eager = twin(*inputs)
            assert_error_ratio(out, truth(twin, inputs[0]), eager)
    assert torch.equal(model.k_cache, twin.k_cache) and torch.equal(model.length, twin.length)
    return codes[0]


@pytest.mark.parametrize("spelling,mask", [("repeat_kv", "prefix"), ("enable_gqa", "prefix"), ("repeat_kv", "none"),
                                           ("repeat_kv", "window")])
def test_static_cache_steps_onto_paged_decode(spelling, mask):
    """The length advances at run time in one graph; the cache is read in place (no repeat). A
    mask that is not a prefix of the keys (a sliding window) goes to the op as `key_mask`."""
    code = run_steps(StaticCacheDecode(spelling, mask))
    assert counters["attn"]["decode_to_paged_matched"] == 1
    assert OP in code


@pytest.mark.gpu
def test_static_cache_steps_cuda():
    """On CUDA the rewritten step runs the Triton paged_decode kernel (one page per sequence)."""
    code = run_steps(StaticCacheDecode(device="cuda"))
    assert counters["attn"]["decode_to_paged_matched"] == 1
    assert OP in code


@pytest.mark.parametrize("spelling,mask,dtype,reason", [
    ("causal", "none", torch.bfloat16, "is_causal=True with one query"),
    ("repeat_kv", "window_per_head", torch.bfloat16, "neither a bool mask shared by the heads"),
    ("repeat_kv", "prefix", torch.float32, "paged_decode rejects the inputs"),
], ids=["is_causal", "mask_per_head", "float32"])
def test_declines_with_reason(spelling, mask, dtype, reason, caplog):
    caplog.set_level(logging.DEBUG, logger="fx_passes")
    code = run_steps(StaticCacheDecode(spelling, mask, dtype=dtype), steps=2)
    assert reason in caplog.text
    assert counters["attn"]["decode_to_paged_matched"] == 0
    assert OP not in code


def two_layer_step(q, k1, v1, k2, v2):
    """Two decode attentions over two caches of every key (no mask), as in two model layers."""
    a = F.scaled_dot_product_attention(q, k1, v1, enable_gqa=True)
    return F.scaled_dot_product_attention(a, k2, v2, enable_gqa=True)


@pytest.mark.parametrize("dynamic", [False, True])
def test_static_batch_tables_are_shared(dynamic):
    """With a static batch and cache length, every layer's op reads one block table and one
    length tensor made once at the start of the graph (`arange`, `full`: no constants); with a
    dynamic batch each op makes them."""
    graphs = []

    def backend(gm, example_inputs):
        fx_passes.PassManager()(gm.graph)
        gm.recompile()
        graphs.append(gm.graph)
        return gm.forward

    q = torch.randn(3, 4, 1, 16, dtype=torch.bfloat16)
    caches = [torch.randn(3, 2, 11, 16, dtype=torch.bfloat16) for _ in range(4)]
    if dynamic:
        for t in (q, *caches):
            torch._dynamo.mark_dynamic(t, 0)
    with torch.no_grad():
        out = torch.compile(two_layer_step, backend=backend, fullgraph=True)(q, *caches)
    ops = [n for n in graphs[0].nodes if n.target is fx_passes.replacements.paged_decode_bhsd]
    assert len(ops) == 2
    assert not any(n.target is torch.tensor for n in graphs[0].nodes)
    if dynamic:
        assert not any("block_tables" in op.kwargs for op in ops)
    else:
        tables = {op.kwargs["block_tables"] for op in ops}
        lengths = {op.kwargs["seq_lens"] for op in ops}
        assert len(tables) == len(lengths) == 1
        (table,), (length,) = tables, lengths
        assert table.target == "view" and table.args[0].target is torch.arange and length.target is torch.full
    truth = two_layer_step(*(t.double() for t in (q, *caches)))
    assert_error_ratio(out, truth, two_layer_step(q, *caches))
