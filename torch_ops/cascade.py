"""Cascade attention: a KV prefix shared by a group of sequences is read once for the whole group.

Parallel sampling, beam search and a common system prompt give many sequences the same first
blocks. Plain paged attention reads those blocks once per sequence; here each group's queries
attend to the shared prefix in one `paged_prefill` (the group's queries are the rows of one
non-causal "sequence", so the prefix is read once and feeds tensor-core tiles), each sequence
attends to its own blocks as usual, and `merge_states` combines the two partial states. A few
groups over a long prefix would leave most SMs idle, so the prefix is cut into chunks (each a
pseudo-sequence with the group's queries, merged in fp32), a count chosen from shapes only.

    out, lse = shared_prefix_attention(query, k_cache, v_cache,
                                       shared_block_tables, shared_lens, cu_group_tokens,
                                       block_tables, seq_lens)

equals `paged_prefill`/`paged_decode` over each sequence's full block table
(`shared_block_tables[g]` followed by `block_tables[b]`), up to rounding. Every step is an
`attn::` op, so the composition works eagerly, under `torch.compile` and in CUDA graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import gpu
from .checks import INDEX_DTYPES, check_tensor, check_vector, debug_checks_enabled

# options that need each key's absolute position, which the shared pass does not know per row
_POSITIONAL = ("alibi_slopes", "window_left", "sink_tokens")
MIN_CHUNK_TOKENS = 512   # a prefix chunk still streams enough keys to hide its setup and merge
ROWS_PER_PROGRAM = 128   # query rows (tokens x heads of a KV head) of one prefill program


def shared_prefix_attention(query, k_cache, v_cache, shared_block_tables, shared_lens, cu_group_tokens,
                            block_tables, seq_lens, cu_seqlens_q=None, *, prefix_chunks=None,
                            scale=None, q_scaling=1.0,
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
    prefix_chunks       pieces each shared prefix is cut into (None: from the shapes and SMs)
    Returns `(out [T, Hq, D], lse [T, Hq])` as the paged ops do. Learned `sinks` are added
    once (in the own part); ALiBi, sliding windows and sink tokens are not served here.
    """
    used = [name for name in _POSITIONAL if positional.get(name) not in (None, -1, 0)]
    unknown = set(positional) - set(_POSITIONAL)
    if unknown:
        raise TypeError(f"shared_prefix_attention got unexpected arguments {sorted(unknown)}")
    if used:
        raise ValueError(f"{', '.join(used)} need absolute key positions, which the shared-prefix pass does "
                         "not track; run paged_prefill/paged_decode over the full block tables instead")
    dev = query.device
    check_tensor(shared_block_tables, "shared_block_tables", 2, "[G, P]", dev, INDEX_DTYPES)
    groups = shared_block_tables.shape[0]
    check_vector(shared_lens, "shared_lens", groups, dev, INDEX_DTYPES, "[G]")
    check_vector(cu_group_tokens, "cu_group_tokens", groups + 1, dev, INDEX_DTYPES, "[G + 1]")
    if debug_checks_enabled():
        _check_groups_align(query.shape[0], cu_group_tokens, seq_lens.shape[0], cu_seqlens_q)
    common = dict(scale=scale, q_scaling=q_scaling, softcap=softcap, k_scale=k_scale, v_scale=v_scale)
    chunks = prefix_chunks or _prefix_chunks(query, k_cache, shared_block_tables)
    shared_out, shared_lse = _shared_pass(query, k_cache, v_cache, shared_block_tables, shared_lens,
                                          cu_group_tokens, chunks, common)
    if cu_seqlens_q is None:
        own_out, own_lse = torch.ops.attn.paged_decode(
            query, k_cache, v_cache, block_tables, seq_lens, sinks=sinks, **common)
    else:
        own_out, own_lse = torch.ops.attn.paged_prefill(
            query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, causal=True, sinks=sinks, **common)
    return torch.ops.attn.merge_states(shared_out, shared_lse, own_out, own_lse)


def _prefix_chunks(query, k_cache, shared_block_tables) -> int:
    """Chunks per shared prefix so that the shared pass fills about two waves of programs."""
    groups, max_blocks = shared_block_tables.shape
    tokens, hq = query.shape[0], query.shape[1]
    hkv, block_size = k_cache.shape[2], k_cache.shape[1]
    rows = -(-tokens * hq // max(1, groups * hkv))
    programs = max(1, groups * hkv * -(-rows // ROWS_PER_PROGRAM))
    sms = gpu.sm_count(query.device, cpu=8)
    most = max(1, max_blocks * block_size // MIN_CHUNK_TOKENS)
    return max(1, min(most, -(-2 * sms // programs)))


def _shared_pass(query, k_cache, v_cache, tables, lens, cu_group_tokens, chunks, common):
    """`(out, lse)` of every query over its group's prefix, the prefix cut into `chunks` pieces
    of whole blocks: chunk-major pseudo-sequences `(c, g)` over all T query tokens, run in one
    `paged_prefill`, then merged in fp32."""
    causal = dict(causal=False, **common)
    if chunks <= 1:
        return torch.ops.attn.paged_prefill(query, k_cache, v_cache, tables, cu_group_tokens, lens, **causal)
    groups, max_blocks = tables.shape
    per = -(-max_blocks // chunks)
    chunks = -(-max_blocks // per)
    t, block_size = query.shape[0], k_cache.shape[1]
    tables = F.pad(tables, (0, chunks * per - max_blocks)).view(groups, chunks, per).transpose(0, 1)
    first = torch.arange(chunks, device=lens.device, dtype=lens.dtype)[:, None]
    chunk_lens = (lens[None, :] - first * (per * block_size)).clamp(0, per * block_size)
    cu = (cu_group_tokens[None, :-1] + first.to(cu_group_tokens.dtype) * t).reshape(-1)
    cu = torch.cat([cu, cu.new_full((1,), chunks * t)])
    out, lse = torch.ops.attn.paged_prefill(query.repeat(chunks, 1, 1), k_cache, v_cache,
                                            tables.reshape(chunks * groups, per), cu, chunk_lens.reshape(-1),
                                            **causal)
    lse = lse.view(chunks, t, -1)
    total = torch.logsumexp(lse, dim=0)
    weight = torch.exp(lse - torch.where(torch.isinf(total), 0.0, total)).unsqueeze(-1)
    merged = (weight * out.view(chunks, t, *out.shape[1:]).float()).sum(0)
    return merged.to(out.dtype), total


def _check_groups_align(num_tokens, cu_group_tokens, num_seqs, cu_seqlens_q) -> None:
    """ATTN_DEBUG: every group boundary is a sequence boundary (this synchronizes)."""
    if cu_seqlens_q is None:
        per_seq = num_tokens // max(1, num_seqs)
        seq_bounds = set(range(0, num_tokens + 1, max(1, per_seq)))
    else:
        seq_bounds = set(cu_seqlens_q.tolist())
    groups = cu_group_tokens.tolist()
    if not (groups[0] == 0 and groups[-1] == num_tokens and set(groups) <= seq_bounds):
        raise ValueError(f"cu_group_tokens must run from 0 to {num_tokens} along sequence boundaries, got {groups}")
