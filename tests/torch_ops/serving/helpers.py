"""Shared by the serving tests: building a model + cache + engine, random requests, and a dense
(cache-free) greedy generation that the engine's outputs must equal."""

import random

import torch

from torch_ops import reference
from torch_ops.serving.attention import get_backend
from torch_ops.serving.cache_manager import KVCacheManager
from torch_ops.serving.engine import Engine, Request
from torch_ops.serving.model import Llama, LlamaConfig, attention_config, rope_cos_sin_cache

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=8, intermediate_size=64, max_position=256)


def build_engine(backend="vanilla", *, config=CONFIG, seed=0, dtype=torch.float32, device="cpu",
                 num_blocks=64, block_size=4, max_num_seqs=8, max_num_tokens=16, graph_buckets=(),
                 prefix_caching=False, tp_group=None, tp_size=1):
    cache_cfg = attention_config(config, device, tp_size)
    kv = KVCacheManager(config.num_layers, num_blocks, block_size, cache_cfg.num_kv_heads,
                        config.head_dim, dtype, device=device, prefix_caching=prefix_caching,
                        window_left=config.window_left, sink_tokens=config.sink_tokens,
                        cos_sin_cache=cache_cfg.cos_sin_cache)
    attention = get_backend(backend)(cache_cfg, kv, max_num_seqs=max_num_seqs,
                                     max_num_tokens=max(max_num_tokens, max_num_seqs),
                                     max_blocks_per_seq=num_blocks)
    model = Llama.random(config, seed, attention, tp_group=tp_group, device=device).to(dtype=dtype)
    return Engine(model, kv, max_num_seqs=max_num_seqs, max_num_tokens=max_num_tokens,
                  graph_buckets=graph_buckets)


def random_requests(rng: random.Random, n: int, vocab: int, max_prompt=20, max_new=8, shared_prefix=()):
    return [Request(i, list(shared_prefix) + [rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt))],
                    rng.randint(1, max_new)) for i in range(n)]


@torch.no_grad()
def dense_greedy(model: Llama, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy generation recomputing the whole sequence each token with dense causal attention
    (the float64 reference, no cache, absolute RoPE positions)."""
    cfg = model.config
    model_ = Llama(cfg).double()
    model_.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    model = model_
    cos_sin = rope_cos_sin_cache(cfg)
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        ids = torch.tensor(tokens)
        pos = torch.arange(len(tokens))
        x = model.embed(ids).double()
        for layer in model.layers:
            hq, hkv, d = layer.num_heads, layer.num_kv_heads, cfg.head_dim
            q, k, v = layer.qkv_proj(layer.input_norm(x)).split([hq * d, hkv * d, hkv * d], dim=-1)
            q = reference.apply_rope(q.reshape(-1, hq, d), pos, cos_sin, True, torch.float64)
            k = reference.apply_rope(k.reshape(-1, hkv, d), pos, cos_sin, True, torch.float64)
            out, _ = reference.attend(q, k, v.reshape(-1, hkv, d), pos, causal=True,
                                      window_left=cfg.window_left, sink_tokens=cfg.sink_tokens,
                                      compute_dtype=torch.float64)
            x = x + layer.o_proj(out.flatten(1))
            gate, up = layer.gate_up_proj(layer.post_norm(x)).chunk(2, dim=-1)
            x = x + layer.down_proj(torch.nn.functional.silu(gate) * up)
        logits = model.lm_head(model.norm(x[-1]))
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]
