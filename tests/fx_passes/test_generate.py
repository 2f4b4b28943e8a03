"""Hugging Face `generate()` with a static cache and a compiled forward: transformers builds each
step's mask outside the graph (a graph input), and both the prefill of the left-padded prompts
(`attn::context_attention`) and the decode steps (`attn::paged_decode`) run on the ops, taking
the mask as `key_mask`."""

import pytest
import torch
from torch._dynamo.utils import counters

import fx_passes

from .test_hf_models import gemma3, llama, mistral, tiny

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")

LAYERS, NEW_TOKENS = 2, 6
NEAR_TIE = 0.1   # a bf16 run of another kernel may flip tokens whose top-2 logits are this close
FAMILIES = {"llama": llama, "mistral": mistral, "gemma3": gemma3,   # Mistral and Gemma 3: sliding windows
            **{name: lambda impl, name=name: tiny(name, impl)
               for name in ("qwen3", "phi3", "starcoder2", "gpt2", "opt", "falcon")}}


def _model(family):
    model = FAMILIES[family]("sdpa").eval().to(torch.bfloat16)
    model.generation_config.pad_token_id = 0
    return model


def _generate(model, ids, mask, **kwargs):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                         cache_implementation="static", return_dict_in_generate=True, output_logits=True, **kwargs)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1).float()   # [B, N], [B, N, V]


def _agree(tokens, logits, want_tokens, want_logits):
    """Tokens equal eager's up to the first step where eager's top two logits nearly tie; before
    that, logits within bf16 noise of eager's (teacher forcing: the same tokens went in)."""
    top2 = want_logits.topk(2, -1).values
    margin = top2[..., 0] - top2[..., 1]
    for b in range(tokens.shape[0]):
        for n in range(tokens.shape[1]):
            torch.testing.assert_close(logits[b, n], want_logits[b, n], atol=5e-2, rtol=5e-2)
            if tokens[b, n] != want_tokens[b, n]:
                assert margin[b, n] < NEAR_TIE, f"sequence {b} step {n}: token differs, eager margin {margin[b, n]:.3f}"
                break


@pytest.mark.slow
@pytest.mark.parametrize("family,compiled_by", [*((f, "user") for f in FAMILIES), ("llama", "transformers")])
def test_generate_runs_on_the_ops_with_the_mask_from_outside_the_graph(family, compiled_by):
    """`torch.compile(model.forward)` by the user, or transformers' own compile of the decode
    steps (`CompileConfig`; on CPU only when asked for every device)."""
    torch.manual_seed(0)
    model = _model(family)
    ids = torch.randint(1, 128, (3, 7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0   # left padding
    mask[2, :1] = 0
    with torch.no_grad():
        want = _generate(model, ids, mask, disable_compile=True)
        with fx_passes.enabled():
            if compiled_by == "user":
                model.forward = torch.compile(model.forward, fullgraph=True)
                got = _generate(model, ids, mask, disable_compile=True)
            else:
                config = transformers.CompileConfig(fullgraph=True)
                config._compile_all_devices = True
                got = _generate(model, ids, mask, compile_config=config)
    assert counters["attn"]["decode_to_paged_matched"] == LAYERS   # one decode graph, every layer
    if compiled_by == "user":   # transformers compiles the decode steps only
        assert counters["attn"]["sdpa_to_attn_matched"] == LAYERS   # the prefill of the padded prompts
    assert sum(counters["graph_break"].values()) == 0
    _agree(*got, *want)
