"""The hand-written paged Llama (`examples/llama_paged.py`) under `torch.compile(fullgraph=True,
dynamic=True)` with the passes: each layer's RoPE moves into its `attn::kv_cache_write` (the
key's and the paged attention's query), one graph serves three prefill lengths, and the logits
match the plain formulation."""

import copy
import importlib.util
import sys
from pathlib import Path

import expecttest
import pytest
import torch
from torch._dynamo.utils import counters

import fx_passes
from fx_passes import PassManager

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


def attn_calls(graph) -> str:
    """The `attn` ops of a graph, one per line, with what feeds their query and RoPE arguments."""
    lines = []
    for node in graph.nodes:
        if str(node.target).startswith("attn."):
            query = node.kwargs.get("query") if "kv_cache_write" in str(node.target) else node.args[0]
            feeds = ""
            if query is not None:
                feeds = f" query<-{query.target if isinstance(query.target, str) else query.target.__name__}"
            table = node.kwargs.get("cos_sin_cache")
            rope = f" rope={'neox' if node.kwargs['rope_neox'] else 'gptj'}/{table.meta['example_value'].shape[1]}" \
                if table is not None else ""
            lines.append(f"{node.target}{rope}{feeds}")
    return "\n".join(lines)


class TestRewrittenGraph(expecttest.TestCase):
    def test_op_sequence(self):
        """Per layer: one cache write that rotates the key and the query, then the paged
        attention reading the rotated query it returned."""
        graphs = []

        def backend(gm, example_inputs):
            PassManager()(gm.graph)
            graphs.append(attn_calls(gm.graph))
            return gm.forward

        model = llama_paged.Llama(CONFIG).to(torch.bfloat16).eval()
        server = llama_paged.Server(model, "cpu", num_blocks=16, block_size=4)
        with torch.no_grad(), torch._dynamo.config.patch(**DYNAMO_CONFIG):
            server.step(random_prompts((5, 3)), torch.compile(model, backend=backend, fullgraph=True, dynamic=True))
        self.assertExpectedInline(graphs[-1], """\
attn.kv_cache_write rope=neox/16 query<-view
attn.paged_prefill query<-kv_cache_write
attn.kv_cache_write rope=neox/16 query<-view
attn.paged_prefill query<-kv_cache_write""")
