"""Continuous batching over a random-weight Llama-like model.

Requests with different prompt and output lengths arrive over time and finish; each step packs
decodes and prefill chunks into one batch (mixed batches through attn::paged_prefill); on a GPU,
steps made only of decodes replay a CUDA graph per batch-size bucket. Prints the warm-up's phases
and time (model, graphs, CUDA libraries, kernels), then tokens/s, the CPU time per step spent
building metadata and the GPU time per step. On CPU a tiny model runs through the reference
backend.

    python examples/serve.py                       # GPU: triton backend, CUDA graphs
    python examples/serve.py --backend vanilla     # the reference ops
    python examples/serve.py --check               # logits vs the vanilla backend, step by step
    TRITON_INTERPRET=1 python examples/serve.py --backend triton --check   # the same on CPU
"""

import argparse
import random
import statistics
import sys
import time

import torch

import torch_ops
from torch_ops.serving.attention import get_backend
from torch_ops.serving.cache_manager import KVCacheManager
from torch_ops.serving.engine import Engine, Request, generate
from torch_ops.serving.model import Llama, LlamaConfig, attention_config

GPU_MODEL = LlamaConfig(vocab_size=32000, hidden_size=2048, num_layers=8, num_heads=16, num_kv_heads=4,
                        head_dim=128, intermediate_size=5632)
CPU_MODEL = LlamaConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=16, intermediate_size=128)
CHECK_TIE_MARGIN = 0.5   # --check: a greedy choice whose top-2 logits are closer is a tie


