"""A compact Llama-like decoder with random weights whose attention is a model-level
`AttentionBackend`: RMSNorm, fused q/k/v projection, RoPE (fused into the cache write), GQA,
SwiGLU MLP. Inputs are packed tokens of many sequences, as the serving engine schedules them.

With a `torch.distributed` process group, attention heads and MLP columns are sharded across its
ranks (`torch_ops.serving.tp`), with one all-reduce after the attention and one after the MLP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torch_ops.serving.attention import AttentionBackend, AttentionConfig, StepMetadata


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    max_position: int = 4096
    window_left: int = -1
    sink_tokens: int = 0
    rms_eps: float = 1e-5


def rope_cos_sin_cache(config: LlamaConfig, device=None) -> torch.Tensor:
    """`[max_position, head_dim]` fp32: cosines then sines (the layout `kv_cache_write` takes)."""
    inv_freq = config.rope_theta ** -(torch.arange(0, config.head_dim, 2, dtype=torch.float64) / config.head_dim)
    angles = torch.arange(config.max_position, dtype=torch.float64)[:, None] * inv_freq
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float().to(device)


def attention_config(config: LlamaConfig, device=None, tp_size: int = 1) -> AttentionConfig:
    """The attention of this model (of one tensor-parallel rank's heads when `tp_size > 1`)."""
    return AttentionConfig(config.num_heads // tp_size, config.num_kv_heads // tp_size,
                           config.head_dim, window_left=config.window_left,
                           sink_tokens=config.sink_tokens,
                           cos_sin_cache=rope_cos_sin_cache(config, device))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, tp_size: int):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads = config.num_heads // tp_size
        self.num_kv_heads = config.num_kv_heads // tp_size
        self.input_norm = nn.RMSNorm(h, eps=config.rms_eps)
        self.qkv_proj = nn.Linear(h, (self.num_heads + 2 * self.num_kv_heads) * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.post_norm = nn.RMSNorm(h, eps=config.rms_eps)
        self.gate_up_proj = nn.Linear(h, 2 * config.intermediate_size // tp_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size // tp_size, h, bias=False)


class Llama(nn.Module):
    """`forward(input_ids [T], meta) -> hidden [T, hidden_size]`; `logits(hidden) -> [N, vocab]`."""

    def __init__(self, config: LlamaConfig, attention: AttentionBackend | None = None,
                 tp_group=None):
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        tp_size = 1 if tp_group is None else torch.distributed.get_world_size(tp_group)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, tp_size) for _ in range(config.num_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.attention = attention

    @classmethod
    def random(cls, config: LlamaConfig, seed: int, attention: AttentionBackend | None = None,
               tp_group=None, device: torch.device | str = "cpu") -> Llama:
        """A model (fp32, on `device`) with this rank's shard of the random weights of `seed`
        (`init_random_`, drawn on `device`). Built on the meta device, so that no parameter is
        initialized twice."""
        from torch_ops.serving.tp import shard_state_dict

        with torch.device("meta"):
            full, model = cls(config), cls(config, attention, tp_group=tp_group)
        weights = full.to_empty(device=device).init_random_(seed).state_dict()
        tp_size = 1 if tp_group is None else torch.distributed.get_world_size(tp_group)
        rank = 0 if tp_group is None else torch.distributed.get_rank(tp_group)
        model.load_state_dict(shard_state_dict(weights, config, rank, tp_size), assign=True)
        return model

    @torch.no_grad()
    def init_random_(self, seed: int) -> Llama:
        """Random weights from `seed`, drawn on the parameters' device (the same on every device
        of one type, so on every rank), scaled so that activations keep unit size through the
        layers."""
        device = next(self.parameters()).device
        gen = torch.Generator(device).manual_seed(seed)
        for name, p in sorted(self.named_parameters()):
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen, device=device))
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                p.copy_(torch.randn(p.shape, generator=gen, device=device) / fan_in**0.5)
        return self

    def _add_projection(self, x: torch.Tensor, h: torch.Tensor, proj: nn.Linear) -> torch.Tensor:
        """The residual update `x + proj(h)`, summed over the tensor-parallel ranks. On one rank
        it is one GEMM that accumulates into `x` (one kernel instead of a GEMM and an add)."""
        if self.tp_group is None:
            return x.addmm_(h, proj.weight.t())
        out = proj(h)
        torch.distributed.all_reduce(out, group=self.tp_group)
        return x + out

    @torch.no_grad()   # inference only: the residual stream is updated in place
    def forward(self, input_ids: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        d = self.config.head_dim
        x = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            hq, hkv = layer.num_heads, layer.num_kv_heads
            qkv = layer.qkv_proj(layer.input_norm(x))
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            attn = self.attention.forward(i, q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d), meta)
            x = self._add_projection(x, attn.flatten(1), layer.o_proj)
            gate, up = layer.gate_up_proj(layer.post_norm(x)).chunk(2, dim=-1)
            x = self._add_projection(x, F.silu(gate) * up, layer.down_proj)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden)).float()
