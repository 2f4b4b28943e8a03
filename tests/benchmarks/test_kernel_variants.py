"""benchmarks/kernel_variants.py: the Triton variants a serving run compiles, counted on CPU."""

import importlib.util
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location(
    "kernel_variants", Path(__file__).resolve().parents[2] / "benchmarks" / "kernel_variants.py")
kernel_variants = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kernel_variants)


def test_variant_key_follows_triton_specialization():
    from torch_ops.kernels.paged_decode import _merge_kernel as fn

    params = kernel_variants._params(fn)
    names = [name for name, *_ in params]
    meta = {name: 1 for name, constexpr, *_ in params if constexpr}
    x = torch.empty(64, dtype=torch.float32)
    args = [x if name[0].isupper() else 32 for name, constexpr, *_ in params if not constexpr]
    key = kernel_variants.variant_key(fn, tuple(args), meta)
    assert key[0] == "_merge_kernel" and key == kernel_variants.variant_key(fn, tuple(args), dict(meta))
    unaligned = [x[1:] if isinstance(a, torch.Tensor) else a for a in args]
    assert kernel_variants.variant_key(fn, tuple(unaligned), meta) != key            # 16-byte alignment
    assert kernel_variants.variant_key(fn, tuple(args), {**meta, "num_warps": 8}) != key
    unspecialized = names.index("num_splits")   # do_not_specialize: any value, one variant
    changed = list(args)
    changed[unspecialized] = 33
    assert kernel_variants.variant_key(fn, tuple(changed), meta) == key
    specialized = names.index("stride_pt")
    changed[specialized] = 33
    assert kernel_variants.variant_key(fn, tuple(changed), meta) != key


def test_engine_warmup_compiles_every_variant_serving_needs():
    phases = kernel_variants.serving_variants(
        ["--max-num-seqs", "32", "--max-num-tokens", "512", "--num-requests", "64", "--max-prompt", "512",
         "--max-new", "32", "--arrival-steps", "50"])
    assert phases["graphs"] and phases["warmup"]
    assert phases["serving"] == set(), sorted(k[0] for k in phases["serving"])
    assert sum(map(len, phases.values())) <= 30
