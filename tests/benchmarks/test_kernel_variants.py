"""benchmarks/kernel_variants.py: the Triton variants a serving run compiles, counted on CPU."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "kernel_variants", Path(__file__).resolve().parents[2] / "benchmarks" / "kernel_variants.py")
kernel_variants = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kernel_variants)


def test_engine_warmup_compiles_every_variant_serving_needs():
    phases = kernel_variants.serving_variants(
        ["--max-num-seqs", "32", "--max-num-tokens", "512", "--num-requests", "64", "--max-prompt", "512",
         "--max-new", "32", "--arrival-steps", "50"])
    assert phases["graphs"] and phases["warmup"]
    assert phases["serving"] == set(), sorted(k[0] for k in phases["serving"])
    assert sum(map(len, phases.values())) <= 30
