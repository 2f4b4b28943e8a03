"""The hand-written paged Llama (`examples/llama_paged.py`) under `torch.compile(fullgraph=True,
dynamic=True)` with the passes: each layer's RoPE moves into its `attn::kv_cache_write` (the
key's and the paged attention's query), one graph serves three prefill lengths, and the logits
match the plain formulation."""

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

import fx_passes

_spec = importlib.util.spec_from_file_location(
    "llama_paged", Path(__file__).resolve().parents[2] / "examples" / "llama_paged.py")
llama_paged = sys.modules["llama_paged"] = importlib.util.module_from_spec(_spec)   # dataclasses look it up
_spec.loader.exec_module(llama_paged)

CONFIG = llama_paged.Config(vocab=64, hidden=64, layers=2, heads=4, kv_heads=2, ffn=96)
# Under dynamic=True Dynamo first traces RMSNorm's float eps as a symbol, then restarts the
# analysis with it specialized: the passes would run (and count) on both traces. Specialized
# from the start, each graph is traced and rewritten once.
DYNAMO_CONFIG = {"specialize_float": True}


@pytest.fixture
def model():
    return llama_paged.Llama(CONFIG).to(torch.bfloat16).eval()


def random_prompts(lengths):
    return [torch.randint(0, CONFIG.vocab, (n,)).tolist() for n in lengths]


def test_prefill_compiles_once_with_rope_in_the_cache_write(model):
    model64 = copy.deepcopy(model).double()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    with fx_passes.enabled(), torch.no_grad(), torch._dynamo.config.patch(**DYNAMO_CONFIG, error_on_recompile=True):
        for lengths in ((5, 9), (7, 3), (12, 6)):
            server = llama_paged.Server(model, "cpu", num_blocks=16, block_size=4)
            prompts = random_prompts(lengths)
            server.check(server.step(prompts, compiled), prompts, model64)
    assert counters["stats"]["unique_graphs"] == 1
    assert counters["attn"]["rope_into_kv_cache_write"] == CONFIG.layers
    assert counters["attn"]["rope_query_into_kv_cache_write"] == CONFIG.layers
    assert counters["attn"]["rope_fusion_declined"] == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_decode_steps_after_a_prefill(model, device):
    model = model.to(device)
    model64 = copy.deepcopy(model).double()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    server = llama_paged.Server(model, torch.device(device), num_blocks=16, block_size=4)
    new = random_prompts((6, 2, 9))
    with fx_passes.enabled(), torch.no_grad(), torch._dynamo.config.patch(**DYNAMO_CONFIG):
        for _ in range(3):
            logits = server.step(new, compiled)
            server.check(logits, new, model64)
            new = [[t] for t in torch.randint(0, CONFIG.vocab, (3,)).tolist()]
    assert counters["stats"]["unique_graphs"] == 2     # prefill and decode
    assert counters["attn"]["rope_query_into_kv_cache_write"] == 2 * CONFIG.layers
