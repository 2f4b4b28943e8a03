"""Hugging Face models (transformers >= 5) built from tiny random configs, compiled with a plain
`torch.compile(model, fullgraph=True, dynamic=True)` under `fx_passes.enabled()`: every
attention layer (Llama, GPT-NeoX, GPT-J, Qwen3, Phi-3, GPT-2, OPT, Falcon (both spellings), and the sliding windows
of Mistral, Starcoder2, Gemma 3's local layers and gpt-oss as `window_left`, with gpt-oss's
learned sinks, and the ALiBi of BLOOM and Falcon as `alibi_slopes`) is rewritten onto
`attn::context_attention`, one graph serves three sequence
lengths, and the logits are as close to a float64 eager run as eager float32 is.

Models run with `use_cache=False` (prefill without a KV cache), so RoPE moves into
`context_attention` (`rope=<style>/<rotary dim>` in the expectations). Under torch.compile, transformers before torch 2.14 always materializes the causal mask
(`masking_utils._ignore_causal_mask_sdpa` cannot skip it while compiling), so these tests also
cover `index_mask`, which proves that mask is plain causal. GPT-J has no SDPA implementation in
transformers ("does not support an attention implementation through SDPA"): eager only.
A decode step over transformers' `StaticCache` is rewritten onto `attn::paged_decode` instead
(`decode_to_paged`). No network: configs only, random weights, random token ids.
"""

import copy

import expecttest
import pytest
import torch
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

import fx_passes
from fx_passes.replacements import context_attention_bhsd, paged_decode_bhsd
from torch_ops.testing import assert_error_ratio

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")

VOCAB = 128
SEQ_LENS = (5, 7, 9)


def llama(impl):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl)


def mistral(impl):
    """Sliding windows of 4 keys: the test's sequences (5-9 tokens) are longer."""
    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, sliding_window=4)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl)


def gemma3(impl):
    """A local layer (sliding window of 4 keys) and a global one."""
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=4, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"])
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl)


def gemma2(impl):
    """Soft-capped scores (cap 5), a local layer (sliding window of 4 keys) and a global one."""
    config = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=4,
        attn_logit_softcapping=5.0, query_pre_attn_scalar=16)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl)


def tiny(name, impl):
    """Tiny configs of more families: 2 layers, 4 query heads of 16 dims."""
    t, small = transformers, dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4)
    config = {
        "qwen3": lambda: t.Qwen3Config(**small, num_key_value_heads=2, head_dim=16, max_position_embeddings=64),
        "phi3": lambda: t.Phi3Config(**small, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0),
        "starcoder2": lambda: t.Starcoder2Config(**small, num_key_value_heads=2, max_position_embeddings=64,
                                                 sliding_window=4),
        "gpt2": lambda: t.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64),
        "opt": lambda: t.OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                   num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=64),
        "gpt_oss": lambda: t.GptOssConfig(**{**small, "intermediate_size": 64}, num_key_value_heads=2, head_dim=16,
                                          num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                                          max_position_embeddings=64),
        "falcon": lambda: t.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         new_decoder_architecture=False, multi_query=True),
        "falcon_alibi": lambda: t.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, new_decoder_architecture=False, multi_query=True,
                                               alibi=True),
        "bloom": lambda: t.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4),
    }[name]()
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl)


def gpt_neox(impl):
    config = transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, rotary_pct=0.5, max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl)


def gpt_j(impl):
    config = transformers.GPTJConfig(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=64,
        bos_token_id=0, eos_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl)


def deepseek_v3(impl):
    """MLA: 4 heads whose queries and keys have 24 + 8 = 32 dims (a part without RoPE, then the
    RoPE part) and values 16, decompressed from a 32-dim latent; a dense layer, then a MoE layer
    whose two routed experts every token takes (a routing choice would flip on rounding noise)."""
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=24,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=2, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl)


