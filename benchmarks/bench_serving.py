"""Serving benchmark (GPU): decode throughput and per-step latency of the engine (triton
backend, CUDA-graph decode steps) at batch 1..128 vs transformers' generate with a static cache
and torch.compile(mode="reduce-overhead") on the same random-weight Llama, plus the metadata
build CPU time at 256 sequences (target <= 50 us), and one replayed decode step at batch 64
against the sum of its kernels' durations (target <= 1.05). JSON under benchmarks/results/.

    python benchmarks/bench_serving.py                  # full grid (> 10 min on an H200)
    python benchmarks/bench_serving.py --grid           # batch 1 16 64 128, 64 new tokens, one repetition
    python benchmarks/bench_serving.py --quick          # smoke run: small model, batch 1 and 8
    python benchmarks/bench_serving.py --metadata-only  # CPU or GPU: per-step metadata + append µs
    (--out DIR: where the JSON goes, default benchmarks/results)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch_ops  # noqa: E402,F401
from common import environment, table, write_json, write_partial  # noqa: E402
from torch_ops.serving.attention import get_backend  # noqa: E402
from torch_ops.serving.cache_manager import KVCacheManager  # noqa: E402
from torch_ops.serving.engine import Engine, Request  # noqa: E402
from torch_ops.serving.model import Llama, LlamaConfig, attention_config  # noqa: E402

OUT = Path(__file__).resolve().parent / "results"
MODEL = LlamaConfig(vocab_size=32000, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                    head_dim=64, intermediate_size=5632, max_position=8192)
REPLAY_BATCH = 64  # the decode step whose replay is compared with its kernels' times
QUICK_MODEL = LlamaConfig(vocab_size=1024, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                          head_dim=64, intermediate_size=512)


def metadata_step_us(num_seqs: int, kind: str, *, context=2048, block_size=16, steps=400,
                     device="cpu") -> dict:
    """CPU µs per step of the host work `Engine.step` does between scheduling and launch for
    `num_seqs` running sequences of `context / 2 .. context` cached tokens, called as `Engine`
    calls them: the cache appends of the step's new tokens (`KVCacheManager.append_batch`:
    `append_us`), then the metadata (`AttentionBackend.prepare` given the rows that
    `append_batch` returned: `MetadataBuilder`, the host-to-device copy: `prepare_us`); medians
    over `steps` steps, and the median of their per-step sums (`total_us`). `kind`: "decode"
    (one new token each), "prefill" (4096 new tokens split evenly) or "mixed" (half decode, half
    prefill chunks of 2048 tokens in all). Tables grow across block boundaries as the steps go.
    Each step gets a new list of the same ids, as in the engine's steady decode steps
    (`BlockTables.rows` answers them from its last lookup).
    """
    rng = np.random.default_rng(num_seqs)
    chunk = {"decode": 1, "prefill": 4096 // num_seqs, "mixed": 4096 // num_seqs}[kind]
    max_blocks = (context + chunk) // block_size + 1  # a model length of context + chunk
    query_lens = np.array([1 if kind == "mixed" and i % 2 else chunk for i in range(num_seqs)])
    num_tokens = int(query_lens.sum())
    kv = KVCacheManager(1, num_seqs * max_blocks + 1, block_size, 1, 8, torch.float16, device=device)
    config = attention_config(LlamaConfig(num_heads=1, num_kv_heads=1, head_dim=8), device)
    attention = get_backend("vanilla")(config, kv, max_num_seqs=num_seqs, max_num_tokens=num_tokens,
                                       max_blocks_per_seq=max_blocks)
    ids = list(range(num_seqs))
    for i, n in zip(ids, rng.integers(context // 2, context, num_seqs).tolist()):
        kv.add(i)
        kv.append(i, n)
    append_us, prepare_us, total_us = [], [], []
    for _ in range(steps):
        if kv.tables.lens.max() + chunk > max_blocks * block_size:  # keep within the table
            for i in ids:
                kv.free(i)
                kv.add(i)
                kv.append(i, context // 2)
        step_ids = list(ids)
        t0 = time.perf_counter()
        rows = kv.append_batch(step_ids, query_lens)
        t1 = time.perf_counter()
        attention.prepare(step_ids, query_lens, rows=rows)
        t2 = time.perf_counter()
        append_us.append((t1 - t0) * 1e6)
        prepare_us.append((t2 - t1) * 1e6)
        total_us.append((t2 - t0) * 1e6)
    if device != "cpu":
        torch.cuda.synchronize()
    return {"kind": kind, "num_seqs": num_seqs, "num_tokens": num_tokens,
            "prepare_us": statistics.median(prepare_us), "append_us": statistics.median(append_us),
            "total_us": statistics.median(total_us)}


def engine_step_us(num_seqs: int, device: str, steps: int) -> dict:
    """The same work timed inside `Engine.step` (`StepStats.schedule_us`: the whole scheduler,
    its `append_batch` included; `metadata_us`: `prepare`; `host_us`: everything from the
    step's start to the launch, input ids included), medians over `steps` decode steps
    of `num_seqs` requests with short prompts on a tiny model: the vanilla backend in fp32 on
    CPU, the triton backend in bf16 with CUDA-graph decode steps on CUDA. Unlike the grid's
    back-to-back loop, each step's host work here follows a forward (and on CUDA a wait for
    the GPU), so it runs with colder caches, as in serving."""
    config = LlamaConfig(vocab_size=64, hidden_size=64, num_layers=1, num_heads=1, num_kv_heads=1,
                         head_dim=64, intermediate_size=64)
    cuda = device == "cuda"
    block_size, prompt_len = 16, 8
    max_blocks = (prompt_len + steps + 4) // block_size + 1
    dtype = torch.bfloat16 if cuda else torch.float32
    kv = KVCacheManager(1, num_seqs * max_blocks + 1, block_size, 1, 64, dtype, device=device)
    attention = get_backend("triton" if cuda else "vanilla")(
        attention_config(config, device), kv, max_num_seqs=num_seqs,
        max_num_tokens=num_seqs * prompt_len, max_blocks_per_seq=max_blocks)
    model = Llama.random(config, 0, attention, device=device).to(dtype=dtype)
    engine = Engine(model, kv, max_num_seqs=num_seqs, max_num_tokens=num_seqs * prompt_len,
                    graph_buckets=(num_seqs,) if cuda else ())
    for i in range(num_seqs):
        engine.add_request(Request(i, [i % 64] * prompt_len, steps + 2))
    stats = [engine.step() for _ in range(steps + 1)][1:]  # the first step is the prefill
    assert all(s.num_seqs == s.num_tokens == num_seqs and s.graph == cuda for s in stats)
    return {"kind": "engine decode", "num_seqs": num_seqs, "num_tokens": num_seqs,
            "prepare_us": statistics.median(s.metadata_us for s in stats),
            "append_us": statistics.median(s.schedule_us for s in stats),
            "total_us": statistics.median(s.metadata_us + s.schedule_us for s in stats),
            "host_us": statistics.median(s.host_us for s in stats)}


def metadata_grid(device: str, steps: int) -> list[dict]:
    rows = [metadata_step_us(n, kind, steps=steps, device=device)
            for kind in ("decode", "prefill", "mixed") for n in (1, 64, 256)]
    for n in (64, 256):
        try:
            rows.append(engine_step_us(n, device, steps=min(steps, 100)))
        except Exception as e:  # noqa: BLE001 - recorded and printed; the grid above still counts
            rows.append({"kind": "engine decode", "num_seqs": n, "error": f"{type(e).__name__}: {e}"[:300]})
            print("engine decode row failed:", rows[-1]["error"], flush=True)
    print(table(rows, [("kind", "kind", "s"), ("num_seqs", "seqs", "d"), ("num_tokens", "tokens", "d"),
                       ("prepare_us", "metadata us/step", ".1f"),
                       ("append_us", "append us/step (engine: whole scheduler)", ".1f"),
                       ("total_us", "sum us/step", ".1f"),
                       ("host_us", "step start to launch us", ".1f")]), flush=True)
    return rows


def ours(model, config, batch, prompt_len, new_tokens) -> tuple[dict, Engine]:
    """Engine decode steps of `batch` requests (prefill excluded from the decode timing) with
    `model`'s weights and a fresh cache and attention backend; returns the row and the engine.
    On CUDA: the triton backend in bf16 with CUDA-graph decode steps; on CPU (a smoke run) the
    vanilla backend in fp32, eagerly."""
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    block_size = 16
    blocks = batch * (-(-(prompt_len + new_tokens) // block_size)) + 8
    kv = KVCacheManager(config.num_layers, blocks, block_size, config.num_kv_heads, config.head_dim,
                        dtype, device=device)
    model.attention = get_backend("triton" if cuda else "vanilla")(
        attention_config(config, device), kv, max_num_seqs=batch,
        max_num_tokens=max(batch, prompt_len * batch), max_blocks_per_seq=blocks)
    engine = Engine(model, kv, max_num_seqs=batch, max_num_tokens=max(batch, prompt_len * batch),
                    graph_buckets=(batch,) if cuda else ())
    gen = torch.Generator().manual_seed(batch)
    for i in range(batch):
        engine.add_request(Request(i, torch.randint(0, config.vocab_size, (prompt_len,), generator=gen).tolist(),
                                   new_tokens))
    steps = []
    while engine.has_work:
        t0 = time.perf_counter()
        stats = engine.step()
        steps.append((stats, (time.perf_counter() - t0) * 1e6))
    decode = [(s, wall) for s, wall in steps if s.graph == cuda and s.num_seqs == s.num_tokens == batch]
    wall = sum(w for _, w in decode)
    return {"decode_steps": len(decode), "tokens_per_s": batch * len(decode) / (wall / 1e6),
            "step_wall_us": statistics.median(w for _, w in decode),
            "step_gpu_us": statistics.median(s.gpu_us for s, _ in decode) if cuda else None,
            "metadata_us": statistics.median(s.metadata_us for s, _ in decode),
            "host_us": statistics.median(s.host_us for s, _ in decode)}, engine


def replay_vs_kernels(engine: Engine, bucket: int, replays: int = 100) -> dict:
    """One captured decode step replayed `replays` times on the last step's metadata, against
    the median over replays of the sum of its kernels' durations (torch.profiler, CUDA
    activity): `replay_us`, the GPU time per replay of `replays` back-to-back replays between
    two CUDA events (`ratio`, the target's: kernels plus the gaps between them), and
    `replay_wall_us`, the median of replays timed one at a time after a sync (`ratio_isolated`:
    also the host's `cudaGraphLaunch` of every node before the first kernel can start)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    graph = engine._graphs[bucket][0]
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    walls = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        walls.append(start.elapsed_time(end) * 1e3)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    back_to_back = start.elapsed_time(end) * 1e3 / replays
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.elapsed_us()) for e in prof.events()
                     if e.device_type == DeviceType.CUDA)
    row = {"batch": bucket, "replays": replays, "replay_us": back_to_back,
           "replay_wall_us": statistics.median(walls), "kernels_per_replay": len(kernels) / replays}
    if not kernels or len(kernels) % replays:
        row["error"] = f"{len(kernels)} CUDA events for {replays} replays: cannot split them per replay"
        row["kernel_sum_us"] = sum(d for _, d in kernels) / replays
    else:
        n = len(kernels) // replays
        row["kernel_sum_us"] = statistics.median(sum(d for _, d in kernels[i:i + n])
                                                 for i in range(0, len(kernels), n))
    if row["kernel_sum_us"]:
        row["ratio"] = row["replay_us"] / row["kernel_sum_us"]
        row["ratio_isolated"] = row["replay_wall_us"] / row["kernel_sum_us"]
    return row


