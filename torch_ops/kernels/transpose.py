"""Triton byte transpose of a token-major tensor into head-dim-major: `dst[h, d, t] = src[t, h, d]`.

The CUTLASS FP8 kernels read V with tokens contiguous (FP8 wgmma reduces over the contiguous
dim), so `torch_ops.cutlass` transposes V once per call. PyTorch's copy of the permuted view
reads one byte per thread with a large stride; this kernel moves 64 x 64 byte tiles, read along
d and written along t, at close to copy bandwidth. Works on the raw bytes (any 1-byte dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 64
BLOCK_D = 64


@triton.jit
def _transpose_kernel(Src, Dst, tokens, stride_st, stride_sh, stride_sd, stride_dh, stride_dd,
                      HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1).to(tl.int64)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_ok, d_ok = t < tokens, d < HEAD_DIM
    x = tl.load(Src + h * stride_sh + t.to(tl.int64)[:, None] * stride_st + d[None, :] * stride_sd,
                mask=t_ok[:, None] & d_ok[None, :])
    tl.store(Dst + h * stride_dh + d.to(tl.int64)[:, None] * stride_dd + t[None, :], tl.trans(x),
             mask=d_ok[:, None] & t_ok[None, :])


def tokens_last(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Copy `src [T, H, D]` into `dst [H, D, T]` (1-byte dtypes; `dst` unit stride along T)."""
    t, h, d = src.shape
    if src.element_size() != 1 or dst.dtype != src.dtype:
        raise TypeError(f"tokens_last moves bytes: src and dst must share a 1-byte dtype, got {src.dtype} and {dst.dtype}")
    if tuple(dst.shape) != (h, d, t) or (t > 1 and dst.stride(2) != 1):
        raise ValueError(f"dst must be [H, D, T] = {[h, d, t]} with unit stride along T, got "
                         f"{list(dst.shape)} with strides {dst.stride()}")
    if src.numel() == 0:
        return dst
    s, o = src.view(torch.uint8), dst.view(torch.uint8)
    grid = (triton.cdiv(t, BLOCK_T), h, triton.cdiv(d, BLOCK_D))
    _transpose_kernel[grid](s, o, t, s.stride(0), s.stride(1), s.stride(2), o.stride(0), o.stride(1),
                            HEAD_DIM=d, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, num_warps=4)
    return dst
