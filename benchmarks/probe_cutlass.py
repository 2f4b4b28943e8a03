"""GPU probe: the persistent CUTLASS kernels against the plain ones (csrc/fmha_sm90.cu), side by side.

Builds (or loads) the library once, then runs every case in a process of its own with a time
limit, so that a hang or a trap in one case is reported as such and the others still run. Each
case makes fresh random inputs (bf16, or FP8 e4m3 with per-tensor amax scales), runs the plain and
the persistent kernel into poisoned buffers and reports:
- `rmse`: RMSE of heads 0-1 against the fp32 reference on the same (quantized) inputs, per variant;
- `max_diff`: max |persistent - plain| over every output element and lse (`equal`: bit for bit;
  both variants run the same mainloop on the same tiles);
- TFLOP/s of each (4 * sum(Lq * Lk_visible) * H * D, CUDA-graph timing from common.time_us);
- graph cases: one persistent call captured in a CUDA graph, replayed after new inputs and new
  sequence lengths were written in place; the replay against an eager call of each variant.
A case passes when nothing is NaN and the persistent output equals the plain one, or its RMSE is
within 1% of the plain kernel's.

    python benchmarks/probe_cutlass.py [--cases SUBSTRING] [--timeout 60] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import torch_ops  # noqa: E402
from torch_ops import quant, reference  # noqa: E402
from torch_ops.kernels.cuda import fmha_sm90, fmha_sm90_build  # noqa: E402
from torch_ops.testing import poison_  # noqa: E402

RAGGED = [5003, 77, 3000, 1, 129, 8174]   # 16384 tokens, sequence starts off the 16-token grid
UNIFORM = {"8k": [8192] * 2, "2k": [2048] * 8}


@dataclass(frozen=True)
class Case:
    """`heads` query/KV heads of head dim `d` over packed sequences `lens`."""

    fp8: bool
    d: int
    causal: bool
    shape: str            # "8k", "2k" or "ragged"
    graph: bool = False   # a CUDA-graph replay check instead of timing

    @property
    def name(self) -> str:
        kind = "graph" if self.graph else ("causal" if self.causal else "full")
        return f"{'fp8' if self.fp8 else 'bf16'} d{self.d} {self.shape} {kind}"

    @property
    def heads(self) -> int:
        return 32 if self.d == 128 else 16

    @property
    def lens(self) -> list[int]:
        return RAGGED if self.shape == "ragged" else UNIFORM[self.shape]

    @property
    def flops(self) -> int:
        pairs = sum(n * (n + 1) // 2 if self.causal else n * n for n in self.lens)
        return 4 * pairs * self.heads * self.d


def cases() -> list[Case]:
    found = [Case(fp8, d, causal, shape) for fp8 in (True, False) for d in (128, 256)
             for shape in ("8k", "ragged") for causal in (False, True)]
    found += [Case(True, 128, causal, "2k") for causal in (False, True)]
    found += [Case(True, 128, True, "ragged", graph=True), Case(False, 256, False, "ragged", graph=True)]
    return found


def cumsum(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lens], dtype=torch.int64).cumsum(0).to("cuda", torch.int32)


def make_inputs(case: Case) -> tuple[tuple, dict]:
    """`(q, k, v, cu_q, cu_k)` and the FP8 scales (empty for bf16), fresh random data."""
    t = sum(case.lens)
    q, k, v = (torch.randn(t, case.heads, case.d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = cumsum(case.lens)
    if not case.fp8:
        return (q, k, v, cu, cu.clone()), {}
    (q8, qs), (k8, ks), (v8, vs) = (quant.quantize_fp8_amax(x) for x in (q, k, v))
    return (q8, k8, v8, cu, cu.clone()), {"q_scale": qs, "k_scale": ks, "v_scale": vs}


class Runner:
    """Calls the kernel of one variant on fixed inputs into fixed, poisoned output buffers."""

    def __init__(self, case: Case, args: tuple, scales: dict, persistent: bool):
        self.case, self.args, self.scales, self.persistent = case, args, scales, persistent
        self.out = torch.empty(args[0].shape, dtype=torch.bfloat16, device="cuda")
        self.lse = torch.empty(args[0].shape[:2], device="cuda")

    def __call__(self):
        if fmha_sm90.PERSISTENT is not self.persistent:
            fmha_sm90.PERSISTENT = self.persistent
            torch_ops.clear_plans()   # plans read the knob
        with torch_ops.use_backend("cutlass"):
            torch.ops.attn.context_attention.out(*self.args, causal=self.case.causal, out=self.out, lse=self.lse,
                                                 **self.scales)

    def fresh(self) -> tuple[torch.Tensor, torch.Tensor]:
        poison_(self.out)
        poison_(self.lse)
        self()
        torch.cuda.synchronize()
        return self.out.clone(), self.lse.clone()


def rmse(out: torch.Tensor, args: tuple, scales: dict, causal: bool) -> float:
    """RMSE of heads 0-1 of `out` against the fp32 reference."""
    q, k, v, cu_q, cu_k = args
    truth, _ = reference.context_attention(q[:, :2], k[:, :2], v[:, :2], cu_q, cu_k, causal=causal,
                                           compute_dtype=torch.float32, **scales)
    return (out[:, :2].float() - truth.float()).pow(2).mean().sqrt().item()


def compare(row: dict, name: str, a: tuple, b: tuple) -> None:
    """`row[name + '_max_diff']` (outputs and lse; non-finite counts as inf) and `_equal`."""
    diffs = [(x.float() - y.float()).abs().nan_to_num(float("inf")).max().item() for x, y in zip(a, b)]
    row[f"{name}_max_diff"] = max(diffs)
    row[f"{name}_equal"] = all(torch.equal(x, y) for x, y in zip(a, b))


def run_case(case: Case) -> dict:
    torch.manual_seed(0)
    args, scales = make_inputs(case)
    row = {"case": case.name, "heads": case.heads, "num_seqs": len(case.lens), "tflop": case.flops / 1e12}
    plain, persistent = (Runner(case, args, scales, p) for p in (False, True))
    if case.graph:
        return graph_case(case, args, scales, plain, persistent, row)
    results = {}
    for label, runner in (("plain", plain), ("persistent", persistent)):
        results[label] = runner.fresh()
        row[f"{label}_nan"] = bool(results[label][0].isnan().any() or results[label][1].isnan().any())
        row[f"{label}_rmse"] = rmse(results[label][0], args, scales, case.causal)
        us, how = common.time_us([runner], calls=10, replays=7)
        row[f"{label}_tflops"], row[f"{label}_timing"] = case.flops / us / 1e6, how
    compare(row, "vs_plain", results["persistent"], results["plain"])
    row["speedup"] = row["persistent_tflops"] / row["plain_tflops"]
    row["ok"] = (not row["plain_nan"] and not row["persistent_nan"]
                 and (row["vs_plain_equal"] or row["persistent_rmse"] <= 1.01 * row["plain_rmse"]))
    return row


def graph_case(case: Case, args: tuple, scales: dict, plain: Runner, persistent: Runner, row: dict) -> dict:
    """Capture the persistent call, write new inputs and lengths in place, replay, compare."""
    from torch_ops.gpu import capture_cuda_graph

    graph, _ = capture_cuda_graph(persistent)
    new_args, new_scales = make_inputs(case)
    new_lens = case.lens[::-1]   # as many sequences, other boundaries (starts still off the 16 grid)
    for dst, src in zip(args[:3], new_args[:3]):
        dst.copy_(src)
    for name, s in new_scales.items():
        scales[name].copy_(s)
    args[3].copy_(cumsum(new_lens))
    args[4].copy_(args[3])
    poison_(persistent.out)
    poison_(persistent.lse)
    graph.replay()
    torch.cuda.synchronize()
    replayed = persistent.out.clone(), persistent.lse.clone()
    compare(row, "replay_vs_eager_persistent", replayed, persistent.fresh())
    compare(row, "replay_vs_eager_plain", replayed, plain.fresh())
    row["persistent_nan"] = bool(replayed[0].isnan().any() or replayed[1].isnan().any())
    row["persistent_rmse"] = rmse(replayed[0], args, scales, case.causal)
    row["plain_rmse"] = rmse(plain.out, args, scales, case.causal)
    row["ok"] = (not row["persistent_nan"] and row["replay_vs_eager_persistent_equal"]
                 and (row["replay_vs_eager_plain_equal"] or row["persistent_rmse"] <= 1.01 * row["plain_rmse"]))
    return row


def format_row(r: dict) -> str:
    if "error" in r:
        return f"{r['case']:24} {r['error']}"
    if "plain_tflops" in r:
        speed = f"{r['plain_tflops']:7.0f} {r['persistent_tflops']:7.0f} {r['speedup']:6.2f}x"
        diff = "equal" if r["vs_plain_equal"] else f"{r['vs_plain_max_diff']:.1e}"
    else:
        speed = f"{'replay':>23}"
        diff = ("equal" if r["replay_vs_eager_plain_equal"] else f"{r['replay_vs_eager_plain_max_diff']:.1e}") + (
            "" if r["replay_vs_eager_persistent_equal"] else " (replay != eager persistent)")
    return (f"{r['case']:24} {speed} {r['plain_rmse']:9.2e} {r['persistent_rmse']:9.2e} {diff:>10}  "
            f"{'ok' if r['ok'] else 'FAIL'}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="", help="run only the cases whose name contains this")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per case (its own process)")
    p.add_argument("--out", default=None, help="folder for a JSON of the rows (default: none)")
    p.add_argument("--run-case", default=None, help=argparse.SUPPRESS)   # child mode: one case, JSON on stdout
    args = p.parse_args()
    by_name = {c.name: c for c in cases()}
    if args.run_case:
        print("RESULT " + json.dumps(run_case(by_name[args.run_case])), flush=True)
        return

    start = time.perf_counter()
    print(f"library: {fmha_sm90_build.library_path()} ({time.perf_counter() - start:.0f} s)", flush=True)
    print(f"{'case':24} {'plain':>7} {'persist':>7} {'speed':>7} {'rmse pl':>9} {'rmse pe':>9} "
          f"{'vs plain':>10}  (TFLOP/s; rmse heads 0-1 vs fp32)", flush=True)
    rows = []
    for name in (n for n in by_name if args.cases in n):
        try:
            done = subprocess.run([sys.executable, __file__, "--run-case", name], capture_output=True, text=True,
                                  timeout=args.timeout)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
            row = json.loads(lines[-1][7:]) if lines else {
                "case": name, "error": f"FAIL: exit {done.returncode}: {done.stderr.strip()[-300:]}"}
        except subprocess.TimeoutExpired:
            row = {"case": name, "error": f"FAIL: no result within {args.timeout:.0f} s (hang?)"}
        rows.append(row)
        print(format_row(row), flush=True)
    failed = [r["case"] for r in rows if not r.get("ok")]
    print(f"{len(rows) - len(failed)}/{len(rows)} ok in {time.perf_counter() - start:.0f} s"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    if args.out:
        print(f"wrote {common.write_json(args.out, 'probe_cutlass', {'env': common.environment(), 'rows': rows})}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
