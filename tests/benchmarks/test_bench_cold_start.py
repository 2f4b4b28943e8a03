"""benchmarks/bench_cold_start.py: what it reads off serve.py's output, its per-pair summary, and the
report section made from it."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load("bench_cold_start")
report = _load("report")

COLD_LOG = """[serve    4.7 s] model and engine built
[attn-ops warmup    0.2 s] CUTLASS library: built
[engine warmup   16.1 s] 20 kernel variants compiled in parallel
[engine warmup   17.7 s] 8 decode CUDA graphs captured
warm-up: 24.5 s (engine with its CUDA graphs, CUDA libraries, the kernels of every prefill size)
[#-----------------------------] 1714/31808 tokens, step 50, 66 seqs
throughput: 22264.4 generated tokens/s, 115457.9 tokens/s with prompts (1.43 s)
"""


def test_phases_read_off_serve_output():
    assert bench.phases(COLD_LOG) == {"built_s": 4.7, "compile_round_s": 16.1, "variants": 20, "warmup_s": 24.5,
                                      "tokens_per_s": 22264.4, "serving_s": 1.43}
    assert bench.phases("Traceback (most recent call last):\n") == {}   # a failed run: nothing made up


def _rows():
    cold = {"pair": 0, "run": "cold", "wall_s": 30.0, **bench.phases(COLD_LOG), "cubins": 20, "rc": 0}
    warm = {**cold, "run": "warm", "wall_s": 20.0, "variants": 0, "compile_round_s": 1.5, "warmup_s": 11.7}
    failed = {"pair": 1, "run": "cold", "wall_s": 3.0, "cubins": 0, "rc": 1}
    return [cold, warm, failed]


def test_summary_pairs_cold_with_warm():
    assert bench.summary(_rows()) == [{"pair": 0, "cold_s": 30.0, "warm_s": 20.0, "ratio": 1.5}]


def test_report_section():
    data = {"env": {}, "args": {"pairs": 2, "timeout": 300.0, "out": "/x", "serve_args": []}, "rows": _rows(),
            "summary": bench.summary(_rows())}
    text, lines, _, cmd = report.cold_start(data, "bench_cold_start_x")
    assert "(its defaults)" in text
    assert lines[2] == "| 0 | 30.0 | 20.0 | 1.50 | 24.5 / 11.7 | 16.1 / 1.5 | 20 | 20 | 1.43 / 1.43 |"
    assert lines[-1] == "- pair 1 cold: exit 1"
    assert cmd == "python benchmarks/bench_cold_start.py"