def _values(k, v) -> str:
    """` v[..]` when the values have a head dim of their own."""
    return "" if v.shape[-1] == k.shape[-1] else f" v[*, {v.shape[1]}, *, {v.shape[-1]}]"


def _style(neox: bool) -> str:
    return "neox" if neox else "gptj"


class AttnOpRecorder(CustomGraphPass):
    """A post-grad pass that records the `attn` ops of the graph Inductor lowers, and every
    ATen attention or batched matmul left in it."""

    def __init__(self):
        self.ops = []

    def __call__(self, graph):
        for node in graph.nodes:
            name = str(node.target)
            if name.startswith("attn."):
                q, k, v = (a.meta["val"] for a in node.args[:3])
                table = node.kwargs.get("cos_sin_cache")
                rope = f" rope={_style(node.kwargs.get('rope_neox', True))}/{table.meta['val'].shape[1]}" if table else ""
                alibi = " alibi" if node.kwargs.get("alibi_slopes") is not None else ""
                values = "" if v.shape[-1] == k.shape[-1] else f" v[*, {v.shape[-2]}, {v.shape[-1]}]"
                self.ops.append(f"{name} q[*, {q.shape[1]}, {q.shape[2]}] k[*, {k.shape[1]}, {k.shape[2]}]{values} "
                                f"causal={node.kwargs.get('causal')} scale={node.kwargs.get('scale')}{alibi}{rope}")
            elif "scaled_dot_product" in name or name.startswith("aten.bmm"):
                self.ops.append(name)

    def uuid(self):
        return None


def passes_then_eager(ops):
    """A Dynamo backend that runs the installed pass manager (what Inductor's pre-grad hook runs)
    on the graph and then the graph as it is, recording its attention calls into `ops`: the
    passes on a real model's graph without Inductor's C++ compile (~15 s a model on 2 cores)."""

    def backend(gm, example_inputs):
        inductor_config.pre_grad_custom_pass(gm.graph)
        gm.recompile()
        for node in gm.graph.nodes:
            name = getattr(node.target, "__name__", str(node.target))
            if node.target is context_attention_bhsd:
                q, k, v = (a.meta["example_value"] for a in node.args[:3])
                cos = node.kwargs.get("cos")
                rope = f" rope={_style(node.kwargs['rope_neox'])}/{cos.meta['example_value'].shape[-1]}" if cos else ""
                factor = " q_factor" if node.kwargs["q_factor"] is not None else ""
                window = node.kwargs.get("window_left", -1)
                window = f" window_left={window}" if window >= 0 else ""
                window += " sinks" if node.kwargs.get("sinks") is not None else ""
                window += f" softcap={node.kwargs['softcap']}" if node.kwargs.get("softcap") else ""
                window += " alibi" if node.kwargs.get("alibi_slopes") is not None else ""
                ops.append(f"{name} q[*, {q.shape[1]}, *, {q.shape[3]}] k[*, {k.shape[1]}, *, {k.shape[3]}]"
                           f"{_values(k, v)} causal={node.kwargs['causal']} scale={node.kwargs['scale']}{factor}{window}{rope}")
            elif node.target is paged_decode_bhsd:
                q, k, v = (a.meta["example_value"] for a in node.args[:3])
                mask = "none" if node.args[3] is None else "key_mask" if node.kwargs.get("key_mask") else "prefix"
                alibi = " alibi" if node.kwargs.get("alibi_slopes") is not None else ""
                ops.append(f"{name} q[*, {q.shape[1]}, 1, {q.shape[3]}] cache[*, {k.shape[1]}, {k.shape[2]}, "
                           f"{k.shape[3]}]{_values(k, v)} scale={node.kwargs['scale']} mask={mask}{alibi}")
            elif name in ("scaled_dot_product_attention", "matmul", "bmm", "baddbmm", "softmax"):
                ops.append(name)
        return gm.forward

    return backend


