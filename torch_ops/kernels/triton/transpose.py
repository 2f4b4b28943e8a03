"""Triton byte transpose of a token-major tensor into head-dim-major: `dst[h, d, t] = src[t, h, d]`.

The CUTLASS FP8 kernels read V with tokens contiguous (FP8 wgmma reduces over the contiguous
dim), so `torch_ops.kernels.cuda.fmha_sm90` transposes V once per call (except for the persistent D = 128
kernels, which transpose V tiles in shared memory). PyTorch's copy of the permuted view
reads one byte per thread with a large stride; this kernel moves 64 x 128 byte tiles (64 tokens
of 128 dims: whole 128-byte lines on both sides), read along d and written along t. H200, one
process: 16k tokens x 32 heads x 128 in 35.7 us against 33.1 us for a copy of the same bytes
(64 x 64 tiles: 42.9 us; 128 x 128 and 8 warps are no faster). Works on the raw bytes (any 1-byte dtype).

`interleave16=True` also reorders the tokens of every aligned group of 16 (`INTERLEAVE16`):
position `4c + i` of a group holds its token `2c + (i & 1) + 8 (i >> 1)`, and a last group
that runs past `T` is padded with zero bytes. The FP8 PV product then takes the softmax
probabilities straight from the QK^T accumulator, where each thread holds the columns `2c, 2c
+ 1, 2c + 8, 2c + 9` of every 16: reordering V's reduction dim the same way replaces an
exchange between threads (csrc/fmha_sm90_mainloop.cuh, `probabilities_operand`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launcher import TritonLaunch

BLOCK_T = 64
BLOCK_D = 128
# token at each position of an interleaved group of 16
INTERLEAVE16 = tuple(2 * (p // 4) + (p & 1) + 8 * ((p >> 1) & 1) for p in range(16))


@triton.jit
def _transpose_kernel(Src, Dst, tokens, positions, stride_st, stride_sh, stride_sd, stride_dh, stride_dd,
                      HEAD_DIM: tl.constexpr, INTERLEAVE: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    p = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)   # positions along dst's T
    if INTERLEAVE:
        t = p - p % 16 + 2 * ((p % 16) // 4) + p % 2 + 8 * ((p // 2) % 2)
    else:
        t = p
    h = tl.program_id(1).to(tl.int64)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    x = tl.load(Src + h * stride_sh + t.to(tl.int64)[:, None] * stride_st + d[None, :] * stride_sd,
                mask=(t < tokens)[:, None] & d_ok[None, :], other=0)
    tl.store(Dst + h * stride_dh + d.to(tl.int64)[:, None] * stride_dd + p[None, :], tl.trans(x),
             mask=d_ok[:, None] & (p < positions)[None, :])


def tokens_last(src: torch.Tensor, dst: torch.Tensor, *, interleave16: bool = False) -> torch.Tensor:
    """Copy `src [T, H, D]` into `dst [H, D, T]` (1-byte dtypes; `dst` unit stride along T), or
    with `interleave16` into `dst [H, D, ceil(T / 16) * 16]` with the tokens of every 16
    interleaved and the padding zeroed (see the module docstring)."""
    t, h, d = src.shape
    if src.element_size() != 1 or dst.dtype != src.dtype:
        raise TypeError(f"tokens_last moves bytes: src and dst must share a 1-byte dtype, got {src.dtype} and {dst.dtype}")
    positions = -(-t // 16) * 16 if interleave16 else t
    if tuple(dst.shape) != (h, d, positions) or (positions > 1 and dst.stride(2) != 1):
        raise ValueError(f"dst must be [H, D, {'ceil(T / 16) * 16' if interleave16 else 'T'}] = {[h, d, positions]} "
                         f"with unit stride along T, got {list(dst.shape)} with strides {dst.stride()}")
    if dst.numel() == 0:
        return dst
    s, o = src.view(torch.uint8), dst.view(torch.uint8)
    grid = (triton.cdiv(positions, BLOCK_T), h, triton.cdiv(d, BLOCK_D))
    TritonLaunch(_transpose_kernel, grid, (t, positions, s.stride(0), s.stride(1), s.stride(2), o.stride(0), o.stride(1)),
                 dict(HEAD_DIM=d, INTERLEAVE=interleave16, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, num_warps=4))(s, o)
    return dst
