"""KV-cache number formats: FP8 with per-tensor/per-head scales, group-wise symmetric INT8/INT4;
dynamic FP8 quantization of attention inputs, optionally after a Hadamard rotation of q and k.

Pure PyTorch, device-agnostic. `docs/ops.md` ("KV cache") is the contract these functions
implement; kernels must agree with them bit for bit on the quantized side.
"""

from __future__ import annotations

import enum
import functools

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GROUP_SCALE_EPS = 1e-5
_QMAX = {8: 127, 4: 7}


class KVFormat(enum.Enum):
    """How a cache tensor stores its values; decided by its dtype (see `kv_format`)."""

    PLAIN = "plain"
    FP8 = "fp8"
    INT8 = "int8"
    INT4 = "int4"

    @property
    def bits(self) -> int:
        return {KVFormat.INT8: 8, KVFormat.INT4: 4}.get(self, 0)

    @property
    def group_scaled(self) -> bool:
        return self in (KVFormat.INT8, KVFormat.INT4)

    @property
    def qmax(self) -> int:
        """The largest code of a group-scaled format (0 for the others)."""
        return _QMAX.get(self.bits, 0)

    @property
    def code(self) -> int:
        """The format's number in the Triton kernels (their `FMT` meta-parameter)."""
        return _KERNEL_CODES[self]


_KERNEL_CODES = {KVFormat.PLAIN: 0, KVFormat.FP8: 1, KVFormat.INT8: 2, KVFormat.INT4: 3}
# `AttnDecodeKV` of csrc/decode_sm90.h: the format, FP8 told apart by its element type
_ABI_CODES = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2, torch.int8: 3, torch.uint8: 4}


def kv_format(cache_dtype: torch.dtype) -> KVFormat:
    """The storage format of a paged cache tensor of this dtype (uint8 means packed INT4)."""
    if cache_dtype in FLOAT_DTYPES:
        return KVFormat.PLAIN
    if cache_dtype in FP8_DTYPES:
        return KVFormat.FP8
    if cache_dtype == torch.int8:
        return KVFormat.INT8
    if cache_dtype == torch.uint8:
        return KVFormat.INT4
    raise TypeError(
        f"KV cache dtype {cache_dtype} is not supported; expected one of fp16/bf16/fp32, "
        "float8_e4m3fn/float8_e5m2, int8 (INT8) or uint8 (packed INT4)"
    )


def abi_code(cache_dtype: torch.dtype) -> int:
    """`AttnDecodeKV` (csrc/decode_sm90.h) of a cache of this dtype: 0 plain, 1 FP8 e4m3, 2 FP8 e5m2,
    3 INT8, 4 packed INT4."""
    return _ABI_CODES.get(cache_dtype, 0)


