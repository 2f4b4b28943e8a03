"""benchmarks/ab_trees.py on CPU: the cases it times and how it turns rounds into ratios."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
_spec = importlib.util.spec_from_file_location("ab_trees", ROOT / "benchmarks" / "ab_trees.py")
ab_trees = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab_trees)


def test_quick_cases_cover_every_family_and_format_once():
    quick = ab_trees.cases(quick=True)
    assert {(c["kind"], c["fmt"]) for c in quick} == {
        ("decode", "bf16"), ("decode", "fp8"), ("decode", "int8"), ("paged_prefill", "bf16"), ("context", "bf16")}
    assert len(quick) == 5 and len(ab_trees.cases(quick=False)) > len(quick)


def test_summary_takes_each_case_median_ratio_then_each_family_median_and_max():
    def rows(decode_us, prefill_us):
        return [dict(kind="decode", fmt="bf16", batch=1, keys=1024, us=decode_us[0]),
                dict(kind="decode", fmt="fp8", batch=1, keys=1024, us=decode_us[1]),
                dict(kind="paged_prefill", fmt="bf16", batch=4, keys=8192, us=prefill_us)]

    rounds = [(rows((10, 20), 100), rows((11, 20), 90)),
              (rows((10, 20), 100), rows((13, 22), 110)),
              (rows((10, 20), 100), rows((12, 21), 100))]
    summary = ab_trees.summarize(rounds)
    by_case = {(c["kind"], c["fmt"]): c for c in summary["cases"]}
    assert by_case["decode", "bf16"]["ratio"] == pytest.approx(1.2)
    assert by_case["decode", "fp8"]["ratio"] == pytest.approx(1.05)
    assert by_case["decode", "bf16"]["us"] == 12 and by_case["decode", "bf16"]["baseline_us"] == 10
    assert summary["kinds"]["decode"] == dict(median=pytest.approx(1.125), max=pytest.approx(1.2), cases=2)
    assert summary["kinds"]["paged_prefill"]["median"] == pytest.approx(1.0)


def test_rounds_alternate_the_order_of_the_trees():
    calls = []
    times = ab_trees.time_trees(["base", "ours", "cand"], 3, lambda tree, i, j: calls.append(tree) or [dict(i=i)])
    assert calls == ["base", "ours", "cand", "cand", "ours", "base", "base", "ours", "cand"]
    assert times == {tree: [[dict(i=0)], [dict(i=1)], [dict(i=2)]] for tree in ("base", "ours", "cand")}
