"""Dequantization of the Triton `paged_decode` kernel's FP8/INT8/INT4 tiles: rows read as words of
4 values, turned into 4 fp16 lanes (lane j = dim 4c + j of word c) and multiplied by their group
scales (the "quantized tiles" part of `torch_ops.kernels.triton.paged_decode`'s module docstring)."""

from __future__ import annotations

import triton
import triton.language as tl

from .formats import FMT_FP8, FMT_INT4, FMT_INT8


# FP8 x 4 per word: bytes of the two words regrouped by lane (t0 = a0 b0 a1 b1, t1 = a2 b2 a3 b3),
# then one packed convert per lane
_E4M3_ASM = """
{
.reg .b32 t0, t1;
.reg .b16 l0, h0, l1, h1;
prmt.b32 t0, $4, $5, 0x5140;
prmt.b32 t1, $4, $5, 0x7362;
mov.b32 {l0, h0}, t0;
mov.b32 {l1, h1}, t1;
cvt.rn.f16x2.CVT_TYPE $0, l0;
cvt.rn.f16x2.CVT_TYPE $1, h0;
cvt.rn.f16x2.CVT_TYPE $2, l1;
cvt.rn.f16x2.CVT_TYPE $3, h1;
}
"""
_FP8_E4M3_ASM = tl.constexpr(_E4M3_ASM.replace("CVT_TYPE", "e4m3x2"))
_FP8_E5M2_ASM = tl.constexpr(_E4M3_ASM.replace("CVT_TYPE", "e5m2x2"))
# int8 x 4 per word: bytes of the two words regrouped by lane, each byte b made the fp16 bit
# pattern 0x64 : (b ^ 0x80), i.e. 1152 + b, and 1152 subtracted (exact)
_INT8_ASM = tl.constexpr("""
{
.reg .b32 t0, t1, v0, v1, m, c;
xor.b32 t0, $4, 0x80808080;
xor.b32 t1, $5, 0x80808080;
prmt.b32 v0, t0, t1, 0x5140;
prmt.b32 v1, t0, t1, 0x7362;
mov.b32 m, 0x64646464;
prmt.b32 $0, v0, m, 0x4140;
prmt.b32 $1, v0, m, 0x4342;
prmt.b32 $2, v1, m, 0x4140;
prmt.b32 $3, v1, m, 0x4342;
mov.b32 c, 0x64806480;
sub.f16x2 $0, $0, c;
sub.f16x2 $1, $1, c;
sub.f16x2 $2, $2, c;
sub.f16x2 $3, $3, c;
}
""")
# int4 x 4 per 16-bit word (two words in $4): nibble j of each word into the mantissa of 1024
# (lanes 0, 2) or of 1024 + 16 n (lanes 1, 3), then - 1032 or * 1/16 - 72 (exact)
_INT4_ASM = tl.constexpr("""
{
.reg .b32 h, c, s, o;
shr.b32 h, $4, 8;
lop3.b32 $0, $4, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 $1, $4, 0x00F000F0, 0x64006400, 0xEA;
lop3.b32 $2, h, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 $3, h, 0x00F000F0, 0x64006400, 0xEA;
mov.b32 c, 0x64086408;
sub.f16x2 $0, $0, c;
sub.f16x2 $2, $2, c;
mov.b32 s, 0x2C002C00;
mov.b32 o, 0xD480D480;
fma.rn.f16x2 $1, $1, s, o;
fma.rn.f16x2 $3, $3, s, o;
}
""")


