"""benchmarks/bench_host.py on CPU: its timing helper, every row's inputs through the ops' checks and the
reference, and rows that record n/a or an error instead of raising."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import torch_ops

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_host", ROOT / "benchmarks" / "bench_host.py")
bench_host = importlib.util.module_from_spec(_spec)
sys.modules["bench_host"] = bench_host  # dataclasses look their module up
_spec.loader.exec_module(bench_host)

TINY = bench_host.Shape(batch=3, ctx=10, hq=4, hkv=2, d=16, page=4, prefill_seqs=2, prefill_q=3)
CPU = bench_host.Config(iters=5, repeats=3, warmup=1, device_time=lambda fns, **kw: (1e9, "test"))


def test_host_time_of_a_cpu_callable_syncs_between_bursts():
    syncs = []
    host, wall = bench_host.host_time_us(lambda: sum(range(1000)), iters=40, repeats=3, sync=lambda: syncs.append(1))
    assert host > 0 and wall > 0
    bursts = -(-40 // bench_host.BURST)
    assert len(syncs) == 3 * (bursts + 2)   # per round: one per burst, two around the back-to-back calls


@pytest.mark.parametrize("op, variant", [(op, v) for op, vs in bench_host.VARIANTS.items() for v in vs])
def test_rows_build_valid_inputs(op, variant):
    args, kwargs = bench_host.BUILDERS[op](variant, TINY, "cpu")
    with torch_ops.use_backend("vanilla"):
        result = getattr(torch.ops.attn, op)(*args, **kwargs)
    outputs = result if isinstance(result, tuple) else (result,)
    assert all(torch.isfinite(t.float()).all() for t in outputs)
    if op in ("paged_decode", "merge_states", "cache_attention"):
        assert outputs[0].shape == (TINY.batch, TINY.hq, TINY.d)
    if variant == "bf16 out_scale":
        assert outputs[0].dtype == torch.float8_e4m3fn
    if variant == "bf16 + rope":
        assert outputs[0].shape == (TINY.batch, TINY.hq, TINY.d)


def test_measure_records_times_na_and_errors():
    make = bench_host.ours("merge_states", "bf16", TINY, "cpu")
    row = bench_host.measure({"op": "merge_states", "variant": "bf16", "backend": "auto"}, make, CPU)
    assert row["chosen"] == "vanilla" and row["first_ms"] > 0 and row["host_us"] > 0 and row["wall_us"] > 0
    assert row["bound"] == "device" and "error" not in row
    assert ("replan_us" in row) == hasattr(torch_ops.backends, "clear_plans")

    na = bench_host.measure({"op": "merge_states"}, make, CPU, pin="cuda")
    assert "cannot run attn::merge_states" in na["na"] and "host_us" not in na and "first_ms" not in na

    def broken():
        raise RuntimeError("boom")
    bad = bench_host.measure({"op": "paged_decode"}, broken, CPU, pin="triton")
    assert bad["error"] == "RuntimeError: boom"

    table = bench_host.format_table([row, na, bad]).splitlines()
    assert table[0].split()[:3] == ["op", "variant", "backend"] and len(table) == 4
    assert "-> vanilla" in table[1] and "n/a: backend 'cuda'" in table[2] and "error: RuntimeError: boom" in table[3]


def test_plan_rows_cover_every_variant_backend_and_peer():
    rows = [base for base, _, _ in bench_host.plan_rows(TINY, ["cutlass", "triton"])]
    ours = [r for r in rows if r["backend"] in ("auto", "cutlass", "triton")]
    assert len(ours) == 3 * sum(len(v) for v in bench_host.VARIANTS.values())
    assert {"op": "paged_decode", "variant": "bf16", "backend": "sdpa"} in rows
    assert sum(r["backend"] == "flashinfer" for r in rows) == 3
