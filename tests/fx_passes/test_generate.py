"""Hugging Face `generate()` with a static cache and a compiled forward: transformers builds each
step's mask outside the graph (a graph input; BLOOM builds it in the graph from the 2-D mask),
and both the prefill of the left-padded prompts (`attn::context_attention`) and the decode steps
(`attn::paged_decode`) run on the ops, taking the mask as `key_mask`."""

import copy

import pytest
import torch
from torch._dynamo.utils import counters

import fx_passes
from torch_ops.testing import assert_error_ratio

from .test_hf_models import VOCAB, deepseek_v3, gemma2, gemma3, llama, mistral, passes_then_eager, tiny

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")

LAYERS, NEW_TOKENS = 2, 6
NEAR_TIE = 0.1   # a bf16 run of another kernel may flip tokens whose top-2 logits are this close
FAMILIES = {"llama": llama, "mistral": mistral, "gemma3": gemma3,   # Mistral and Gemma 3: sliding windows
            **{name: lambda impl, name=name: tiny(name, impl)
               for name in ("qwen3", "phi3", "starcoder2", "gpt2", "opt", "falcon")},
            "deepseek_v3": deepseek_v3}   # values of a head dim of their own


def gpt_oss(impl):
    """Learned sinks, a sliding window of 4 keys on every other layer; every token takes both
    experts (a routing choice would flip on bf16 noise and change the logits)."""
    config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=2, num_experts_per_tok=2, sliding_window=4,
        max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl)


def bloom(impl):
    """ALiBi, by positions from the padding mask; the attention's output projection scaled up
    (x30) so that the logits depend on the attention, and on its slopes, above bf16 noise."""
    model = tiny("bloom", impl)
    with torch.no_grad():
        for layer in model.transformer.h:
            layer.self_attention.dense.weight.mul_(30)
    return model


# (model, attention): Hugging Face's SDPA attention gets bool masks, its eager attention float
# ones; BLOOM builds its mask and ALiBi positions in the graph from the 2-D mask; DeepSeek-V3's
# values have a head dim of their own (MLA over decompressed keys and values)
LENGTHS = {"llama": (llama, "sdpa"), "gemma2": (gemma2, "eager"), "gpt_oss": (gpt_oss, "eager"),
           "bloom": (bloom, "eager"), "deepseek_v3": (deepseek_v3, "sdpa"), "deepseek_v3_eager": (deepseek_v3, "eager")}
PROMPT_LENS, CAPACITY = (5, 7, 9), 16


def _model(family):
    model = FAMILIES[family]("sdpa").eval().to(torch.bfloat16)
    model.generation_config.pad_token_id = 0
    return model


def _padded_prompt(s):
    """Three prompts of `s` tokens, two of them left-padded."""
    ids = torch.randint(1, VOCAB, (3, s))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :1] = 0
    return ids, mask


def _generate(model, ids, mask, **kwargs):
    """Greedy tokens and logits of `generate()` with a static cache (`cache_implementation`, or a
    `past_key_values` cache given with `cache_implementation=None`)."""
    kwargs = {"cache_implementation": "static", **kwargs}
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                         return_dict_in_generate=True, output_logits=True, **kwargs)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1).float()   # [B, N], [B, N, V]


def _agree(tokens, logits, want_tokens, want_logits, truth=None):
    """Tokens equal eager's up to the first step where eager's top two logits nearly tie; up to
    there, logits within bf16 noise of eager's (teacher forcing: the same tokens went in), and as
    close to the float64 `truth` (`_truth` of eager's tokens), if given, as eager's are."""
    top2 = want_logits.topk(2, -1).values
    margin = top2[..., 0] - top2[..., 1]
    for b in range(tokens.shape[0]):
        steps = tokens.shape[1]
        for n in range(steps):
            torch.testing.assert_close(logits[b, n], want_logits[b, n], atol=5e-2, rtol=5e-2)
            if tokens[b, n] != want_tokens[b, n]:
                assert margin[b, n] < NEAR_TIE, f"sequence {b} step {n}: token differs, eager margin {margin[b, n]:.3f}"
                steps = n + 1
                break
        if truth is not None:   # bf16 logits: bf16 rounding is the floor
            assert_error_ratio(logits[b, :steps].bfloat16(), truth[b, :steps], want_logits[b, :steps].bfloat16(),
                               name=f"sequence {b} logits")


def _truth(model64, ids, mask, tokens):
    """`[B, N, V]` float64 logits of the `N` steps that generated `tokens [B, N]`: each sequence
    without its left padding through the float64 model, in one forward."""
    n, rows = tokens.shape[1], []
    for b in range(ids.shape[0]):
        sequence = torch.cat([ids[b][mask[b].bool()], tokens[b]])[None]
        rows.append(model64(sequence, use_cache=False).logits[0, -n - 1:-1])
    return torch.stack(rows).float()


@pytest.mark.slow
@pytest.mark.parametrize("family,compiled_by", [
    *((f, "user") for f in FAMILIES), ("llama", "transformers"), ("llama", "reduce-overhead")])
