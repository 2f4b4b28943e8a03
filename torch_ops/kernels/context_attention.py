"""Triton `attn::context_attention`: varlen self- or cross-attention on fresh packed q/k/v (no
cache). The kernel: `prefill_attention.py`."""

from __future__ import annotations

from . import prefill_attention


def unsupported(query, key, value, cu_seqlens_q, cu_seqlens_k, **options) -> list[str]:
    return prefill_attention.unsupported(query, key.dtype)


def run(query, key, value, cu_seqlens_q, cu_seqlens_k, *, out, lse, causal=False, scale=None, q_scaling=1.0,
        alibi_slopes=None, window_left=-1, sink_tokens=0, sinks=None, softcap=0.0, out_scale=None,
        q_scale=None, k_scale=None, v_scale=None, out_dtype=None) -> None:
    """`out_dtype` only chose the dtype of `out`, which the kernel writes in whatever dtype it has."""
    prefill_attention.forward(
        query, key, value, out, lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, causal=causal,
        scale=scale, q_scaling=q_scaling, alibi_slopes=alibi_slopes, window_left=window_left,
        sink_tokens=sink_tokens, sinks=sinks, softcap=softcap, out_scale=out_scale, q_scale=q_scale,
        k_scale=k_scale, v_scale=v_scale)
