"""End to end: a random 1B-class Hugging Face Llama, eager vs stock `torch.compile` vs
`torch.compile` with `fx_passes`, in bf16 and with FP8 attention-output quantization.

Usage (GPU machine):  python benchmarks/bench_e2e_compile.py [--quick] [--cases prefill decode]
                      [--freezing] [--graphs] [--out DIR]
  --quick     a 2-layer, hidden-512 model, prefill 256 tokens, decode batch 4 / context 256 (smoke
              check; also runs on CPU with --device cpu, where times are perf_counter medians)
  --freezing  compile with `torch._inductor.config.freezing = True` (stock and passes alike): the
              weights become constants, which the q/k/v projection fusion needs
  --graphs    time CUDA-graph replays of each call (common.time_us) instead of eager launches
Writes JSON (GPU, versions, date, commit, every measurement) under --out (default
benchmarks/results/) and prints a table last.

Notes
-----
* Model: `LlamaForCausalLM` from a random config (16 layers, hidden 2048, intermediate 8192,
  32 query / 8 KV heads, head dim 64, vocab 32000, RoPE theta 500000), bf16, SDPA attention,
  `logits_to_keep=1` (a server samples only the last token).
* Cases: "prefill": one 2048-token sequence without a cache (`use_cache=False`); "decode": one
  step of batch 32 at context 2048 over a `StaticCache` filled by an eager prefill (the step
  rewrites position 2048 on every call: the timed call includes one `fill_` per layer that rewinds
  the cache's token count, in every mode).
* Modes: "eager"; "compile" (`torch.compile(model, fullgraph=True)`); "passes" (the same inside
  `fx_passes.enabled()`). "+fp8" variants register an attention implementation that quantizes
  SDPA's output to FP8 e4m3 with a static scale and dequantizes it (the shape of an FP8
  o_proj's input); with the passes the quantization becomes the op's `out_scale`.
* Per compiled mode: compile time (first call, FX-graph and AOTAutograd caches off), graph
  breaks, unique graphs (recompilations = unique graphs - 1 over the timed calls of one shape),
  the passes' counters (what was rewritten, what was declined: the decline reasons are logged
  with `--log-declines`). Logits are compared with eager's (max abs difference of the last
  token's logits; bf16 noise across 16 layers is ~1e-1 at these magnitudes).
* Timing: triton.testing.do_bench median (eager launches: host overhead included, which is what
  a Python serving loop without CUDA graphs pays; for the decode step that overhead dominates and
  varies from run to run), or with `--graphs` the median of CUDA-graph replays.
* Targets: prefill >= 1.15x and decode >= 1.3x stock compile; passes add <= 10% to
  compile time; zero graph breaks and recompilations. Expected from the passes as they are:
  prefill is rewritten onto attn::context_attention with RoPE inside; the decode step's SDPA (one
  query over the static cache, with k/v repeated by `repeat_kv`) onto attn::paged_decode reading
  the `[B, Hkv, S, D]` cache in place (`decode_to_paged`); the q/k/v projections fuse only with
  `--freezing`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

FP8_SCALE = 0.05   # |attention output| of this random model stays well below 448 * 0.05
MODES = ["eager", "compile", "passes"]


def llama_config(quick: bool):
    import transformers

    if quick:
        return transformers.LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
    return transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                    num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                    max_position_embeddings=8192, rope_theta=500000.0)


def register_fp8_attention() -> str:
    """An attention implementation: SDPA, then static FP8 quantization of its output
    (`clamp(o / scale, +-448)` to e4m3), dequantized for o_proj."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def sdpa_fp8_output(module, query, key, value, attention_mask, **kwargs):
        out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        scale = torch.tensor(FP8_SCALE, device=out.device)
        q8 = (out / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        return q8.to(out.dtype) * scale.to(out.dtype), weights

    AttentionInterface.register("sdpa_fp8_output", sdpa_fp8_output)
    return "sdpa_fp8_output"


def make_inputs(case: str, model, quick: bool, device):
    """(kwargs of one forward call, description, what to run before each call)."""
    import transformers

    vocab = model.config.vocab_size
    if case == "prefill":
        s = 256 if quick else 2048
        ids = torch.randint(0, vocab, (1, s), device=device)
        return dict(input_ids=ids, use_cache=False, logits_to_keep=1), f"1 x {s} tokens", lambda: None
    b, ctx = (4, 256) if quick else (32, 2048)
    cache = transformers.StaticCache(config=model.config, max_cache_len=ctx + 1)
    with torch.no_grad():
        model(input_ids=torch.randint(0, vocab, (b, ctx), device=device), past_key_values=cache, use_cache=True,
              logits_to_keep=1)
    step = dict(input_ids=torch.randint(0, vocab, (b, 1), device=device), past_key_values=cache, use_cache=True,
                cache_position=torch.tensor([ctx], device=device),
                position_ids=torch.full((b, 1), ctx, device=device), logits_to_keep=1)

    def rewind():   # the cache counts its tokens itself: back to ctx, so every call writes position ctx
        for layer in cache.layers:
            layer.cumulative_length.fill_(ctx)

    return step, f"batch {b}, context {ctx}", rewind


def median_time_us(fn, device, graphs: bool = False) -> tuple[float, str]:
    """(median µs, how it was timed): CUDA-graph replays (falling back to do_bench, which the
    second field then says), do_bench, or perf_counter on CPU."""
    if device.type == "cuda":
        return common.time_us([fn], calls=3, replays=10) if graphs else (common.do_bench_us(fn), "do_bench")
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times), "perf_counter"