def test_generate_runs_on_the_ops_with_the_mask_from_outside_the_graph(family, compiled_by):
    """`torch.compile(model.forward)` by the user (also with `mode="reduce-overhead"`, which on the
    CPU runs both graphs without CUDA graphs), or transformers' own compile of the decode steps
    (`CompileConfig`; on CPU only when asked for every device)."""
    torch.manual_seed(0)
    model = _model(family)
    ids, mask = _padded_prompt(7)
    with torch.no_grad():
        want = _generate(model, ids, mask, disable_compile=True)
        with fx_passes.enabled():
            if compiled_by == "transformers":
                config = transformers.CompileConfig(fullgraph=True)
                config._compile_all_devices = True
                got = _generate(model, ids, mask, compile_config=config)
            else:
                mode = None if compiled_by == "user" else compiled_by
                model.forward = torch.compile(model.forward, fullgraph=True, mode=mode)
                got = _generate(model, ids, mask, disable_compile=True)
    assert counters["attn"]["decode_to_paged_matched"] == LAYERS   # one decode graph, every layer
    if compiled_by != "transformers":   # transformers compiles the decode steps only
        assert counters["attn"]["sdpa_to_attn_matched"] == LAYERS   # the prefill of the padded prompts
    if compiled_by == "reduce-overhead":   # prefill and decode
        assert counters["inductor"]["cudagraph_skips"] == 2
    assert sum(counters["graph_break"].values()) == 0
    _agree(*got, *want)


@pytest.mark.gpu
def test_generate_reduce_overhead_on_cuda():
    """A user's `torch.compile(model.forward, mode="reduce-overhead")` on CUDA: the prefill and the
    decode steps run on the ops inside CUDA graphs (none skipped), with eager's tokens. The static
    cache is allocated before the compiled prefill (`early_initialization`): a cache that the
    compiled prefill allocates crashes stock compile too (segfault; torch 2.11, transformers 5.17)."""
    torch.manual_seed(0)
    model = _model("llama").cuda()
    ids, mask = (t.cuda() for t in _padded_prompt(7))
    config = model.config
    cache = transformers.StaticCache(config=config, max_cache_len=ids.shape[1] + NEW_TOKENS)
    cache.early_initialization(ids.shape[0], config.num_key_value_heads, config.head_dim, torch.bfloat16, ids.device)
    with torch.no_grad():
        want = _generate(model, ids, mask, disable_compile=True)
        with fx_passes.enabled():
            model.forward = torch.compile(model.forward, fullgraph=True, mode="reduce-overhead")
            got = _generate(model, ids, mask, disable_compile=True, past_key_values=cache, cache_implementation=None)
    assert counters["attn"]["decode_to_paged_matched"] == LAYERS
    assert counters["attn"]["sdpa_to_attn_matched"] == LAYERS
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert sum(counters["graph_break"].values()) == 0
    _agree(*got, *want)


@pytest.mark.slow
@pytest.mark.parametrize("family", LENGTHS)
def test_generate_three_prompt_lengths_in_one_graph(family):
    """The left-padded prefill of three prompt lengths (one graph, `dynamic=True`) and the decode
    steps run on the ops with `generate()`'s masks as `key_mask`: SDPA takes them as bool graph
    inputs, eager attention adds them as float ones (0, or `finfo.min` for padding and outside
    sliding windows), Gemma 2's soft-cap, gpt-oss's sinks and DeepSeek-V3's values of 16 dims under
    keys of 32 included; BLOOM's mask, built in the graph, goes to the op as a bool, and its ALiBi,
    by positions from the padding mask, as `alibi_slopes` (in `paged_decode` too). One static cache capacity for every prompt, so one
    decode graph too. Without Inductor (the passes on Dynamo's graph, run eagerly): ~8 s."""
    torch.manual_seed(0)
    build, impl = LENGTHS[family]
    model = build(impl).eval().to(torch.bfloat16)
    model.generation_config.pad_token_id = 0
    model64 = copy.deepcopy(model)
    if family.startswith(("gpt_oss", "deepseek_v3")):
        model64.set_experts_implementation("eager")   # their grouped_mm experts take no float64
    model64 = model64.double()
    eager, ops = model.forward, []
    compiled = torch.compile(eager, fullgraph=True, dynamic=True, backend=passes_then_eager(ops))

    def generate(forward, ids, mask):
        model.forward = forward
        cache = transformers.StaticCache(config=model.config, max_cache_len=CAPACITY)
        return _generate(model, ids, mask, disable_compile=True, past_key_values=cache, cache_implementation=None)

    # a float soft-cap stays a constant (dynamic=True would lift it to a graph input)
    with torch.no_grad(), fx_passes.enabled(), torch._dynamo.config.patch(specialize_float=True):
        for s in PROMPT_LENS:
            ids, mask = _padded_prompt(s)
            want = generate(eager, ids, mask)
            _agree(*generate(compiled, ids, mask), *want, truth=_truth(model64, ids, mask, want[0]))
    assert counters["stats"]["unique_graphs"] == 2   # prefill, decode
    assert sum(counters["graph_break"].values()) == 0
    rewritten = [line for line in ops if line.startswith(("context_attention", "paged_decode"))]
    assert [line.split()[0] for line in rewritten] == (["context_attention_bhsd"] * LAYERS
                                                       + ["paged_decode_bhsd"] * LAYERS)
    assert [" alibi" in line for line in rewritten] == [family == "bloom"] * (2 * LAYERS)
    assert not [line for line in ops if line in ("matmul", "bmm", "baddbmm", "scaled_dot_product_attention")]
