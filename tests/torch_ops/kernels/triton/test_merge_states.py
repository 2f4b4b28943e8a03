"""The Triton `attn::merge_states` kernel against the reference, empty states and strides included."""

from __future__ import annotations

import pytest
import torch

import torch_ops
from torch_ops import reference
from torch_ops.testing import assert_error_ratio, poison_


def random_state(t, h, d, dtype, device, strided):
    if strided:   # [T, H, D] view of a [H, T, 2D] buffer: every stride differs from contiguous
        out = torch.randn(h, t, 2 * d, dtype=dtype, device=device)[:, :, ::2].transpose(0, 1)
    else:
        out = torch.randn(t, h, d, dtype=dtype, device=device)
    lse = torch.randn(t, h, device=device) * 4
    return out, lse


@pytest.mark.parametrize("dtype,d,strided", [(torch.bfloat16, 64, False), (torch.float16, 80, True),
                                             (torch.float32, 24, False)])
def test_merge_states(kernel_device, dtype, d, strided):
    t, h = 7, 5
    out_a, lse_a = random_state(t, h, d, dtype, kernel_device, strided)
    out_b, lse_b = random_state(t, h, d, dtype, kernel_device, False)
    lse_a[0] = float("-inf")                  # one side empty
    lse_a[1, :2] = lse_b[1, :2] = float("-inf")   # both empty: zeros and -inf
    out, lse = torch.empty_like(out_b), torch.empty_like(lse_b)
    poison_(out)
    poison_(lse)
    with torch_ops.use_backend("triton"):
        torch.ops.attn.merge_states.out(out_a, lse_a, out_b, lse_b, out=out, lse=lse)
    f64 = [x.double() for x in (out_a, lse_a, out_b, lse_b)]
    truth_o, truth_l = reference.merge_states(*f64)
    base_o, base_l = reference.merge_states(out_a, lse_a, out_b, lse_b)
    assert_error_ratio(out, truth_o, base_o)
    assert_error_ratio(lse, truth_l, base_l.double(), name="lse")
    assert (out[1, :2] == 0).all() and (lse[1, :2] == float("-inf")).all()
    torch.testing.assert_close(out[0], out_b[0], rtol=0, atol=0)


def test_triton_serves_merge_states(kernel_device):
    x = torch.randn(2, 3, 16, device=kernel_device)
    lse = torch.randn(2, 3, device=kernel_device)
    assert torch_ops.backend_for("merge_states", x, lse, x, lse) == ("triton" if kernel_device.type == "cuda" else "vanilla")
