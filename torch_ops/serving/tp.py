"""Tensor parallelism for `torch_ops.serving.model.Llama`: attention heads (query and KV heads
alike) and MLP columns split evenly across the ranks of a `torch.distributed` group; each rank
keeps the KV cache of its own KV heads; the model all-reduces after `o_proj` and `down_proj`.
Embeddings, norms and the LM head are replicated."""

from __future__ import annotations

import torch

from torch_ops.serving.model import LlamaConfig


def check_divisible(config: LlamaConfig, world_size: int) -> None:
    for name in ("num_heads", "num_kv_heads", "intermediate_size"):
        if getattr(config, name) % world_size:
            raise ValueError(f"{name}={getattr(config, name)} must be divisible by the "
                             f"tensor-parallel size {world_size}")


def shard_state_dict(state: dict[str, torch.Tensor], config: LlamaConfig, rank: int,
                     world_size: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s part of a full `Llama` state dict."""
    check_divisible(config, world_size)
    d = config.head_dim

    def part(x: torch.Tensor, dim: int) -> torch.Tensor:
        return x.chunk(world_size, dim=dim)[rank]

    out = {}
    for name, w in state.items():
        if name.endswith("qkv_proj.weight"):  # rows: q heads, k heads, v heads
            q, k, v = w.split([config.num_heads * d, config.num_kv_heads * d, config.num_kv_heads * d])
            w = torch.cat([part(q, 0), part(k, 0), part(v, 0)])
        elif name.endswith("gate_up_proj.weight"):  # rows: gate, up
            gate, up = w.chunk(2)
            w = torch.cat([part(gate, 0), part(up, 0)])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            w = part(w, 1)
        out[name] = w.clone()
    return out