def build(config, backend, device, dtype, args, graphs, tp_group=None):
    """An engine over `config` with the random weights of `args.seed`; with `tp_group`, this
    rank's shard of them (heads and MLP columns split across the group)."""
    tp_size = 1 if tp_group is None else torch.distributed.get_world_size(tp_group)
    attn_cfg = attention_config(config, device, tp_size)
    kv = KVCacheManager(config.num_layers, args.num_blocks, args.block_size, attn_cfg.num_kv_heads,
                        config.head_dim, dtype, device=device, prefix_caching=args.prefix_caching)
    attention = get_backend(backend)(attn_cfg, kv, max_num_seqs=args.max_num_seqs,
                                     max_num_tokens=args.max_num_tokens,
                                     max_blocks_per_seq=-(-(args.max_prompt + args.max_new) // args.block_size))
    model = Llama.random(config, args.seed, attention, tp_group=tp_group, device=device).to(dtype=dtype)
    buckets = tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= args.max_num_seqs) if graphs else ()
    return Engine(model, kv, max_num_seqs=args.max_num_seqs, max_num_tokens=args.max_num_tokens,
                  graph_buckets=buckets)


def make_requests(args, vocab):
    rng = random.Random(args.seed)
    requests = [Request(i, [rng.randrange(vocab) for _ in range(rng.randint(1, args.max_prompt))],
                        rng.randint(1, args.max_new)) for i in range(args.num_requests)]
    arrivals = sorted(rng.randint(0, args.arrival_steps) for _ in requests)
    return requests, arrivals


class Progress:
    """A one-line progress bar over generated tokens, with stats per step."""

    def __init__(self, total: int):
        self.total, self.done, self.steps = total, 0, []
        self.interactive = sys.stdout.isatty()

    def __call__(self, stats, engine):
        self.steps.append(stats)
        self.done = sum(len(r.output) for r in engine.finished.values()) + sum(
            len(r.output) for r in engine.running)
        if self.interactive or len(self.steps) % 50 == 0:
            frac = self.done / self.total
            bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
            end = "\r" if self.interactive else "\n"
            print(f"[{bar}] {self.done}/{self.total} tokens, step {len(self.steps)}, "
                  f"{stats.num_seqs} seqs", end=end, flush=True)


def arg_parser(cuda: bool, description: str) -> argparse.ArgumentParser:
    """The workload and engine options (also those of examples/serve_tp.py)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--backend", default="triton" if cuda else "vanilla",
                        help="attention backend: triton, vanilla (the reference ops) or flashinfer")
    parser.add_argument("--num-requests", type=int, default=256 if cuda else 12, help="requests in the run")
    parser.add_argument("--max-prompt", type=int, default=1024 if cuda else 24,
                        help="prompt lengths are drawn from 1..max-prompt")
    parser.add_argument("--max-new", type=int, default=256 if cuda else 12,
                        help="tokens to generate per request are drawn from 1..max-new")
    parser.add_argument("--arrival-steps", type=int, default=200 if cuda else 10,
                        help="requests arrive at steps drawn from 0..arrival-steps")
    parser.add_argument("--max-num-seqs", type=int, default=128 if cuda else 8, help="sequences per step")
    parser.add_argument("--max-num-tokens", type=int, default=2048 if cuda else 32,
                        help="new tokens per step (longer prompts are prefilled in chunks)")
    parser.add_argument("--num-blocks", type=int, default=16384 if cuda else 128, help="KV-cache blocks")
    parser.add_argument("--block-size", type=int, default=16 if cuda else 4, help="tokens per KV-cache block")
    parser.add_argument("--prefix-caching", action="store_true", help="share the blocks of common prompt prefixes")
    parser.add_argument("--no-graphs", action="store_true", help="run decode steps eagerly, without CUDA graphs")
    parser.add_argument("--tiny", action="store_true", help="the CPU model size on any device")
    parser.add_argument("--check", action="store_true",
                        help="rerun beside the vanilla backend, step by step with its tokens (teacher forcing): "
                             "report the largest logit difference, and fail where a clear greedy choice differs "
                             "(with another --backend)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the requests")
    return parser


def lockstep_check(config, args, device, dtype, graphs) -> tuple[int, float, int]:
    """The chosen backend and the vanilla backend on the same workload, one step each in turn:
    after every step the chosen backend's requests take the tokens the vanilla run sampled
    (teacher forcing), so both engines schedule the same batches. Returns the steps, the largest
    logit difference, and the steps' greedy choices that differ where vanilla's top-2 margin is
    at least `CHECK_TIE_MARGIN`."""
    tested = build(config, args.backend, device, dtype, args, graphs)
    reference = build(config, "vanilla", device, dtype, args, graphs=False)
    (ours, arrivals), (theirs, _) = (make_requests(args, config.vocab_size) for _ in range(2))
    pending = sorted(zip(arrivals, range(len(ours))))
    step = steps = flips = 0
    worst = 0.0
    while pending or reference.has_work:
        while pending and pending[0][0] <= step:
            i = pending.pop(0)[1]
            tested.add_request(ours[i])
            reference.add_request(theirs[i])
        if reference.step() is not None:
            tested.step()
            got, want = tested.last_logits.float(), reference.last_logits.float()
            worst = max(worst, (got - want).abs().max().item())
            top2 = want.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) >= CHECK_TIE_MARGIN
            flips += int(((got.argmax(-1) != want.argmax(-1)) & clear).sum())
            for a, b in zip(ours, theirs):
                a.output[:] = b.output
            tested.outputs_changed()
            steps += 1
        step += 1
    return steps, worst, flips


def main():
    cuda = torch.cuda.is_available()
    args = arg_parser(cuda, __doc__.splitlines()[0]).parse_args()
    if args.check and args.backend == "vanilla":
        raise SystemExit("--check compares a backend with vanilla: pass --backend triton "
                         "(on CPU with TRITON_INTERPRET=1, Triton's interpreter)")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    config = GPU_MODEL if cuda and not args.tiny else CPU_MODEL
    graphs = cuda and not args.no_graphs and get_backend(args.backend).graph_safe

    start = time.perf_counter()
    engine = build(config, args.backend, device, dtype, args, graphs)
    print(f"[serve {time.perf_counter() - start:6.1f} s] model and engine built", flush=True)
    torch_ops.warmup()
    engine.warmup()
    print(f"warm-up: {time.perf_counter() - start:.1f} s (engine with its CUDA graphs, CUDA libraries, the "
          "kernels of every prefill size)")
    requests, arrivals = make_requests(args, config.vocab_size)
    progress = Progress(sum(r.max_new_tokens for r in requests))
    start = time.perf_counter()
    outputs = generate(engine, requests, arrivals, on_step=progress)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    steps = progress.steps
    generated = sum(len(o) for o in outputs.values())
    prompt_tokens = sum(len(r.prompt) for r in requests)
    print()
    print(f"{device} {args.backend} backend, {config.num_layers} layers, hidden {config.hidden_size}, "
          f"{config.num_heads}/{config.num_kv_heads} heads, {len(requests)} requests, {len(steps)} steps "
          f"({sum(s.graph for s in steps)} CUDA-graph replays)")
    print(f"throughput: {generated / elapsed:.1f} generated tokens/s, "
          f"{(generated + prompt_tokens) / elapsed:.1f} tokens/s with prompts ({elapsed:.2f} s)")
    print(f"metadata build (CPU): median {statistics.median(s.metadata_us for s in steps):.1f} us/step, "
          f"max {max(s.metadata_us for s in steps):.1f} us; scheduling (cache appends included): median "
          f"{statistics.median(s.schedule_us for s in steps):.1f} us; step start to launch: median "
          f"{statistics.median(s.host_us for s in steps):.1f} us")
    gpu = [s.gpu_us for s in steps if s.gpu_us is not None]
    if gpu:
        decode = [s.gpu_us for s in steps if s.graph]
        print(f"GPU time: median {statistics.median(gpu):.1f} us/step"
              + (f", decode graph replays median {statistics.median(decode):.1f} us" if decode else ""))
    if args.check:
        del engine   # the check builds its own two engines
        steps, worst, flips = lockstep_check(config, args, device, dtype, graphs)
        print(f"check: {steps} steps in lockstep with the vanilla backend (teacher-forced): max |logit "
              f"difference| {worst:.3g}; {flips} greedy choices differ where vanilla's top-2 margin is "
              f">= {CHECK_TIE_MARGIN}")
        if flips:
            raise SystemExit("the backend's greedy choices differ from the vanilla backend's")


if __name__ == "__main__":
    main()