def hf_model(config):
    """transformers' Llama with the same shapes (its own random weights: the speed does not
    depend on them). `generate` with a static cache compiles `forward` itself (its
    `compile_config`, here fullgraph with mode="reduce-overhead", once for all batches) and marks
    each CUDA-graph step; compiling `forward` by hand as well made generate read CUDA-graph
    outputs that the next replay had overwritten."""
    import transformers

    hf_cfg = transformers.LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                                      intermediate_size=config.intermediate_size,
                                      num_hidden_layers=config.num_layers,
                                      num_attention_heads=config.num_heads,
                                      num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim,
                                      max_position_embeddings=config.max_position)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(hf_cfg).to(torch.bfloat16).eval()
    model.generation_config.compile_config = transformers.CompileConfig(fullgraph=True, mode="reduce-overhead")
    model.generation_config.disable_compile = False
    return model


def transformers_static(model, config, batch, prompt_len, new_tokens, reps: int) -> dict:
    """transformers' greedy generate with a static cache on `hf_model`; the decode rate is
    (new_tokens - 1) tokens over (time(new_tokens) - time(1 token)), median of `reps`.
    `warmup_s`: the first calls at this batch size (compilation, CUDA-graph recording)."""
    ids = torch.randint(0, config.vocab_size, (batch, prompt_len), device="cuda")
    kw = dict(do_sample=False, cache_implementation="static", pad_token_id=0)

    def run(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    for _ in range(1 if reps == 1 else 2):  # compile and warm up both shapes
        run(new_tokens), run(1)
    warmup_s = time.perf_counter() - t0
    decode_s = statistics.median(run(new_tokens) - run(1) for _ in range(reps))
    return {"tokens_per_s": batch * (new_tokens - 1) / decode_s,
            "step_wall_us": decode_s / (new_tokens - 1) * 1e6, "warmup_s": warmup_s}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--grid", action="store_true",
                        help="the trimmed GPU grid: --batches, --new-tokens, one repetition, no metadata rows")
    parser.add_argument("--batches", type=int, nargs="+", help="batch sizes (default: per mode)")
    parser.add_argument("--new-tokens", type=int, help="generated tokens per request (default: per mode)")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--metadata-only", action="store_true",
                        help="only the per-step metadata and append CPU time (runs on CPU too)")
    parser.add_argument("--out", default=str(OUT), help="directory of the JSON results")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.metadata_only:
        payload = {"env": environment(), "metadata": metadata_grid(device, steps=100 if args.quick else 400)}
        print("wrote", write_json(args.out, "serving_metadata", payload))
        return
    config = QUICK_MODEL if args.quick else MODEL
    default_batches = (1, 8) if args.quick else (1, 16, 64, 128) if args.grid else (1, 2, 4, 8, 16, 32, 64, 128)
    batches = args.batches or default_batches
    prompt_len = 32 if args.quick else 512
    new_tokens = args.new_tokens or (16 if args.quick else 64 if args.grid else 128)
    reps = 1 if args.grid else 3
    try:
        import transformers
        hf_version = transformers.__version__
    except ImportError as e:
        hf_version = f"unavailable: {e}"
    payload = {"env": {**environment(), "transformers": hf_version}, "model": config.__dict__,
               "prompt_len": prompt_len, "new_tokens": new_tokens, "hf_reps": reps,
               "metadata": [] if args.grid else metadata_grid(device, steps=100 if args.quick else 400),
               "rows": [], "replay": None}
    name = "serving_grid" if args.grid else "serving"
    cuda = device == "cuda"
    model = Llama.random(config, 0, device=device).to(dtype=torch.bfloat16 if cuda else torch.float32)
    hf = None
    for batch in batches:
        row, engine = ours(model, config, batch, prompt_len, new_tokens)
        row = {"batch": batch, **{f"ours_{k}": v for k, v in row.items()}}
        if cuda and (batch == REPLAY_BATCH or (payload["replay"] is None and batch == max(batches))):
            payload["replay"] = replay_vs_kernels(engine, batch)
        del engine
        if cuda and not args.no_transformers:
            try:
                if hf is None:
                    hf = hf_model(config)
                row.update({f"hf_{k}": v for k, v in
                            transformers_static(hf, config, batch, prompt_len, new_tokens, reps).items()})
                row["speedup"] = row["ours_tokens_per_s"] / row["hf_tokens_per_s"]
            except Exception as e:  # noqa: BLE001 - a failing peer is recorded, not fatal
                row["hf_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        payload["rows"].append(row)
        write_partial(args.out, name, payload)
        if cuda:
            torch.cuda.empty_cache()
    print(table(payload["rows"], [("batch", "batch", "d"), ("ours_tokens_per_s", "ours tok/s", ".0f"),
                                  ("ours_step_wall_us", "step us", ".1f"), ("ours_step_gpu_us", "gpu us", ".1f"),
                                  ("ours_host_us", "host us", ".1f"), ("ours_metadata_us", "meta us", ".1f"),
                                  ("hf_tokens_per_s", "hf tok/s", ".0f"), ("speedup", "x hf", ".2f")]))
    replay = payload["replay"]
    if replay is not None:
        print(f"decode step replay at batch {replay['batch']}: {replay['replay_us']:.1f} us back to back "
              f"({replay['replay_wall_us']:.1f} us one at a time), {replay['kernel_sum_us']:.1f} us of kernels "
              f"({replay['kernels_per_replay']:.0f} per replay), ratio {replay['ratio']:.3f} (target <= 1.05; "
              f"one at a time {replay['ratio_isolated']:.3f})" + (f"; {replay['error']}" if "error" in replay else ""))
    if not args.quick:
        print("wrote", write_json(args.out, name, payload))


if __name__ == "__main__":
    import torch_ops

    torch_ops.warmup()   # the CUTLASS and CUDA decode libraries, which the automatic choice uses once built
    main()
