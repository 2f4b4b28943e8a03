"""The Triton byte transpose that feeds FP8 V to the CUTLASS kernels: `dst[h, d, t] = src[t, h, d]`,
plain or with the tokens of every 16 interleaved (`INTERLEAVE16`) and the last group zero-padded."""

from __future__ import annotations

import pytest
import torch

from torch_ops.kernels.triton.transpose import INTERLEAVE16, tokens_last
from torch_ops.testing import poison_


def expected(src: torch.Tensor, interleave16: bool) -> torch.Tensor:
    if not interleave16:
        return src.permute(1, 2, 0).contiguous()
    t, h, d = src.shape
    padded = -(-t // 16) * 16
    tokens = torch.zeros(padded, h, d, dtype=torch.uint8, device=src.device)
    tokens[:t] = src.view(torch.uint8)
    order = torch.tensor(INTERLEAVE16, device=src.device).repeat(padded // 16) + torch.arange(padded, device=src.device) // 16 * 16
    return tokens[order].permute(1, 2, 0).contiguous()


@pytest.mark.parametrize("t,h,d", [(1, 1, 64), (129, 3, 128), (70, 2, 80), (0, 2, 64)])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("interleave16", [False, True])
def test_tokens_last(kernel_device, t, h, d, strided, interleave16):
    dtype = torch.float8_e4m3fn
    if strided:   # every stride of src differs from a contiguous [T, H, D]
        src = torch.randn(h, t, 2 * d, device=kernel_device).to(dtype)[:, :, ::2].transpose(0, 1)
    else:
        src = torch.randn(t, h, d, device=kernel_device).to(dtype)
    padded = -(-t // 16) * 16   # what torch_ops.kernels.cuda.fmha_sm90 allocates: tokens padded to 16
    dst = torch.empty(h, d, max(padded, 1), device=kernel_device, dtype=dtype)[..., :padded if interleave16 else t]
    poison_(dst)
    tokens_last(src, dst, interleave16=interleave16)
    assert torch.equal(dst.view(torch.uint8), expected(src, interleave16).view(torch.uint8))


def test_interleave16_order():
    """Position 4c + i of a group holds the token that the thread of column pair c holds at its
    i-th place in the QK^T accumulator: columns 2c, 2c + 1, 2c + 8, 2c + 9."""
    assert INTERLEAVE16 == tuple(2 * c + (8 if i >= 2 else 0) + i % 2 for c in range(4) for i in range(4))


def test_tokens_last_rejects_bad_arguments(kernel_device):
    src = torch.zeros(4, 2, 8, device=kernel_device, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="1-byte dtype"):
        tokens_last(src.to(torch.bfloat16), torch.empty(2, 8, 4, device=kernel_device, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"dst must be \[H, D, T\]"):
        tokens_last(src, torch.empty(2, 4, 8, device=kernel_device, dtype=src.dtype))
    with pytest.raises(ValueError, match=r"dst must be \[H, D, ceil\(T / 16\) \* 16\]"):
        tokens_last(src, torch.empty(2, 8, 4, device=kernel_device, dtype=src.dtype), interleave16=True)
    with pytest.raises(ValueError, match="unit stride"):
        tokens_last(src, torch.empty(2, 4, 8, device=kernel_device, dtype=src.dtype).transpose(1, 2))