@triton.jit
def _unpack_words(w, FMT: tl.constexpr, E5M2: tl.constexpr, ASM: tl.constexpr):
    """Words of 4 values (int32: FP8/INT8 bytes; int16: INT4 nibbles) -> 4 fp16 tensors of w's
    shape, lane j holding value j of every word; exact (group scales are applied by the caller)."""
    if ASM:
        if FMT == FMT_FP8:
            if E5M2:
                code: tl.constexpr = _FP8_E5M2_ASM
            else:
                code: tl.constexpr = _FP8_E4M3_ASM
            return tl.inline_asm_elementwise(code, "=r,=r,=r,=r,r,r", [w], dtype=(tl.float16,) * 4,
                                             is_pure=True, pack=2)
        elif FMT == FMT_INT8:
            return tl.inline_asm_elementwise(_INT8_ASM, "=r,=r,=r,=r,r,r", [w], dtype=(tl.float16,) * 4,
                                             is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(_INT4_ASM, "=r,=r,=r,=r,r", [w], dtype=(tl.float16,) * 4,
                                             is_pure=True, pack=2)
    else:
        if FMT == FMT_INT4:
            u = w.to(tl.int32) & 0xFFFF
            x0 = ((u & 15) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1032.0
            x1 = (((u >> 4) & 15) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1032.0
            x2 = (((u >> 8) & 15) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1032.0
            x3 = (((u >> 12) & 15) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1032.0
            return x0, x1, x2, x3
        elif FMT == FMT_INT8:
            x0 = (((w & 0xFF) ^ 0x80) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1152.0
            x1 = ((((w >> 8) & 0xFF) ^ 0x80) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1152.0
            x2 = ((((w >> 16) & 0xFF) ^ 0x80) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1152.0
            x3 = ((((w >> 24) & 0xFF) ^ 0x80) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1152.0
            return x0, x1, x2, x3
        else:
            if E5M2:
                f8: tl.constexpr = tl.float8e5
            else:
                f8: tl.constexpr = tl.float8e4nv
            x0 = (w & 0xFF).to(tl.uint8).to(f8, bitcast=True).to(tl.float16)
            x1 = ((w >> 8) & 0xFF).to(tl.uint8).to(f8, bitcast=True).to(tl.float16)
            x2 = ((w >> 16) & 0xFF).to(tl.uint8).to(f8, bitcast=True).to(tl.float16)
            x3 = ((w >> 24) & 0xFF).to(tl.uint8).to(f8, bitcast=True).to(tl.float16)
            return x0, x1, x2, x3


@triton.jit
def _scaled(x, s, SCALE_F16: tl.constexpr):
    """fp16 value `x` (an exact integer) times its group scale, rounded once to fp16 as the
    reference does: a packed fp16 multiply for fp16 scales, else in fp32 (rounding an fp32 or bf16
    scale to fp16 first would round twice)."""
    if SCALE_F16:
        return x * s
    return (x.to(tl.float32) * s.to(tl.float32)).to(tl.float16)


@triton.jit
def _load_lanes(Base, rows, n_ok, SBase, srows,
                FMT: tl.constexpr, E5M2: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                NG: tl.constexpr, NGP: tl.constexpr, GW: tl.constexpr, QGROUP: tl.constexpr,
                SCALE_PER_GRP: tl.constexpr, ASM: tl.constexpr, SCALE_F16: tl.constexpr):
    """One quantized K or V tile of BLOCK_N token rows as 4 dequantized fp16 lanes
    [BLOCK_N, NGP * GW]: lane j, column c holds dim 4c + j. `rows` are the rows' offsets in words
    (4 values each); the words are grouped [BLOCK_N, NGP, GW] by scale group (GW words per group)
    when the group is a multiple of 4 values and GW a power of 2, else [BLOCK_N, 1, GW]."""
    grp = tl.arange(0, NGP)
    e = tl.arange(0, GW)
    col = grp[None, :, None] * GW + e[None, None, :]          # word column
    mask = n_ok[:, None, None] & (col < HEAD_DIM // 4)
    w = tl.load(Base + rows[:, None, None] + col, mask=mask, other=0)
    x0, x1, x2, x3 = _unpack_words(w, FMT, E5M2, ASM)
    if FMT != FMT_FP8:
        if SCALE_PER_GRP:
            # a 2-D load (vectorized along the groups, so the pipeliner can stage it)
            s = tl.load(SBase + srows[:, None] + grp[None, :], mask=n_ok[:, None] & (grp < NG)[None, :], other=0.0)
            s = tl.expand_dims(s, 2)
            x0 = _scaled(x0, s, SCALE_F16)
            x1 = _scaled(x1, s, SCALE_F16)
            x2 = _scaled(x2, s, SCALE_F16)
            x3 = _scaled(x3, s, SCALE_F16)
        else:
            sp = SBase + srows[:, None, None]
            x0 = _scaled(x0, tl.load(sp + (4 * col + 0) // QGROUP, mask=mask, other=0.0), SCALE_F16)
            x1 = _scaled(x1, tl.load(sp + (4 * col + 1) // QGROUP, mask=mask, other=0.0), SCALE_F16)
            x2 = _scaled(x2, tl.load(sp + (4 * col + 2) // QGROUP, mask=mask, other=0.0), SCALE_F16)
            x3 = _scaled(x3, tl.load(sp + (4 * col + 3) // QGROUP, mask=mask, other=0.0), SCALE_F16)
    shape: tl.constexpr = (BLOCK_N, NGP * GW)
    return tl.reshape(x0, shape), tl.reshape(x1, shape), tl.reshape(x2, shape), tl.reshape(x3, shape)
