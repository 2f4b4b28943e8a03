"""Triton `attn::context_attention`: varlen self- or cross-attention on fresh packed q/k/v (no
cache). The attention kernel: `prefill_attention.py`.

RoPE (`positions`, `cos_sin_cache`) runs as a small pre-kernel that writes rotated copies of
query and key, then the attention kernel runs unchanged. Why not inside the attention kernel:
it loads each K tile once per query tile (S / BLOCK_M times: 16x at S = 2k), so rotating K
there repeats the rotation, the partner-element loads and the cos/sin loads that many times in
the tensor-core loop. The pre-kernel moves `2 * (Tq*Hq + Tk*Hkv) * D` elements once (read and
write): for a 2k-token prefill with 32/8 heads of D = 64 in bf16, 10 MB (~3 us at 3.5 TB/s),
the same bytes as the fused elementwise kernel Inductor makes of a model's own RoPE.
Rotating only Q in the attention kernel's prologue would save Q's write and re-read (8 of those
10 MB): a later optimization.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import errors
from . import interpreting, prefill_attention
from .interpreter import exact_cast
from .kv_cache_write import rope_position
from .launcher import TritonLaunch

ROPE_TOKENS = 16   # tokens per RoPE program


def unsupported(query, key, value, cu_seqlens_q, cu_seqlens_k, **options) -> list[str]:
    return prefill_attention.unsupported(query, key.dtype, value.shape[-1])


@triton.jit(do_not_specialize=["num_tokens"])
def _rope_kernel(X, Out, Pos, CosSin, Err, num_tokens, max_position, stride_xt, stride_xh, stride_ot, stride_oh,
                 stride_cs, stride_csd, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROT: tl.constexpr,
                 NEOX: tl.constexpr, TOKENS: tl.constexpr, INTERPRETED: tl.constexpr):
    """Rotate `TOKENS` tokens of head `program_id(1)` of `X [T, H, D]` into `Out`, in fp32:
    `(a, b) -> (a cos - b sin, b cos + a sin)` for the pairs `(d, d + ROT/2)` (NeoX) or
    `(2i, 2i + 1)` (GPT-J); dims past ROT are copied. A position outside the cache is clamped
    into it and flagged in `Err`."""
    HALF: tl.constexpr = ROT // 2
    t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    t_ok = t < num_tokens
    ok = t_ok[:, None] & (d < HEAD_DIM)[None, :]
    rows = X + t.to(tl.int64)[:, None] * stride_xt + h * stride_xh
    x = tl.load(rows + d[None, :], mask=ok, other=0.0).to(tl.float32)
    if NEOX:
        first = d < HALF
        partner = tl.where(first, d + HALF, d - HALF)
        i = tl.where(first, d, d - HALF)
    else:
        first = d % 2 == 0
        partner = d ^ 1
        i = d // 2
    rot = d < ROT
    p = tl.load(rows + partner[None, :], mask=ok & rot[None, :], other=0.0).to(tl.float32)
    pos, pos_ok = rope_position(Pos, t, t_ok, 1, max_position, Err, True)
    cs = CosSin + pos[:, None] * stride_cs + i[None, :] * stride_csd
    cs_ok = pos_ok[:, None] & rot[None, :]
    c = tl.load(cs, mask=cs_ok, other=0.0).to(tl.float32)
    s = tl.load(cs + HALF * stride_csd, mask=cs_ok, other=0.0).to(tl.float32)
    xc = x * c
    ps = p * s
    y = tl.where(rot[None, :], tl.where(first[None, :], xc - ps, xc + ps), x)
    out = Out + t.to(tl.int64)[:, None] * stride_ot + h * stride_oh + d[None, :]
    tl.store(out, exact_cast(y, Out.dtype.element_ty, INTERPRETED), mask=ok)


def rope(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, neox: bool) -> torch.Tensor:
    """`x [T, H, D]` rotated at `positions [T]` by `cos_sin_cache [max_position, rotary_dim]`
    (docs/ops.md, `kv_cache_write`'s RoPE); a new contiguous tensor of `x`'s dtype."""
    return prepare_rope(x, cos_sin_cache, neox)(x, positions, cos_sin_cache)


def prepare_rope(x: torch.Tensor, cos_sin_cache: torch.Tensor, neox: bool):
    """`rope` for tensors of these signatures: `launch(x, positions, cos_sin_cache) -> rotated x`."""
    t, h, d = x.shape
    kernel = TritonLaunch(_rope_kernel, (triton.cdiv(t, ROPE_TOKENS), h), (
        t, cos_sin_cache.shape[0], x.stride(0), x.stride(1), h * d, d,
        cos_sin_cache.stride(0), cos_sin_cache.stride(1),
    ), dict(HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), ROT=cos_sin_cache.shape[1], NEOX=bool(neox),
            TOKENS=ROPE_TOKENS, INTERPRETED=interpreting(), num_warps=4, enable_fp_fusion=False))
    flag = errors.device_flag(x.device)

    def launch(x, positions, cos_sin_cache):
        out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
        if t and h:
            kernel(x, out, positions, cos_sin_cache, flag)
        return out

    return launch


def run(*args, **kwargs) -> None:
    prepare(*args, **kwargs)(*args, **kwargs)


def prepare(query, key, value, cu_seqlens_q, cu_seqlens_k, *, out, lse, causal=False, scale=None, q_scaling=1.0,
            alibi_slopes=None, window_left=-1, sink_tokens=0, sinks=None, softcap=0.0, out_scale=None,
            q_scale=None, k_scale=None, v_scale=None, out_dtype=None, positions=None, cos_sin_cache=None,
            rope_neox=True, key_mask=None):
    """`launch(*args, **kwargs)` for calls of this signature. `out_dtype` only chose the dtype of
    `out`, which the kernel writes in whatever dtype it has."""
    rotate = None
    if positions is not None:
        rotate = prepare_rope(query, cos_sin_cache, rope_neox), prepare_rope(key, cos_sin_cache, rope_neox)
        query, key = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (query, key))
    forward = prefill_attention.prepare(
        query, key, value, out, lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, causal=causal,
        scale=scale, q_scaling=q_scaling, alibi_slopes=alibi_slopes, window_left=window_left,
        sink_tokens=sink_tokens, sinks=sinks, softcap=softcap, out_scale=out_scale, q_scale=q_scale,
        k_scale=k_scale, v_scale=v_scale, key_mask=key_mask)

    def launch(query, key, value, cu_seqlens_q, cu_seqlens_k, *, out, lse, alibi_slopes=None, sinks=None,
               out_scale=None, q_scale=None, k_scale=None, v_scale=None, positions=None, cos_sin_cache=None,
               key_mask=None, **_):
        if rotate is not None:
            query, key = rotate[0](query, positions, cos_sin_cache), rotate[1](key, positions, cos_sin_cache)
        forward(query, key, value, out, lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                alibi_slopes=alibi_slopes, sinks=sinks, out_scale=out_scale, q_scale=q_scale, k_scale=k_scale,
                v_scale=v_scale, key_mask=key_mask)

    launch.describe = ("Triton RoPE of q and k, then " if rotate else "") + getattr(forward, "describe", "")
    launch.kernels = getattr(forward, "kernels", ())
    return launch
