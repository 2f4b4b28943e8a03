"""Cascade attention: a KV prefix shared by a group of sequences is read once for the whole group.

Parallel sampling, beam search and a common system prompt give many sequences the same first
blocks. Plain paged attention reads those blocks once per sequence; here each group's queries
attend to the shared prefix in one `paged_prefill` (the group's queries are the rows of one
non-causal "sequence", so the prefix is read once and feeds tensor-core tiles), each sequence
attends to its own blocks as usual, and `merge_states` combines the two partial states.

    out, lse = shared_prefix_attention(query, k_cache, v_cache,
                                       shared_block_tables, shared_lens, cu_group_tokens,
                                       block_tables, seq_lens)

equals `paged_prefill`/`paged_decode` over each sequence's full block table
(`shared_block_tables[g]` followed by `block_tables[b]`), up to rounding. Every step is an
`attn::` op, so the composition works eagerly, under `torch.compile` and in CUDA graphs.
"""

from __future__ import annotations

import torch

from .checks import INDEX_DTYPES, check_tensor, check_vector, debug_checks_enabled, expect

# options that need each key's absolute position, which the shared pass does not know per row
_POSITIONAL = ("alibi_slopes", "window_left", "sink_tokens")


def shared_prefix_attention(query, k_cache, v_cache, shared_block_tables, shared_lens, cu_group_tokens,
                            block_tables, seq_lens, cu_seqlens_q=None, *, scale=None, q_scaling=1.0,
                            softcap=0.0, sinks=None, k_scale=None, v_scale=None, **positional):
    """Attention of each sequence over `[its group's shared prefix, its own blocks]`.

    query               [T, Hq, D], the tokens of sequence 0, then 1, ... (groups are
                        contiguous runs of sequences)
    k_cache, v_cache    the paged cache and its format's `k_scale`/`v_scale` (docs/ops.md)
    shared_block_tables [G, P] blocks of each group's shared prefix
    shared_lens         [G] prefix tokens of each group (whole blocks; 0: no shared prefix)
    cu_group_tokens     [G + 1] query-token offsets of the groups (a group's tokens are those
                        of all its sequences)
    block_tables        [B, M] each sequence's own blocks, after its group's prefix
    seq_lens            [B] own tokens of each sequence (its keys past the prefix)
    cu_seqlens_q        [B + 1] query-token offsets of the sequences; None for decode steps,
                        where every sequence has T / B tokens (the own part runs `paged_decode`)
    Returns `(out [T, Hq, D], lse [T, Hq])` as the paged ops do. Learned `sinks` are added
    once (in the own part); ALiBi, sliding windows and sink tokens are not served here.
    """
    used = [name for name in _POSITIONAL if positional.get(name) not in (None, -1, 0)]
    unknown = set(positional) - set(_POSITIONAL)
    if unknown:
        raise TypeError(f"shared_prefix_attention got unexpected arguments {sorted(unknown)}")
    expect(not used, f"{', '.join(used)} need absolute key positions, which the shared-prefix pass does not "
           "track; run paged_prefill/paged_decode over the full block tables instead")
    dev = query.device
    check_tensor(shared_block_tables, "shared_block_tables", 2, "[G, P]", dev, INDEX_DTYPES)
    groups = shared_block_tables.shape[0]
    check_vector(shared_lens, "shared_lens", groups, dev, INDEX_DTYPES, "[G]")
    check_vector(cu_group_tokens, "cu_group_tokens", groups + 1, dev, INDEX_DTYPES, "[G + 1]")
    if debug_checks_enabled():
        _check_groups_align(query.shape[0], cu_group_tokens, seq_lens.shape[0], cu_seqlens_q)
    common = dict(scale=scale, q_scaling=q_scaling, softcap=softcap, k_scale=k_scale, v_scale=v_scale)
    shared_out, shared_lse = torch.ops.attn.paged_prefill(
        query, k_cache, v_cache, shared_block_tables, cu_group_tokens, shared_lens, causal=False, **common)
    if cu_seqlens_q is None:
        own_out, own_lse = torch.ops.attn.paged_decode(
            query, k_cache, v_cache, block_tables, seq_lens, sinks=sinks, **common)
    else:
        own_out, own_lse = torch.ops.attn.paged_prefill(
            query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, causal=True, sinks=sinks, **common)
    return torch.ops.attn.merge_states(shared_out, shared_lse, own_out, own_lse)


def _check_groups_align(num_tokens, cu_group_tokens, num_seqs, cu_seqlens_q) -> None:
    """ATTN_DEBUG: every group boundary is a sequence boundary (this synchronizes)."""
    if cu_seqlens_q is None:
        per_seq = num_tokens // max(1, num_seqs)
        seq_bounds = set(range(0, num_tokens + 1, max(1, per_seq)))
    else:
        seq_bounds = set(cu_seqlens_q.tolist())
    groups = cu_group_tokens.tolist()
    expect(groups[0] == 0 and groups[-1] == num_tokens and set(groups) <= seq_bounds,
           f"cu_group_tokens must run from 0 to {num_tokens} along sequence boundaries, got {groups}")
