"""`model.generate()` tokens/s: transformers' static-cache compile path, stock and with `fx_passes`.

Usage (GPU machine):  python benchmarks/bench_generate.py [--quick] [--models llama gemma2]
                      [--batch 1 8 32] [--new-tokens 128] [--out DIR]
  --quick     2-layer, hidden-512 models, batch 1 and 4, prompts of 64-128 tokens, 16 new tokens
              (smoke check; also runs on CPU with --device cpu)
Writes JSON (GPU, versions, date, commit, every row) under --out (default benchmarks/results/)
and prints a table last.

Method
* Models: random-weight, bf16. "llama": 16 layers, hidden 2048, 32/8 heads of dim 64 (a 1B
  Llama), SDPA attention. "gemma2": the same size in Gemma 2's shape: alternating sliding-window
  (4096) and global layers, attention logit soft-capping 50, head dim 128, 8/4 heads, eager
  attention (the only one transformers runs Gemma 2 with).
* A batch: prompts of random lengths in [512, 2048] (left-padded to the longest, with their
  attention mask), greedy decoding of `--new-tokens` tokens (no early stop: eos disabled).
* Modes, each `generate(..., cache_implementation="static")`:
  - "eager": no compile;
  - "compile": transformers' own compile of the decode steps (`generation_config.compile_config`,
    fullgraph, default mode: no CUDA graphs);
  - "passes": the same inside `fx_passes.enabled()`: the decode steps' attention runs on
    `attn::paged_decode` (the mask, which `generate()` builds outside the graph, as `key_mask`);
  - "compile/graphs", "passes/graphs": the same with `mode="reduce-overhead"` (CUDA graphs).
* Each row runs in a process of its own (the same model and prompts, drawn from one seed), so
  that no mode inherits another's compiled graphs, CUDA-graph pools or compile workers.
* Per row: the first `generate()` (compile included) in seconds, then the median of 3 timed
  runs: tokens/s = batch x new tokens / seconds (prefill included, as a user pays it); graph
  breaks, graphs compiled and (CUDA graphs) graphs that ran without them (`cudagraph_skips`); the
  passes' counters; whether the tokens equal eager's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common  # noqa: E402

MODES = ["eager", "compile", "passes", "compile/graphs", "passes/graphs"]


def model_config(name: str, quick: bool):
    import transformers

    size = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2) if quick else \
        dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16)
    common_kw = dict(vocab_size=32000, max_position_embeddings=8192, **size)
    if name == "llama":
        return transformers.LlamaConfig(num_attention_heads=32 if not quick else 8, num_key_value_heads=8 if not quick else 2,
                                        head_dim=64, rope_theta=500000.0, **common_kw)
    return transformers.Gemma2Config(num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                                     sliding_window=4096 if not quick else 64, attn_logit_softcapping=50.0,
                                     final_logit_softcapping=30.0, query_pre_attn_scalar=128, **common_kw)


def make_batch(batch: int, quick: bool, vocab: int, device, seed: int = 0):
    """Left-padded prompts of random lengths and their attention mask."""
    rng = random.Random(seed)
    lo, hi = (64, 128) if quick else (512, 2048)
    lengths = [rng.randint(lo, hi) for _ in range(batch)]
    longest = max(lengths)
    ids = torch.zeros(batch, longest, dtype=torch.long)
    mask = torch.zeros(batch, longest, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, longest - n:] = torch.tensor([rng.randrange(1, vocab) for _ in range(n)])
        mask[b, longest - n:] = 1
    return ids.to(device), mask.to(device), lengths


def run_mode(model, ids, mask, mode: str, new_tokens: int, device) -> tuple[dict, torch.Tensor]:
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    import fx_passes

    torch._dynamo.reset()
    counters.clear()
    base = mode.split("/")[0]
    config = model.generation_config
    config.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead" if mode.endswith("graphs") else "default")
    config.compile_config._compile_all_devices = device.type != "cuda"   # transformers compiles on GPUs only, else
    config.disable_compile = base == "eager"
    kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  cache_implementation="static", pad_token_id=0)
    passes = fx_passes.enabled() if base == "passes" else contextlib.nullcontext()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    row = {}
    with passes, torch.no_grad(), inductor_config.patch(fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):
        start = time.perf_counter()
        tokens = model.generate(ids, **kwargs)
        sync()
        row["first_s"] = time.perf_counter() - start
        times = []
        for _ in range(3):
            start = time.perf_counter()
            model.generate(ids, **kwargs)
            sync()
            times.append(time.perf_counter() - start)
    row["seconds"] = statistics.median(times)
    row["tokens_per_s"] = ids.shape[0] * new_tokens / row["seconds"]
    if base != "eager":
        row["graph_breaks"] = sum(counters["graph_break"].values())
        row["graphs_compiled"] = counters["stats"]["unique_graphs"]   # recompiles included
        if mode.endswith("graphs"):
            row["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]   # graphs run without CUDA graphs
    if base == "passes":
        row["passes"] = {k: v for k, v in counters["attn"].items() if v}
    torch._dynamo.reset()
    return row, tokens[:, ids.shape[1]:].cpu()


def _build_model(name: str, quick: bool, device):
    import transformers

    torch.manual_seed(0)
    config = model_config(name, quick)
    impl = "eager" if name == "gemma2" else "sdpa"   # transformers runs Gemma 2 through eager attention only
    with device:   # weights drawn on the device: no host copy of a 1B model per row
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl)
    return model.eval().to(torch.bfloat16), config


def _one_row(args) -> int:
    """A child process: one (model, batch, mode) row, printed as `ROW <json>` with its tokens."""
    device = torch.device(args.device)
    name, batch, mode = args.row
    model, config = _build_model(name, args.quick, device)
    ids, mask, _ = make_batch(int(batch), args.quick, config.vocab_size, device)
    row, tokens = run_mode(model, ids, mask, mode, args.new_tokens, device)
    print("ROW " + json.dumps({**row, "tokens": tokens.tolist()}), flush=True)
    return 0


def _run_row(args, name: str, batch: int, mode: str) -> tuple[dict, list | None]:
    """One row in a fresh process (no mode inherits another's compiled graphs, CUDA-graph pools or
    compile workers); (row, tokens), or an `error` row."""
    cmd = [sys.executable, __file__, "--row", name, str(batch), mode, "--device", args.device,
           "--new-tokens", str(args.new_tokens)] + (["--quick"] if args.quick else [])
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("ROW ")]
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {done.returncode}: {tail[:300]}"}, None
    row = json.loads(lines[-1][4:])
    return row, row.pop("tokens")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--models", nargs="*", default=["llama", "gemma2"], choices=["llama", "gemma2"])
    p.add_argument("--batch", nargs="*", type=int)
    p.add_argument("--new-tokens", type=int)
    p.add_argument("--modes", nargs="*", default=MODES, choices=MODES)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--row", nargs=3, help=argparse.SUPPRESS)   # a child process's one row
    args = p.parse_args(argv)
    args.new_tokens = args.new_tokens or (16 if args.quick else 128)
    if args.row:
        return _one_row(args)
    device = torch.device(args.device)
    modes = [m for m in args.modes if device.type == "cuda" or not m.endswith("graphs")]
    batches = args.batch or ([1, 4] if args.quick else [1, 8, 32])
    rows = []
    payload = {"env": common.environment(), "args": vars(args), "rows": rows}
    for name in args.models:
        config = model_config(name, args.quick)
        for batch in batches:
            lengths = make_batch(batch, args.quick, config.vocab_size, "cpu")[2]
            eager_tokens = None
            for mode in modes:
                row, tokens = _run_row(args, name, batch, mode)
                if mode == "eager":
                    eager_tokens = tokens
                elif eager_tokens is not None and tokens is not None:
                    row["tokens_equal_eager"] = "yes" if tokens == eager_tokens else "no"
                rows.append({"model": name, "batch": batch, "prompt_lengths": lengths,
                             "new_tokens": args.new_tokens, "mode": mode, **row})
                print({k: v for k, v in rows[-1].items() if k != "prompt_lengths"}, flush=True)
                common.write_partial(args.out, "bench_generate", payload)
    path = common.write_json(args.out, "generate", payload)
    print(f"# wrote {path}")
    print(common.table(rows, [("model", "model", "s"), ("batch", "B", "d"), ("mode", "mode", "s"),
                              ("tokens_per_s", "tokens/s", ".0f"), ("first_s", "first s", ".1f"),
                              ("tokens_equal_eager", "= eager", "s")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