def fp8_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x [..., H, D]` -> FP8 of `dtype`, `x / scale` saturated. `scale` is 0-d or `[H]`."""
    s = scale.float().reshape(-1, 1) if scale.dim() == 1 else scale.float()
    m = fp8_max(dtype)
    return (x.float() / s).clamp(-m, m).to(dtype)


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP8 `x [..., H, D]` -> `x * scale` in `dtype`, `scale` 0-d or `[H]`."""
    s = scale.to(dtype).reshape(-1, 1) if scale.dim() == 1 else scale.to(dtype)
    return x.to(dtype) * s


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Signed values in [-8, 7], last dim even -> uint8 with last dim halved (offset-8 nibbles,
    element 2i in the low nibble, 2i+1 in the high one)."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: uint8 `[..., D/2]` -> int8 `[..., D]` in [-8, 7]."""
    p = packed.view(torch.uint8).to(torch.int16)
    lo, hi = (p & 0xF) - 8, (p >> 4) - 8
    return torch.stack((lo, hi), dim=-1).flatten(-2).to(torch.int8)


def quantize_groupwise(
    x: torch.Tensor, bits: int, group: int, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric group-wise quantization of `x [..., D]` (`D % group == 0`).

    Returns `(q, scale)`: `q` int8 `[..., D]` for 8 bits or packed uint8 `[..., D/2]` for 4 bits,
    `scale [..., D // group]` in `scale_dtype`. The scale is rounded to `scale_dtype` before its
    reciprocal is taken, so that dequantizing with the stored scale is what the kernels see.
    Codes are `round(x * (1 / scale))` (docs/ops.md, "KV cache").
    """
    if bits not in _QMAX:
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    d = x.shape[-1]
    if group <= 0 or d % group:
        raise ValueError(f"quant group {group} must divide the head dim {d}")
    qmax = _QMAX[bits]
    g = x.float().reshape(*x.shape[:-1], d // group, group)
    absmax = g.abs().amax(-1)
    # Divide by a tensor: CUDA turns division by a Python scalar into a multiplication by its
    # reciprocal, which is not correctly rounded (and then differs from the kernels by an ulp).
    scale = (absmax / torch.full_like(absmax, qmax)).clamp_min(GROUP_SCALE_EPS).to(scale_dtype)
    # x times the fp32 reciprocal of the scale, the product exact (fp64), rounded to even: what
    # the kernels' one FMA per value computes
    rcp = torch.ones_like(absmax) / scale.float()
    q = torch.round(g.double() * rcp.double().unsqueeze(-1)).clamp(-qmax, qmax).reshape(x.shape)
    q = q.to(torch.int8)
    return (pack_int4(q) if bits == 4 else q), scale


def dequantize_groupwise(
    q: torch.Tensor, scale: torch.Tensor, bits: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of `quantize_groupwise`, to `[..., D]` in `dtype`."""
    values = unpack_int4(q) if bits == 4 else q
    d = values.shape[-1]
    groups = scale.shape[-1]
    g = values.to(dtype).reshape(*values.shape[:-1], groups, d // groups)
    return (g * scale.to(dtype).unsqueeze(-1)).reshape(*values.shape[:-1], d)


def dequantize(
    x: torch.Tensor, scale: torch.Tensor | None, fmt: KVFormat, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Any cache slice `[..., H, D or D/2]` with its scales -> `[..., H, D]` in `dtype`."""
    if fmt is KVFormat.PLAIN:
        return x.to(dtype)
    if scale is None:
        raise ValueError(f"a {fmt.value} KV cache needs its scale tensor")
    if fmt is KVFormat.FP8:
        return dequantize_fp8(x, scale, dtype)
    return dequantize_groupwise(x, scale, fmt.bits, dtype)


def quantize(
    x: torch.Tensor, scale: torch.Tensor | None, cache_dtype: torch.dtype, group: int = 0,
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`x [..., H, D]` -> `(stored, new_group_scales)` for a cache of `cache_dtype`.

    FP8 uses the given `scale` (0-d or `[H]`) and returns no new scales; INT8/INT4 compute one
    scale per `group` elements; plain formats cast.
    """
    fmt = kv_format(cache_dtype)
    if fmt is KVFormat.PLAIN:
        return x.to(cache_dtype), None
    if fmt is KVFormat.FP8:
        if scale is None:
            raise ValueError("an FP8 KV cache needs k_scale/v_scale")
        return quantize_fp8(x, scale, cache_dtype), None
    return quantize_groupwise(x, fmt.bits, group, scale_dtype)


def quantize_fp8_amax(
    x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, per_head: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 quantization of `x [T, H, D]` scaled so that its amax maps to the FP8 max.

    Returns `(x8 [T, H, D], scale)`, `scale` fp32 0-d (or `[H]` with `per_head`): the descale
    that `context_attention`'s `q_scale`/`k_scale`/`v_scale` take (`x ~= x8 * scale`).
    An all-zero tensor (or head) gets the smallest normal fp32 scale rather than 0.
    """
    if dtype not in FP8_DTYPES:
        raise TypeError(f"dtype must be one of {FP8_DTYPES}, got {dtype}")
    if x.dim() != 3:
        raise ValueError(f"x must be [T, H, D], got shape {tuple(x.shape)}")
    amax = x.abs().amax(dim=(0, 2)) if per_head else x.abs().amax()
    scale = (amax.float() / fp8_max(dtype)).clamp_min(torch.finfo(torch.float32).tiny)
    return quantize_fp8(x, scale, dtype), scale


def _check_power_of_two(d: int, name: str) -> None:
    if d < 1 or d & (d - 1):
        raise ValueError(f"{name} must be a power of two (Sylvester Hadamard), got {d}")


@functools.lru_cache(maxsize=32)
def _hadamard(d: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / d ** 0.5).to(device, dtype)


def hadamard_matrix(d: int, device: torch.device | str | None = None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix `[d, d]` (`d` a power of two), cached per
    (d, device, dtype): entries `±1/sqrt(d)`, symmetric and orthogonal, so `H @ H = I`."""
    _check_power_of_two(d, "d")
    return _hadamard(d, torch.device(device if device is not None else "cpu"), dtype)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """`x [..., D] @ H [D, D]`, in x's dtype (D a power of two; one matmul, fine for D <= 256).

    Incoherent processing: rotating q and k alike leaves `q @ k^T` unchanged (exact in real
    arithmetic, as `H @ H^T = I`) while spreading outlier channels over all D, which shrinks
    amax and the FP8 error of the scores. H is its own inverse: `hadamard_rotate` undoes itself.
    """
    if x.dtype not in (*FLOAT_DTYPES, torch.float64):
        raise TypeError(f"x must be fp16/bf16/fp32/fp64 (rotate before quantizing), got {x.dtype}")
    _check_power_of_two(x.shape[-1], "x's last (head) dim")
    return x @ hadamard_matrix(x.shape[-1], x.device, x.dtype)


def quantize_qk_incoherent(
    q: torch.Tensor, k: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, per_head: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotate `q [Tq, Hq, D]` and `k [Tk, Hkv, D]` by the same Hadamard matrix, then quantize
    each as `quantize_fp8_amax` does. Returns `(q8, k8, q_scale, k_scale)` for
    `context_attention`; the value (and so the output) is not rotated."""
    for name, x in (("q", q), ("k", k)):
        if x.dim() != 3:
            raise ValueError(f"{name} must be [T, H, D], got shape {tuple(x.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share the head dim, got {q.shape[-1]} and {k.shape[-1]}")
    q8, q_scale = quantize_fp8_amax(hadamard_rotate(q), dtype, per_head)
    k8, k_scale = quantize_fp8_amax(hadamard_rotate(k), dtype, per_head)
    return q8, k8, q_scale, k_scale