def _static_cache_decode(model, model64) -> list[str]:
    """Three decode steps of 2 sequences over transformers' `StaticCache` (11 prompt tokens, 24
    slots): `model` compiled with the passes against eager `model` and its float64 twin `model64`;
    returns the ops the passes made."""
    b, prompt, capacity = 2, 11, 24
    caches = [transformers.StaticCache(config=model.config, max_cache_len=capacity) for _ in range(3)]
    ids = torch.randint(0, VOCAB, (b, prompt))
    with torch.no_grad():
        for m, cache in zip((model, model, model64), caches):
            m(ids, past_key_values=cache, use_cache=True)
    ops = []
    compiled = torch.compile(model, fullgraph=True, backend=passes_then_eager(ops))
    with fx_passes.enabled(), torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        for pos in range(prompt, prompt + 3):
            step = dict(input_ids=torch.randint(0, VOCAB, (b, 1)), use_cache=True,
                        cache_position=torch.tensor([pos]), position_ids=torch.full((b, 1), pos))
            out = compiled(past_key_values=caches[0], **step).logits
            want = model(past_key_values=caches[1], **step).logits
            truth = model64(past_key_values=caches[2], **step).logits
            assert_error_ratio(out, truth, want, name=f"logits (position {pos})")
    return ops


