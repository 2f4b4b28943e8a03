"""Triton `attn::merge_states`: combine two partial attention states over disjoint key sets.

One program per (query token, BLOCK_H heads): read both states' lse, weight each partial output
by `exp(lse_x - lse)` in fp32 and write the merged output and `lse = logaddexp(lse_a, lse_b)`.
Two empty states (`-inf`) give zeros and `-inf`. Any strides; the head dim is padded to a power
of two in registers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import interpreting
from .launcher import TritonLaunch, no_launch
from .interpreter import exact_cast


@triton.jit
def _merge_states_kernel(
    OutA, LseA, OutB, LseB, Out, Lse,
    stride_at, stride_ah, stride_ad, stride_bt, stride_bh, stride_bd, stride_ot, stride_oh, stride_od,
    stride_lat, stride_lah, stride_lbt, stride_lbh, stride_lt, stride_lh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < NUM_HEADS
    mask = h_ok[:, None] & (d < HEAD_DIM)[None, :]
    lse_a = tl.load(LseA + t * stride_lat + h * stride_lah, mask=h_ok, other=float("-inf"))
    lse_b = tl.load(LseB + t * stride_lbt + h * stride_lbh, mask=h_ok, other=float("-inf"))
    mx = tl.maximum(lse_a, lse_b)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    wa = tl.exp(lse_a - mx)
    wb = tl.exp(lse_b - mx)
    den = wa + wb
    empty = den == 0.0
    inv = 1.0 / tl.where(empty, 1.0, den)
    a = tl.load(OutA + t * stride_at + h[:, None] * stride_ah + d[None, :] * stride_ad, mask=mask, other=0.0)
    b = tl.load(OutB + t * stride_bt + h[:, None] * stride_bh + d[None, :] * stride_bd, mask=mask, other=0.0)
    o = (a.to(tl.float32) * (wa * inv)[:, None] + b.to(tl.float32) * (wb * inv)[:, None])
    o = exact_cast(o, Out.dtype.element_ty, INTERPRETED)
    tl.store(Out + t * stride_ot + h[:, None] * stride_oh + d[None, :] * stride_od, o, mask=mask)
    lse = tl.where(empty, float("-inf"), mx + tl.log(tl.where(empty, 1.0, den)))
    tl.store(Lse + t * stride_lt + h * stride_lh, lse, mask=h_ok)


def unsupported(out_a, lse_a, out_b, lse_b, **buffers) -> list[str]:
    """Reasons this kernel cannot run the call: none (any strides, any validated dtype)."""
    return []


def run(*args, **kwargs) -> None:
    """Fill `out [T, H, D]` and `lse [T, H]` from the two states."""
    prepare(*args, **kwargs)(*args, **kwargs)


def prepare(out_a, lse_a, out_b, lse_b, *, out, lse):
    """`launch(*args, **kwargs)` for calls of this signature (only the metadata is read)."""
    t, h, d = out_a.shape
    if t == 0 or h == 0:
        return no_launch
    block_d = max(16, triton.next_power_of_2(d))
    block_h = max(1, min(triton.next_power_of_2(h), 2048 // block_d))
    interpreted = interpreting()
    if interpreted:
        block_h = min(block_h, 4)
    kernel = TritonLaunch(_merge_states_kernel, (t, triton.cdiv(h, block_h)), (
        *out_a.stride(), *out_b.stride(), *out.stride(),
        lse_a.stride(0), lse_a.stride(1), lse_b.stride(0), lse_b.stride(1), lse.stride(0), lse.stride(1),
    ), dict(NUM_HEADS=h, HEAD_DIM=d, BLOCK_H=block_h, BLOCK_D=block_d, INTERPRETED=interpreted, num_warps=4))

    def launch(out_a, lse_a, out_b, lse_b, *, out, lse):
        kernel(out_a, lse_a, out_b, lse_b, out, lse)

    return launch
