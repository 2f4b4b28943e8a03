"""Triton helpers that make casts exact under Triton's CPU interpreter (TRITON_INTERPRET=1).

The interpreter truncates fp32 -> bf16 and rounds fp32 -> FP8 without carrying into the
exponent; the kernels pre-round in fp32 with bit arithmetic (ties to even) when interpreted, so
the CPU tests see what the GPU's round-to-nearest-even converts produce.
"""

import triton
import triton.language as tl


@triton.jit
def round_to_bf16(x):
    """fp32 `x` rounded to the nearest bf16 value (ties to even), still fp32."""
    b = x.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return b.to(tl.float32, bitcast=True)


@triton.jit
def round_to_fp8(x, MANT: tl.constexpr, EMIN: tl.constexpr):
    """fp32 `x` (within the format's range) rounded to the nearest FP8 value with MANT mantissa
    bits and minimum normal exponent EMIN (ties to even, subnormals included), still fp32."""
    b = x.to(tl.int32, bitcast=True)
    ulp = ((tl.maximum(((b >> 23) & 0xFF) - 127, EMIN) - MANT + 127) << 23).to(tl.float32, bitcast=True)
    r = ((tl.abs(x) / ulp + 12582912.0) - 12582912.0) * ulp
    return tl.where(b < 0, r * -1.0, r)    # keeps the sign of a zero (`-r` is `0 - r`)


@triton.jit
def exact_cast(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """`x` -> `dtype`, round to nearest even (exact pre-rounding of fp32 under the interpreter)."""
    if INTERPRETED and x.dtype == tl.float32:
        if dtype == tl.bfloat16:
            x = round_to_bf16(x)
        elif dtype == tl.float8e4nv:
            x = round_to_fp8(x, 3, -6)
        elif dtype == tl.float8e5:
            x = round_to_fp8(x, 2, -14)
    return x.to(dtype)
