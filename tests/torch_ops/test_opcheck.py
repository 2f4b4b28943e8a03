"""`torch.library.opcheck` for every op and overload over several inputs: schema (declared
mutations, fresh outputs), fake tensors, and AOT dispatch with dynamic shapes."""

import pytest
import torch
from torch.utils._pytree import tree_leaves

import torch_ops  # noqa: F401
from torch_ops import testing
from torch_ops.quant import FP8_DTYPES

from . import samples

CASES = [(op, v) for op, variants in samples.VARIANTS.items() for v in variants]
ALL_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _assert_only_declared_mutations(op, args, kwargs):
    """test_schema's replacement for fp8 inputs (its allclose has no CPU fp8 kernel): every
    argument the schema does not mark mutable is bitwise unchanged."""
    overload = getattr(torch.ops.attn, op).default
    mutable = {a.name for a in overload._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    names = [a.name for a in overload._schema.arguments]
    named = {**dict(zip(names, args)), **kwargs}
    frozen = {n: t.view(torch.uint8).clone() if t.dtype.itemsize == 1 else t.clone()
              for n, t in named.items() if isinstance(t, torch.Tensor) and n not in mutable}
    overload(*args, **kwargs)
    for n, before in frozen.items():
        after = named[n].view(torch.uint8) if named[n].dtype.itemsize == 1 else named[n]
        assert torch.equal(before, after), f"attn::{op} mutated {n}, which its schema declares read-only"


@pytest.mark.parametrize("op,variant", CASES, ids=[f"{o}-{v}" for o, v in CASES])
def test_opcheck(op, variant):
    args, kwargs = samples.sample(op, variant)
    has_fp8 = any(isinstance(x, torch.Tensor) and x.dtype in FP8_DTYPES for x in tree_leaves((args, kwargs)))
    utils = tuple(u for u in ALL_UTILS if not (has_fp8 and u == "test_schema"))
    torch.library.opcheck(getattr(torch.ops.attn, op).default, args, kwargs, test_utils=utils)
    if has_fp8:
        _assert_only_declared_mutations(op, *samples.sample(op, variant))


@pytest.mark.parametrize("op", ["paged_decode", "paged_prefill", "context_attention", "merge_states"])
def test_opcheck_out_overload(op):
    args, kwargs = samples.sample(op, samples.VARIANTS[op][0])
    ref_out, ref_lse = getattr(torch.ops.attn, op)(*args, **kwargs)
    out, lse = testing.poison_(torch.empty_like(ref_out)), testing.poison_(torch.empty_like(ref_lse))
    torch.library.opcheck(getattr(torch.ops.attn, op).out, args, {**kwargs, "out": out, "lse": lse})
    getattr(torch.ops.attn, op).out(*args, **kwargs, out=out, lse=lse)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