class TestHFModels(expecttest.TestCase):
    def setUp(self):
        super().setUp()
        torch.manual_seed(0)

    def compile_and_check(self, model, *, inductor=False, rope=True):
        """Compiles `model` once (`fullgraph=True, dynamic=True`), runs it on three sequence
        lengths, checks the logits and counters; returns its attention ops, one per line:
        Inductor's lowered graph's if `inductor`, else the rewritten Dynamo graph's.

        Under `dynamic=True` Dynamo lifts a model's float attributes (GPT-NeoX's and Llama's eager
        `scaling`, GPT-J's `scale_attn`) to graph inputs read with `.item()`: such a scale is
        folded into the query (`q_factor` in the lines, op scale 1.0)."""
        model = model.eval()
        model64 = copy.deepcopy(model)
        if model.config.model_type in ("gpt_oss", "deepseek_v3"):
            model64.set_experts_implementation("eager")   # their grouped_mm experts take no float64
        model64 = model64.double()
        ops = []
        recorder = AttnOpRecorder()
        backend = "inductor" if inductor else passes_then_eager(ops)
        compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=backend)
        with fx_passes.enabled(), torch.no_grad(), inductor_config.patch(post_grad_custom_post_pass=recorder), \
                torch._dynamo.config.patch(error_on_recompile=True):
            for s in SEQ_LENS:
                ids = torch.randint(0, VOCAB, (2, s))
                out = compiled(ids, use_cache=False).logits
                assert_error_ratio(out, model64(ids, use_cache=False).logits, model(ids, use_cache=False).logits,
                                   name=f"logits (S={s})")
        self.assertEqual(counters["stats"]["unique_graphs"], 1)
        # Counted in the compiled graph, not by the pass counters: with Inductor, Dynamo traces
        # the model twice (it restarts after specializing the float attributes it lifted), and
        # the passes run (and count) on the discarded trace too.
        lines = recorder.ops if inductor else ops
        self.assertEqual(sum("context_attention" in line and ("rope=" in line or not rope) for line in lines),
                         model.config.num_hidden_layers)
        return "\n".join(lines)

    def test_llama_sdpa_gqa_inductor(self):
        self.assertExpectedInline(self.compile_and_check(llama("sdpa"), inductor=True), """\
attn.context_attention.default q[*, 4, 16] k[*, 2, 16] causal=True scale=0.25 rope=neox/16
attn.context_attention.default q[*, 4, 16] k[*, 2, 16] causal=True scale=0.25 rope=neox/16""")

    def test_llama_eager_gqa(self):
        self.assertExpectedInline(self.compile_and_check(llama("eager")), """\
context_attention_bhsd q[*, 4, *, 16] k[*, 2, *, 16] causal=True scale=1.0 q_factor rope=neox/16
context_attention_bhsd q[*, 4, *, 16] k[*, 2, *, 16] causal=True scale=1.0 q_factor rope=neox/16""")

    def test_mistral_sdpa_sliding_window(self):
        self.assertExpectedInline(self.compile_and_check(mistral("sdpa")), """\
context_attention_bhsd q[*, 4, *, 16] k[*, 2, *, 16] causal=True scale=1.0 q_factor window_left=3 rope=neox/16
context_attention_bhsd q[*, 4, *, 16] k[*, 2, *, 16] causal=True scale=1.0 q_factor window_left=3 rope=neox/16""")

    def test_mistral_eager_sliding_window(self):
        self.assertExpectedInline(self.compile_and_check(mistral("eager")), """\
context_attention_bhsd q[*, 4, *, 16] k[*, 2, *, 16] causal=True scale=1.0 q_factor window_left=3 rope=neox/16
context_attention_bhsd q[*, 4, *, 16] k[*, 2, *, 16] causal=True scale=1.0 q_factor window_left=3 rope=neox/16""")

    def test_gemma3_sdpa_local_and_global_layers(self):
        self.assertExpectedInline(self.compile_and_check(gemma3("sdpa")), """\
context_attention_bhsd q[*, 4, *, 16] k[*, 2, *, 16] causal=True scale=1.0 q_factor window_left=3 rope=neox/16
context_attention_bhsd q[*, 4, *, 16] k[*, 2, *, 16] causal=True scale=1.0 q_factor rope=neox/16""")

    def test_gemma3_eager_local_and_global_layers(self):
        self.assertExpectedInline(self.compile_and_check(gemma3("eager")), """\
context_attention_bhsd q[*, 4, *, 16] k[*, 2, *, 16] causal=True scale=1.0 q_factor window_left=3 rope=neox/16
context_attention_bhsd q[*, 4, *, 16] k[*, 2, *, 16] causal=True scale=1.0 q_factor rope=neox/16""")

    def test_qwen3_sdpa(self):
        self.assertExpectedInline(self.compile_and_check(tiny("qwen3", "sdpa")), """\
context_attention_bhsd q[*, 4, *, 16] k[*, 2, *, 16] causal=True scale=1.0 q_factor rope=neox/16
context_attention_bhsd q[*, 4, *, 16] k[*, 2, *, 16] causal=True scale=1.0 q_factor rope=neox/16""")

    def test_phi3_eager(self):
        self.assertExpectedInline(self.compile_and_check(tiny("phi3", "eager")), """\
context_attention_bhsd q[*, 4, *, 16] k[*, 2, *, 16] causal=True scale=1.0 q_factor rope=neox/16
context_attention_bhsd q[*, 4, *, 16] k[*, 2, *, 16] causal=True scale=1.0 q_factor rope=neox/16""")

    def test_starcoder2_sdpa_sliding_window(self):
        self.assertExpectedInline(self.compile_and_check(tiny("starcoder2", "sdpa")), """\
context_attention_bhsd q[*, 4, *, 16] k[*, 2, *, 16] causal=True scale=1.0 q_factor window_left=3 rope=neox/16
context_attention_bhsd q[*, 4, *, 16] k[*, 2, *, 16] causal=True scale=1.0 q_factor window_left=3 rope=neox/16""")

    def test_gpt2_eager(self):
        self.assertExpectedInline(self.compile_and_check(tiny("gpt2", "eager"), rope=False), """\
context_attention_bhsd q[*, 4, *, 16] k[*, 4, *, 16] causal=True scale=1.0 q_factor
context_attention_bhsd q[*, 4, *, 16] k[*, 4, *, 16] causal=True scale=1.0 q_factor""")

    def test_opt_sdpa(self):
        self.assertExpectedInline(self.compile_and_check(tiny("opt", "sdpa"), rope=False), """\
context_attention_bhsd q[*, 4, *, 16] k[*, 4, *, 16] causal=True scale=1.0
context_attention_bhsd q[*, 4, *, 16] k[*, 4, *, 16] causal=True scale=1.0""")

    def test_falcon_sdpa_multi_query(self):
        self.assertExpectedInline(self.compile_and_check(tiny("falcon", "sdpa")), """\
matmul
context_attention_bhsd q[*, 4, *, 16] k[*, 1, *, 16] causal=True scale=None rope=neox/16
matmul
matmul
matmul
matmul
context_attention_bhsd q[*, 4, *, 16] k[*, 1, *, 16] causal=True scale=None rope=neox/16
matmul
matmul
matmul""")

    def test_falcon_eager_inplace_scaling(self):
        lines = self.compile_and_check(tiny("falcon", "eager")).splitlines()
        self.assertEqual([line for line in lines if "context_attention" in line], [
            "context_attention_bhsd q[*, 4, *, 16] k[*, 1, *, 16] causal=True scale=0.25 rope=neox/16"] * 2)

    def test_bloom_eager_alibi_inductor(self):
        """BLOOM: `baddbmm(alibi, q, k^T, beta, alpha)` over `[B*H, S, D]` views, the alibi `slopes *
        arange(S)` repeated over the batch; `beta` and `alpha` are lifted attributes (the slopes are
        multiplied by `beta` at run time, the query by `alpha`)."""
        self.assertExpectedInline(self.compile_and_check(tiny("bloom", "eager"), inductor=True, rope=False), """\
attn.context_attention.default q[*, 4, 16] k[*, 4, 16] causal=True scale=1.0 alibi
attn.context_attention.default q[*, 4, 16] k[*, 4, 16] causal=True scale=1.0 alibi""")

    def test_bloom_eager_alibi(self):
        self.assertExpectedInline(self.compile_and_check(tiny("bloom", "eager"), rope=False), """\
context_attention_bhsd q[*, 4, *, 16] k[*, 4, *, 16] causal=True scale=1.0 q_factor alibi
context_attention_bhsd q[*, 4, *, 16] k[*, 4, *, 16] causal=True scale=1.0 q_factor alibi""")

    def test_falcon_alibi_sdpa(self):
        """Falcon with `alibi=True`: the bias (bfloat16 slopes times positions, over sqrt(D)) folded
        into the float causal mask that SDPA gets."""
        lines = [line for line in self.compile_and_check(tiny("falcon_alibi", "sdpa"), rope=False).splitlines()
                 if line != "matmul"]   # the linear layers
        self.assertExpectedInline("\n".join(lines), """\
context_attention_bhsd q[*, 4, *, 16] k[*, 1, *, 16] causal=True scale=None alibi
context_attention_bhsd q[*, 4, *, 16] k[*, 1, *, 16] causal=True scale=None alibi""")

    def test_falcon_alibi_eager(self):
        """Falcon's eager ALiBi adds the bias twice: before its scaling (a lifted attribute) and in
        the mask; the slopes are the sum."""
        lines = self.compile_and_check(tiny("falcon_alibi", "eager"), rope=False).splitlines()
        self.assertEqual([line for line in lines if line != "matmul"], [
            "context_attention_bhsd q[*, 4, *, 16] k[*, 1, *, 16] causal=True scale=1.0 q_factor alibi"] * 2)

    def test_bloom_padding_positions(self):
        """With a padding mask `m`, BLOOM builds its mask (`causal & m[b, k]`) and its ALiBi
        positions (`(cumsum(m) - 1) * m`) in the graph: the mask goes to the op as `key_mask`, the
        slopes as `alibi_slopes`, the positions to a device-side check (the key index up to a
        constant on the keys each query sees). The truth: each sequence without its padding (the
        float64 model's padding queries see no key: NaN, which its later queries read)."""
        model = tiny("bloom", "eager").eval()
        model64 = copy.deepcopy(model).double()
        ops = []
        compiled = torch.compile(model, fullgraph=True, backend=passes_then_eager(ops))
        ids = torch.randint(0, VOCAB, (2, 7))
        mask = torch.ones(2, 7, dtype=torch.long)
        mask[1, :3] = 0   # left padding
        kept = mask.bool()
        with fx_passes.enabled(), torch.no_grad():
            out = compiled(ids, attention_mask=mask, use_cache=False).logits
            truth = torch.cat([model64(ids[b, kept[b]][None], use_cache=False).logits[0] for b in range(2)])
            assert_error_ratio(out[kept], truth, model(ids, attention_mask=mask, use_cache=False).logits[kept])
        self.assertExpectedInline("\n".join(ops), """\
context_attention_bhsd q[*, 4, *, 16] k[*, 4, *, 16] causal=False scale=0.25 alibi
context_attention_bhsd q[*, 4, *, 16] k[*, 4, *, 16] causal=False scale=0.25 alibi""")

    def test_gpt_oss_eager_sinks_and_sliding_window(self):
        """Learned sinks (a softmax column without a value) on every layer; a window on every other
        (`softmax`: the MoE router's)."""
        self.assertExpectedInline(self.compile_and_check(tiny("gpt_oss", "eager"), rope=False), """\
context_attention_bhsd q[*, 4, *, 16] k[*, 2, *, 16] causal=True scale=1.0 q_factor window_left=3 sinks
softmax
context_attention_bhsd q[*, 4, *, 16] k[*, 2, *, 16] causal=True scale=1.0 q_factor sinks
softmax""")

    def test_gemma2_eager_soft_capping_under_default_compile(self):
        """Gemma 2's soft-cap is a float attribute: `dynamic=True` lifts it to a graph input (then
        declined), the default `torch.compile` keeps it a constant, which the op takes."""
        model = gemma2("eager").eval()
        model64 = copy.deepcopy(model).double()
        ops = []
        compiled = torch.compile(model, fullgraph=True, backend=passes_then_eager(ops))
        with fx_passes.enabled(), torch.no_grad():
            for s in SEQ_LENS:
                ids = torch.randint(0, VOCAB, (2, s))
                assert_error_ratio(compiled(ids, use_cache=False).logits, model64(ids, use_cache=False).logits,
                                   model(ids, use_cache=False).logits, name=f"logits (S={s})")
        self.assertExpectedInline("\n".join(sorted(set(ops))), """\
context_attention_bhsd q[*, 4, *, 16] k[*, 2, *, 16] causal=True scale=0.25 softcap=5.0 rope=neox/16
context_attention_bhsd q[*, 4, *, 16] k[*, 2, *, 16] causal=True scale=0.25 window_left=3 softcap=5.0 rope=neox/16""")

    def test_gpt_neox_sdpa_partial_rotary(self):
        self.assertExpectedInline(self.compile_and_check(gpt_neox("sdpa")), """\
context_attention_bhsd q[*, 4, *, 16] k[*, 4, *, 16] causal=True scale=1.0 q_factor rope=neox/8
context_attention_bhsd q[*, 4, *, 16] k[*, 4, *, 16] causal=True scale=1.0 q_factor rope=neox/8""")

    def test_gpt_j_eager_interleaved_rotary(self):
        self.assertExpectedInline(self.compile_and_check(gpt_j("eager")), """\
context_attention_bhsd q[*, 4, *, 16] k[*, 4, *, 16] causal=True scale=1.0 q_factor rope=gptj/8
context_attention_bhsd q[*, 4, *, 16] k[*, 4, *, 16] causal=True scale=1.0 q_factor rope=gptj/8""")

    def test_llama_static_cache_decode(self):
        """Decode steps over transformers' `StaticCache`: each layer's SDPA (one query, GQA by
        `repeat_kv`, the mask `key <= cumulative_length`) runs as paged_decode over the cache in
        place; three steps of one graph match eager bf16 against a float64 twin."""
        model = llama("sdpa").to(torch.bfloat16).eval()
        model64 = copy.deepcopy(model).double()
        ops = _static_cache_decode(model, model64)
        self.assertEqual(counters["stats"]["unique_graphs"], 1)
        self.assertExpectedInline("\n".join(ops), """\
paged_decode_bhsd q[*, 4, 1, 16] cache[*, 2, 24, 16] scale=0.25 mask=prefix
paged_decode_bhsd q[*, 4, 1, 16] cache[*, 2, 24, 16] scale=0.25 mask=prefix""")

    def test_deepseek_v3_sdpa_mla_prefill(self):
        """MLA prefill over the decompressed keys and values: queries and keys of 32 dims, values of
        16 (`v[..]`); SDPA's scale `1/sqrt(32)` is a lifted attribute (`q_factor`). RoPE stays
        outside the op: DeepSeek rotates the last 8 dims of the head (interleaved pairs, written
        back de-interleaved), which the op's partial rotary (the first dims) does not express."""
        self.assertExpectedInline(self.compile_and_check(deepseek_v3("sdpa"), rope=False), """\
context_attention_bhsd q[*, 4, *, 32] k[*, 4, *, 32] v[*, 4, *, 16] causal=True scale=1.0 q_factor
context_attention_bhsd q[*, 4, *, 32] k[*, 4, *, 32] v[*, 4, *, 16] causal=True scale=1.0 q_factor""")

    def test_deepseek_v3_eager_mla_prefill(self):
        self.assertExpectedInline(self.compile_and_check(deepseek_v3("eager"), rope=False), """\
context_attention_bhsd q[*, 4, *, 32] k[*, 4, *, 32] v[*, 4, *, 16] causal=True scale=1.0 q_factor
context_attention_bhsd q[*, 4, *, 32] k[*, 4, *, 32] v[*, 4, *, 16] causal=True scale=1.0 q_factor""")

    def test_deepseek_v3_sdpa_mla_prefill_inductor(self):
        self.assertExpectedInline(self.compile_and_check(deepseek_v3("sdpa"), inductor=True, rope=False), """\
attn.context_attention.default q[*, 4, 32] k[*, 4, 32] v[*, 4, 16] causal=True scale=0.1767766952966369
attn.context_attention.default q[*, 4, 32] k[*, 4, 32] v[*, 4, 16] causal=True scale=0.1767766952966369""")

    def test_deepseek_v3_static_cache_decode(self):
        """DeepSeek-V3's decode step: transformers' `StaticCache` holds the latent (`[B, 1, S, 32]`
        compressed, `[B, 1, S, 8]` RoPE part), which each step decompresses into keys `[B, 4, S, 32]`
        and values `[B, 4, S, 16]` for plain attention; that attention runs as `paged_decode` with
        values of their own head dim, one page per sequence; three steps of one graph match eager
        bf16 against a float64 twin."""
        model = deepseek_v3("sdpa").to(torch.bfloat16).eval()
        model64 = copy.deepcopy(model)
        model64.set_experts_implementation("eager")
        model64 = model64.double()
        ops = _static_cache_decode(model, model64)
        self.assertEqual(counters["stats"]["unique_graphs"], 1)
        self.assertEqual(sum(counters["graph_break"].values()), 0)
        self.assertExpectedInline("\n".join(ops), """\
paged_decode_bhsd q[*, 4, 1, 32] cache[*, 4, 24, 32] v[*, 4, *, 16] scale=0.1767766952966369 mask=prefix
paged_decode_bhsd q[*, 4, 1, 32] cache[*, 4, 24, 32] v[*, 4, *, 16] scale=0.1767766952966369 mask=prefix""")
