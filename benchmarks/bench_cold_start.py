"""Cold start of a serving process: `examples/serve.py` on a fresh Triton cache, then again on it.

What the first start of a serving process on a machine costs against every later start: the
whole process's wall time, its warm-up (the engine's compile round among it) and the cubins the
cold run wrote; the serving run after the warm-up should take the same time in both. Each pair of
runs gets a fresh temporary Triton cache (`TRITON_CACHE_DIR`). attn-ops' own C++/CUDA libraries
are built once, before the first pair, into `ATTN_CACHE_DIR`: the pairs time Triton's compilation,
not nvcc's.

    python benchmarks/bench_cold_start.py [--pairs 2] [--out DIR] [-- serve.py arguments]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

ROOT = Path(__file__).resolve().parent.parent
SERVE = ROOT / "examples" / "serve.py"
# (field, pattern, type): what examples/serve.py prints of its phases
PHASES = (
    ("built_s", r"^\[serve\s+([\d.]+) s\] model and engine built", float),
    ("compile_round_s", r"^\[engine warmup\s+([\d.]+) s\] \d+ kernel variants compiled", float),
    ("variants", r"^\[engine warmup\s+[\d.]+ s\] (\d+) kernel variants compiled", int),
    ("warmup_s", r"^warm-up: ([\d.]+) s", float),
    ("tokens_per_s", r"^throughput: ([\d.]+) generated tokens/s", float),
    ("serving_s", r"^throughput: .*\(([\d.]+) s\)", float),
)


def phases(log: str) -> dict:
    """The phase times and counts serve.py printed (`PHASES`); a field it did not print is absent.
    `compile_round_s` counts from the start of the engine's warm-up."""
    found = {}
    for field, pattern, kind in PHASES:
        match = re.search(pattern, log, re.M)
        if match:
            found[field] = kind(match.group(1))
    return found


def run_serve(serve_args: list[str], triton_cache: Path, timeout_s: float) -> dict:
    """One serve.py process on `triton_cache`: its wall time, phases, the cache's cubins after it,
    and its exit status (with the log's tail when it failed)."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(triton_cache)}
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, str(SERVE), *serve_args], env=env, capture_output=True, text=True,
                              timeout=timeout_s)
        log, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        parts = (p.decode() if isinstance(p, bytes) else p for p in (e.stdout, e.stderr) if p)
        log, rc = "".join(parts), "timeout"
    row = {"wall_s": time.perf_counter() - start, **phases(log),
           "cubins": sum(1 for _ in triton_cache.rglob("*.cubin")), "rc": rc}
    if rc != 0:
        row["log_tail"] = log[-2000:]
    return row


def summary(rows: list[dict]) -> list[dict]:
    """Per pair: cold and warm wall time and their ratio."""
    out = []
    for pair in sorted({r["pair"] for r in rows}):
        runs = {r["run"]: r for r in rows if r["pair"] == pair}
        if {"cold", "warm"} <= runs.keys():
            cold, warm = runs["cold"]["wall_s"], runs["warm"]["wall_s"]
            out.append({"pair": pair, "cold_s": cold, "warm_s": warm, "ratio": cold / warm})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=2, help="cold/warm pairs, each on a fresh Triton cache")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per serve.py run")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("serve_args", nargs="*", help="arguments for examples/serve.py (after --)")
    args = p.parse_args()

    subprocess.run([sys.executable, "-c", "import torch_ops; torch_ops.warmup(progress=False)"], check=True)
    payload = {"env": common.environment(), "args": vars(args), "rows": []}
    for pair in range(args.pairs):
        with tempfile.TemporaryDirectory(prefix="attn_cold_start_") as cache:
            for run in ("cold", "warm"):
                row = {"pair": pair, "run": run, **run_serve(args.serve_args, Path(cache), args.timeout)}
                payload["rows"].append(row)
                common.write_partial(args.out, "bench_cold_start", payload)
                print(f"pair {pair} {run:4}: {row['wall_s']:6.1f} s, warm-up {row.get('warmup_s', '-')} s, "
                      f"{row.get('variants', '-')} variants compiled, {row['cubins']} cubins, rc {row['rc']}", flush=True)
    payload["summary"] = summary(payload["rows"])
    for s in payload["summary"]:
        print(f"pair {s['pair']}: cold {s['cold_s']:.1f} s, warm {s['warm_s']:.1f} s, {s['ratio']:.2f}x")
    print(f"wrote {common.write_json(args.out, 'bench_cold_start', payload)}")


if __name__ == "__main__":
    main()