def run_mode(model, kwargs, rewind, mode: str, device, *, freezing: bool = False, graphs: bool = False) -> dict:
    """Compile (if asked), time one forward; returns the row (without the case fields)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    import fx_passes

    torch._dynamo.reset()
    counters.clear()
    passes = fx_passes.enabled() if mode == "passes" else contextlib.nullcontext()
    fn = model if mode == "eager" else torch.compile(model, fullgraph=True)
    row = {}
    with passes, torch.no_grad(), inductor_config.patch(fx_graph_cache=False, freezing=freezing), \
            functorch_config.patch(enable_autograd_cache=False):
        rewind()
        start = time.perf_counter()
        logits = fn(**kwargs).logits
        if device.type == "cuda":
            torch.cuda.synchronize()
        if mode != "eager":
            row["compile_s"] = time.perf_counter() - start
        row["time_us"], row["timing"] = median_time_us(lambda: (rewind(), fn(**kwargs)), device, graphs)
        if mode != "eager":
            row["graph_breaks"] = sum(counters["graph_break"].values())
            row["unique_graphs"] = counters["stats"]["unique_graphs"]
            row["recompiles"] = max(0, counters["stats"]["unique_graphs"] - 1)
        if mode == "passes":
            row["passes"] = {k: v for k, v in counters["attn"].items() if v}
    row["logits"] = logits.float()[:, -1].cpu()
    torch._dynamo.reset()
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--cases", nargs="*", default=["prefill", "decode"], choices=["prefill", "decode"])
    p.add_argument("--no-fp8", action="store_true", help="skip the FP8-output variants")
    p.add_argument("--device", default="cuda")
    p.add_argument("--log-declines", action="store_true", help="log why a pass declined (DEBUG, logger fx_passes)")
    p.add_argument("--freezing", action="store_true", help="compile with inductor freezing (weights as constants)")
    p.add_argument("--graphs", action="store_true", help="time CUDA-graph replays instead of eager launches")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    if args.log_declines:
        logging.basicConfig()
        logging.getLogger("fx_passes").setLevel(logging.DEBUG)
    import transformers

    device = torch.device(args.device)
    torch.manual_seed(0)
    warm = torch.randn(64, 64, device=device)   # Inductor's one-time start-up, outside the compile times
    torch.compile(lambda x: (x @ x).relu())(warm)
    config = llama_config(args.quick)
    base = transformers.LlamaForCausalLM(config).to(device, torch.bfloat16).eval()
    impls = [("bf16", "sdpa")] + ([] if args.no_fp8 else [("fp8_out", register_fp8_attention())])
    payload = {"env": common.environment(), "quick": args.quick, "freezing": args.freezing, "graphs": args.graphs,
               "model": config.to_dict(), "rows": []}
    for case in args.cases:
        for variant, impl in impls:
            model = base
            model.set_attn_implementation(impl)
            kwargs, shape, rewind = make_inputs(case, model, args.quick, device)
            eager_logits = None
            for mode in MODES:
                row = {"case": case, "shape": shape, "variant": variant, "mode": mode}
                try:
                    row.update(run_mode(model, kwargs, rewind, mode, device, freezing=args.freezing,
                                        graphs=args.graphs))
                except Exception as e:  # noqa: BLE001 - a failing mode is recorded, the others still run
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                logits = row.pop("logits", None)
                if mode == "eager":
                    eager_logits = logits
                elif logits is not None and eager_logits is not None:
                    row["max_abs_diff_vs_eager"] = (logits - eager_logits).abs().max().item()
                payload["rows"].append(row)
                common.write_partial(args.out, "bench_e2e_compile", payload)
                print({k: v for k, v in row.items()}, flush=True)
    by_key = {(r["case"], r["variant"], r["mode"]): r for r in payload["rows"]}
    for r in payload["rows"]:
        stock = by_key.get((r["case"], r["variant"], "compile"), {})
        if "time_us" in r and "time_us" in stock:
            r["speedup_vs_compile"] = stock["time_us"] / r["time_us"]
        if r["mode"] == "passes" and "compile_s" in r and "compile_s" in stock:
            r["compile_time_vs_stock"] = r["compile_s"] / stock["compile_s"]
    path = common.write_json(args.out, "e2e_compile" + "_freezing" * args.freezing + "_graphs" * args.graphs, payload)
    print(common.table(payload["rows"], [
        ("case", "case", "s"), ("variant", "variant", "s"), ("mode", "mode", "s"), ("time_us", "us", ".1f"),
        ("speedup_vs_compile", "x compile", ".2f"), ("compile_s", "compile s", ".1f"),
        ("compile_time_vs_stock", "x compile s", ".2f"), ("graph_breaks", "breaks", "d"),
        ("recompiles", "recompiles", "d"), ("max_abs_diff_vs_eager", "|d logits|", ".3f")]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    import torch_ops

    torch_ops.warmup()   # the CUTLASS and CUDA decode libraries, which the automatic choice uses once built
    raise SystemExit(main())
