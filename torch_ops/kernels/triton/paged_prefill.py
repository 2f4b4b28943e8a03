"""Triton `attn::paged_prefill`: varlen queries over a paged KV cache (chunked prefill, prefix
caching, mixed prefill + decode batches in one launch). The kernel: `prefill_attention.py`."""

from __future__ import annotations

from ... import checks, errors
from . import prefill_attention


def unsupported(query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, **options) -> list[str]:
    return prefill_attention.unsupported(query, k_cache.dtype, checks.paged_value_dim(query, k_cache, v_cache))


def run(*args, **kwargs) -> None:
    prepare(*args, **kwargs)(*args, **kwargs)


def prepare(query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, *, out, lse, causal=True, scale=None,
            q_scaling=1.0, alibi_slopes=None, window_left=-1, sink_tokens=0, sinks=None, softcap=0.0,
            out_scale=None, k_scale=None, v_scale=None, max_queries=None, key_mask=None, num_blocks=None,
            block_error=errors.BLOCK_TABLES):
    """`launch(*args, **kwargs)` for calls of this signature. `max_queries`: serve only the
    sequences of at most that many queries (the `mixed` backend). `num_blocks`, `block_error`: as
    in `prefill_attention.prepare`."""
    forward = prefill_attention.prepare(
        query, k_cache, v_cache, out, lse, cu_seqlens_q=cu_seqlens_q, block_tables=block_tables,
        seq_lens=seq_lens, causal=causal, scale=scale, q_scaling=q_scaling, alibi_slopes=alibi_slopes,
        window_left=window_left, sink_tokens=sink_tokens, sinks=sinks, softcap=softcap,
        out_scale=out_scale, k_scale=k_scale, v_scale=v_scale, max_queries=max_queries, key_mask=key_mask,
        num_blocks=num_blocks, block_error=block_error)

    def launch(query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, *, out, lse, alibi_slopes=None,
               sinks=None, out_scale=None, k_scale=None, v_scale=None, key_mask=None, **_):
        forward(query, k_cache, v_cache, out, lse, cu_seqlens_q=cu_seqlens_q, block_tables=block_tables,
                seq_lens=seq_lens, alibi_slopes=alibi_slopes, sinks=sinks, out_scale=out_scale, k_scale=k_scale,
                v_scale=v_scale, key_mask=key_mask)

    launch.describe = getattr(forward, "describe", "")
    launch.kernels = getattr(forward, "kernels", ())
    return launch
