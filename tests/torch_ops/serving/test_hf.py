"""transformers models with attn_implementation="attn_ops" (small random configs, CPU): logits
against the same model in float64 eager attention, with the error-ratio tolerance, and batched
greedy generation with left padding equal to eager attention's."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from torch_ops.serving import hf  # noqa: E402
from torch_ops.testing import assert_error_ratio  # noqa: E402

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    "mistral_sliding": lambda: transformers.MistralConfig(**COMMON, sliding_window=5),
    "gemma2_softcap": lambda: transformers.Gemma2Config(**COMMON, head_dim=16, sliding_window=6,
                                                        attn_logit_softcapping=20.0),
    "gpt_oss_sinks": lambda: transformers.GptOssConfig(**{**COMMON, "num_local_experts": 2,
                                                          "num_experts_per_tok": 1}, head_dim=16,
                                                       sliding_window=6),
}


def model_pair(name):
    hf.register()
    torch.manual_seed(int(torch.randint(0, 2**31, ())))
    ours = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation="attn_ops").eval()
    state = ours.state_dict()
    if name == "gpt_oss_sinks":  # make the learned sinks matter
        for key in state:
            if key.endswith("sinks"):
                state[key].normal_()
        ours.load_state_dict(state)
    eager = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation="eager",
                                                          experts_implementation="eager").eval()
    eager.load_state_dict(state)
    return ours, eager


@pytest.mark.parametrize("name", list(CONFIGS))
@torch.no_grad()
def test_logits_match_eager_attention(name):
    ours, eager = model_pair(name)
    ids = torch.randint(0, 97, (2, 11))
    got = ours(ids).logits
    baseline = eager(ids).logits
    truth = eager.double()(ids).logits
    assert_error_ratio(got, truth, baseline, name=f"{name} logits")


@torch.no_grad()
def test_generate_with_left_padding_matches_eager():
    ours, eager = model_pair("llama")
    ids = torch.randint(1, 97, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :1] = 0
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    got = ours.generate(ids, **kw)
    want = eager.generate(ids, **kw)
    assert torch.equal(got, want)


def test_bad_input():
    module = torch.nn.Module()
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 3, 16)
    with pytest.raises(ValueError, match="dropout must be 0"):
        hf.attention_forward(module, q, k, k, None, dropout=0.1)
    with pytest.raises(ValueError, match=r"attention_mask must be None or a padding mask \[B, L\] = \[1, 3\]"):
        hf.attention_forward(module, q, k, k, torch.ones(1, 1, 3, 3, dtype=torch.bool))
