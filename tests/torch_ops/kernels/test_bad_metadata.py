"""Lengths the shape checks cannot see (they live on the device) never make a Triton kernel read
or write outside its tensors: `seq_lens` past the block table's capacity and `cu_seqlens` past
the tokens are clamped into them, as the reference clamps them (docs/ops.md, "Errors")."""

import pytest
import torch

import torch_ops
from torch_ops import reference
from torch_ops.testing import assert_error_ratio

from .. import samples


def _cache(device, hkv=2, d=16, bs=4, blocks=8):
    k, v, _ = samples.paged_cache(blocks, bs, hkv, d, "bf16", device=device)
    return k, v


def _check(op, args, kwargs):
    with torch_ops.use_backend("triton"):
        out, lse = getattr(torch.ops.attn, op)(*args, **kwargs)
    truth_o, truth_l = getattr(reference, op)(*args, **kwargs, compute_dtype=torch.float64)
    base_o, base_l = getattr(reference, op)(*args, **kwargs, compute_dtype=args[0].dtype)
    assert_error_ratio(out, truth_o, base_o)
    assert_error_ratio(lse, truth_l, base_l, name="lse")


def test_decode_lengths_past_the_table_or_negative(kernel_device):
    k, v = _cache(kernel_device)
    tables = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32, device=kernel_device)   # 8 keys each
    lens = torch.tensor([8 + 50, -3, 5], dtype=torch.int32, device=kernel_device)
    q = torch.randn(3, 4, 16, dtype=torch.bfloat16, device=kernel_device)
    _check("paged_decode", (q, k, v, tables, lens), {})


def test_prefill_lengths_past_the_table_and_queries_past_the_tokens(kernel_device):
    k, v = _cache(kernel_device)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=kernel_device)
    q = torch.randn(7, 4, 16, dtype=torch.bfloat16, device=kernel_device)
    cu = torch.tensor([0, 3, 40], dtype=torch.int32, device=kernel_device)   # the last sequence ends past T = 7
    lens = torch.tensor([30, 6], dtype=torch.int32, device=kernel_device)    # the first one past its 8 keys
    _check("paged_prefill", (q, k, v, tables, cu, lens), {"causal": True})


@pytest.mark.parametrize("causal", [True, False])
def test_context_boundaries_past_the_tokens(kernel_device, causal):
    q = torch.randn(9, 4, 16, dtype=torch.bfloat16, device=kernel_device)
    k, v = (torch.randn(11, 2, 16, dtype=torch.bfloat16, device=kernel_device) for _ in range(2))
    cu_q = torch.tensor([0, 4, 30], dtype=torch.int32, device=kernel_device)
    cu_k = torch.tensor([0, 6, 90], dtype=torch.int32, device=kernel_device)
    _check("context_attention", (q, k, v, cu_q, cu_k), {"causal": causal})
