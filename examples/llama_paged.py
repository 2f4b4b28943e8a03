"""A compact Llama (GQA, RoPE, RMSNorm, SwiGLU) serving a few sequences from a paged KV cache
through explicit `torch.ops.attn.*` calls, checked against a plain PyTorch formulation.

Each layer writes its new keys and values with `attn::kv_cache_write` and attends with
`attn::paged_prefill` (prompts) or `attn::paged_decode` (one token per sequence). The plain
formulation runs each sequence's whole history through the same weights with dense causal SDPA.
With `--compile`, the step runs under `torch.compile(fullgraph=True, dynamic=True)` with
`fx_passes` enabled, which moves the model's RoPE into the cache write (and the query's into the
same launch). CPU (reference ops) or GPU (Triton kernels).

    python examples/llama_paged.py [--steps 3] [--compile]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

import torch_ops  # noqa: F401  (registers torch.ops.attn)
from torch_ops.kv_cache import BlockAllocator, BlockTables, PagedKVCache
from torch_ops.metadata import MetadataBuilder
from torch_ops.testing import assert_error_ratio


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 256
    hidden: int = 128
    layers: int = 2
    heads: int = 8
    kv_heads: int = 2
    ffn: int = 256
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclasses.dataclass
class Paged:
    """What one step's attention reads besides q/k/v: each layer's `(k_cache, v_cache)`
    `[num_blocks, block_size, Hkv, D]` and the batch's metadata (`torch_ops.metadata`)."""

    caches: list[tuple[torch.Tensor, torch.Tensor]]
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    decode: bool


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: Config, index: int):
        super().__init__()
        self.cfg, self.index = cfg, index
        d = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.heads * d, cfg.hidden, bias=False)

    def forward(self, x, cos, sin, paged: Paged | None):
        """`x [T, hidden]`, `cos`/`sin [T, 1, D]`; `paged` None: T tokens of one sequence from
        position 0, dense causal attention."""
        t, cfg = x.shape[0], self.cfg
        q = self.q_proj(x).view(t, cfg.heads, cfg.head_dim)
        k = self.k_proj(x).view(t, cfg.kv_heads, cfg.head_dim)
        v = self.v_proj(x).view(t, cfg.kv_heads, cfg.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if paged is None:
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                               is_causal=True, enable_gqa=True).transpose(0, 1)
        else:
            k_cache, v_cache = paged.caches[self.index]
            torch.ops.attn.kv_cache_write(k, v, k_cache, v_cache, paged.slot_mapping)
            if paged.decode:
                o, _ = torch.ops.attn.paged_decode(q, k_cache, v_cache, paged.block_tables, paged.seq_lens)
            else:
                o, _ = torch.ops.attn.paged_prefill(q, k_cache, v_cache, paged.block_tables, paged.cu_seqlens_q,
                                                    paged.seq_lens)
        return self.o_proj(o.reshape(t, -1))


class Block(nn.Module):
    def __init__(self, cfg: Config, index: int):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(cfg.hidden), nn.RMSNorm(cfg.hidden)
        self.attn = Attention(cfg, index)
        self.gate_up = nn.Linear(cfg.hidden, 2 * cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, x, cos, sin, paged):
        x = x + self.attn(self.attn_norm(x), cos, sin, paged)
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Llama(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        d = cfg.head_dim
        self.register_buffer("inv_freq", 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2).double() / d))

    def forward(self, tokens, positions, paged: Paged | None = None):
        """Logits `[T, vocab]` of `tokens [T]` at `positions [T]`."""
        freqs = positions[:, None].to(self.inv_freq.dtype) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]                       # [T, 1, D]
        x = self.embed(tokens)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin, paged)
        return self.lm_head(self.norm(x))


def dense_logits(model: Llama, history: list[int], new: int, device) -> torch.Tensor:
    """The plain formulation: the last `new` rows of the logits over a sequence's whole history."""
    tokens = torch.tensor(history, device=device)
    return model(tokens, torch.arange(len(history), device=device))[-new:]


class Server:
    """Sequences on a paged cache: `step(new_tokens)` appends each sequence's new tokens, runs
    the model once on all of them, and returns their logits."""

    def __init__(self, model: Llama, device, *, num_blocks=64, block_size=16, max_tokens=256):
        cfg = model.cfg
        dtype = next(model.parameters()).dtype
        self.model = model
        self.caches = [PagedKVCache.allocate(num_blocks, block_size, cfg.kv_heads, cfg.head_dim, dtype, device=device)
                       for _ in range(cfg.layers)]
        for c in self.caches:
            c.k.normal_()   # stale contents: every slot read is written first
            c.v.normal_()
        self.tables = BlockTables(BlockAllocator(num_blocks), block_size)
        self.builder = MetadataBuilder(max_num_seqs=8, max_num_tokens=max_tokens,
                                       max_blocks_per_seq=num_blocks, block_size=block_size, device=device)
        self.history: list[list[int]] = []
        self.device = device

    def step(self, new_tokens: list[list[int]], forward=None) -> torch.Tensor:
        for i, toks in enumerate(new_tokens):
            if i == len(self.history):
                self.history.append([])
                self.tables.add(i, 0)
            self.tables.append(i, len(toks))
            self.history[i] += toks
        ids = range(len(new_tokens))
        meta = self.builder.build([self.tables.seq_len(i) for i in ids], [len(t) for t in new_tokens],
                                  [self.tables.block_table(i) for i in ids])
        decode = all(len(t) == 1 for t in new_tokens)
        paged = Paged([(c.k, c.v) for c in self.caches], meta.slot_mapping, meta.block_tables, meta.seq_lens,
                      meta.cu_seqlens_q, decode)
        tokens = torch.tensor([t for toks in new_tokens for t in toks], device=self.device)
        return (self.model if forward is None else forward)(tokens, meta.positions, paged)

    def check(self, logits: torch.Tensor, new_tokens: list[list[int]], model64: Llama) -> None:
        """`logits` as close to the float64 plain formulation as the plain one in the model's dtype."""
        truth, base = ([dense_logits(m, h, len(t), self.device) for h, t in zip(self.history, new_tokens)]
                       for m in (model64, self.model))
        assert_error_ratio(logits, torch.cat(truth), torch.cat(base), name="logits")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="decode steps after the prefill")
    parser.add_argument("--compile", action="store_true", help="torch.compile with fx_passes")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = Llama(Config()).to(device, torch.bfloat16).eval()
    model64 = copy.deepcopy(model).double()
    server = Server(model, device)
    forward = None
    if args.compile:
        import fx_passes
        from torch._dynamo.utils import counters

        fx_passes.enable()
        forward = torch.compile(model, fullgraph=True, dynamic=True)
    prompts = [torch.randint(0, model.cfg.vocab, (n,)).tolist() for n in (13, 5, 21)]
    new = prompts
    with torch.no_grad():
        for step in range(args.steps + 1):
            logits = server.step(new, forward)
            server.check(logits, new, model64)
            last = logits[torch.tensor([len(t) for t in new], device=device).cumsum(0) - 1]
            new = [[t] for t in last.argmax(-1).tolist()]
            print(f"{'prefill' if step == 0 else 'decode':8} tokens {logits.shape[0]:3d}  "
                  f"lengths {[len(h) for h in server.history]}  next {[t[0] for t in new]}")
    if args.compile:
        print("fx_passes:", {k: v for k, v in counters["attn"].items() if v})
    print(f"logits match the plain formulation ({device}, {'compiled' if args.compile else 'eager'})")


if __name__ == "__main__":
    main()
