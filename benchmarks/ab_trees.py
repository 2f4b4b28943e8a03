"""Device time of the Triton kernels in this tree (and in candidate trees) against a baseline tree.

The evidence for kernel changes that should cost nothing (memory-safety checks, refactors):
every round times the same cases in a fresh process per tree, the trees in order, then in reverse
order in the next round (A B B A), and the report gives,
per case, the median over rounds of this tree's time over the baseline's, then the median and the
largest ratio per kernel family. Times are CUDA-graph replays (`common.cuda_graph_time_us`) of
the `triton` backend's ops.

    git worktree add /tmp/base <commit>   # or any directory holding another `torch_ops` package
    python benchmarks/ab_trees.py --baseline /tmp/base --label <commit> --out benchmarks/results
    python benchmarks/ab_trees.py --baseline /tmp/base --trees /tmp/candidate   # and another tree
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import common

ROOT = Path(__file__).resolve().parent.parent
PAGE, HQ, HKV, D = 16, 32, 8, 128


def cases(quick: bool, formats: list[str] | None = None) -> list[dict]:
    """(kind, fmt, batch, keys[, queries]) of the timed calls; `quick`: one per family and format;
    `formats`: only the cases of these cache formats."""
    batches, contexts = ((64,), (4096,)) if quick else ((1, 64, 256), (1024, 4096))
    out = [dict(kind="decode", fmt=f, batch=b, keys=n) for f in ("bf16", "fp8", "int8")
           for b in batches for n in contexts]
    out += [dict(kind="paged_prefill", fmt="bf16", batch=4, keys=8192, queries=2048)]
    if not quick:
        out += [dict(kind="paged_prefill", fmt="bf16", batch=16, keys=2048, queries=256)]
    out += [dict(kind="context", fmt="bf16", batch=1, keys=n, queries=n) for n in ((8192,) if quick else (2048, 8192))]
    return [c for c in out if not formats or c["fmt"] in formats]


def _cache(blocks: int, fmt: str):
    """Random K/V caches `[blocks, PAGE, HKV, D]` of `fmt` and their scale kwargs."""
    import torch

    from torch_ops import quant

    k, v = (torch.randn(blocks, PAGE, HKV, D, device="cuda") for _ in range(2))
    if fmt == "bf16":
        return k.bfloat16(), v.bfloat16(), {}
    if fmt == "fp8":
        s = torch.tensor(0.02, device="cuda")
        return (quant.quantize_fp8(k, s, torch.float8_e4m3fn), quant.quantize_fp8(v, s, torch.float8_e4m3fn),
                dict(k_scale=s, v_scale=s))
    (kq, ks), (vq, vs) = (quant.quantize_groupwise(x, 8, 32) for x in (k, v))
    return kq, vq, dict(k_scale=ks, v_scale=vs)


def call(case: dict):
    """A no-argument function running `case` through the `triton` backend."""
    import torch

    b, n = case["batch"], case["keys"]
    rows = lambda t, h: torch.randn(t, h, D, dtype=torch.bfloat16, device="cuda")   # noqa: E731
    if case["kind"] == "context":
        q, k, v = rows(n, HQ), rows(n, HKV), rows(n, HKV)
        cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        return lambda: torch.ops.attn.context_attention(q, k, v, cu, cu, causal=True)
    per = n // PAGE
    k, v, scales = _cache(b * per, case["fmt"])
    tables = torch.randperm(b * per, device="cuda").to(torch.int32).view(b, per)
    lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
    if case["kind"] == "decode":
        q = rows(b, HQ)
        return lambda: torch.ops.attn.paged_decode(q, k, v, tables, lens, **scales)
    m = case["queries"]
    q = rows(b * m, HQ)
    cu = torch.arange(b + 1, dtype=torch.int32, device="cuda") * m
    return lambda: torch.ops.attn.paged_prefill(q, k, v, tables, cu, lens, **scales)


def worker(out: str, quick: bool, formats: list[str] | None) -> None:
    """Time every case with the `torch_ops` this process imports; write the rows to `out`."""
    import torch

    import torch_ops

    rows = []
    torch.manual_seed(0)
    with torch_ops.use_backend("triton"):
        for case in cases(quick, formats):
            fn = call(case)
            rows.append(dict(case, us=common.cuda_graph_time_us([fn], calls=5 if case["kind"] != "decode" else 20),
                             torch_ops=str(Path(torch_ops.__file__).parent)))
            del fn
            torch.cuda.empty_cache()
    Path(out).write_text(json.dumps(rows))


def summarize(rounds: list[tuple[list[dict], list[dict]]]) -> dict:
    """Per case the median over rounds of this/baseline, and per kind the median and largest ratio.
    `rounds`: (baseline rows, this tree's rows) of each round."""
    key = lambda r: (r["kind"], r["fmt"], r["batch"], r["keys"])   # noqa: E731
    ratios: dict[tuple, list[float]] = {}
    times: dict[tuple, tuple[list[float], list[float]]] = {}
    for base, ours in rounds:
        base_us = {key(r): r["us"] for r in base}
        for r in ours:
            ratios.setdefault(key(r), []).append(r["us"] / base_us[key(r)])
            times.setdefault(key(r), ([], []))
            times[key(r)][0].append(base_us[key(r)])
            times[key(r)][1].append(r["us"])
    per_case = [dict(kind=k[0], fmt=k[1], batch=k[2], keys=k[3], baseline_us=statistics.median(times[k][0]),
                     us=statistics.median(times[k][1]), ratio=statistics.median(v)) for k, v in ratios.items()]
    per_kind = {}
    for kind in dict.fromkeys(r["kind"] for r in per_case):
        rs = [r["ratio"] for r in per_case if r["kind"] == kind]
        per_kind[kind] = dict(median=statistics.median(rs), max=max(rs), cases=len(rs))
    return dict(cases=per_case, kinds=per_kind)


def time_trees(trees: list, rounds: int, run) -> dict:
    """{tree: [rows of each round]}: `run(tree, round, index)` of every tree in every round, the
    trees in order, then in reverse order in the next round."""
    times = {tree: [] for tree in trees}
    for i in range(rounds):
        order = list(enumerate(trees))
        for j, tree in order if i % 2 == 0 else order[::-1]:
            times[tree].append(run(tree, i, j))
        print(f"round {i + 1}/{rounds} done", flush=True)
    return times


def _print(summary: dict) -> None:
    print(common.table(summary["cases"], [("kind", "kind", "s"), ("fmt", "fmt", "s"), ("batch", "batch", "d"),
                                          ("keys", "keys", "d"), ("baseline_us", "baseline us", ".1f"),
                                          ("us", "us", ".1f"), ("ratio", "ratio", ".3f")]))
    for kind, s in summary["kinds"].items():
        print(f"{kind}: median ratio {s['median']:.3f}, largest {s['max']:.3f} over {s['cases']} cases")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", help="a directory holding the baseline's torch_ops package")
    p.add_argument("--label", default="", help="what the baseline is (a commit), for the JSON")
    p.add_argument("--trees", nargs="*", default=[],
                   help="more directories holding a torch_ops package (candidates), timed in the same rounds")
    p.add_argument("--rounds", type=int, default=2, help="rounds, the trees in order then in reverse order")
    p.add_argument("--quick", action="store_true", help="one case per kernel family and format")
    p.add_argument("--formats", nargs="*", choices=("bf16", "fp8", "int8"), help="only the cases of these cache formats")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.quick, args.formats)
    if not args.baseline:
        p.error("--baseline is required")

    def run(tree: Path, out: str) -> list[dict]:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]))
        cmd = [sys.executable, __file__, "--worker", out, *(["--quick"] if args.quick else []),
               *(["--formats", *args.formats] if args.formats else [])]
        subprocess.run(cmd, env=env, check=True)
        return json.loads(Path(out).read_text())

    baseline = Path(args.baseline).resolve()
    trees = [baseline, ROOT, *(Path(t).resolve() for t in args.trees)]
    with tempfile.TemporaryDirectory() as tmp:
        times = time_trees(trees, args.rounds, lambda tree, i, j: run(tree, f"{tmp}/{i}_{j}.json"))
    summary = summarize(list(zip(times[baseline], times[ROOT])))
    others = {str(tree): summarize(list(zip(times[baseline], times[tree]))) for tree in trees[2:]}
    print(f"== this tree against {args.label or baseline}")
    _print(summary)
    for tree, other in others.items():
        print(f"== {tree} against {args.label or baseline}")
        _print(other)
    rounds = [(times[baseline][i], times[ROOT][i]) for i in range(args.rounds)]
    path = common.write_json(args.out, "ab_trees", dict(env=common.environment(), baseline=args.label or str(baseline),
                                                       quick=args.quick, rounds=rounds, **summary, trees=others))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
