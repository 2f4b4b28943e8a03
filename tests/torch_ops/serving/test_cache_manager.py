"""`torch_ops.serving.cache_manager.KVCacheManager`: block accounting over all layers, prefix
caching, copy-on-write forks on the device caches, sliding-window recycling and StreamingLLM
sinks, checked through the ops against dense attention over the full sequence."""

import random

import pytest
import torch

import torch_ops  # noqa: F401  (registers torch.ops.attn)
from torch_ops import reference
from torch_ops.kv_cache import OutOfBlocksError
from torch_ops.serving.cache_manager import KVCacheManager
from torch_ops.testing import assert_error_ratio

HKV, D = 2, 16


def manager(num_blocks=16, block_size=4, dtype=torch.float32, **kw):
    return KVCacheManager(2, num_blocks, block_size, HKV, D, dtype, device="cpu", **kw)


def write(mgr, slots, k, v):
    """Write the same `k`, `v` [T, HKV, D] into every layer at `slots`."""
    s = torch.tensor(slots, dtype=torch.int32)
    for cache in mgr.caches:
        torch.ops.attn.kv_cache_write(k, v, cache.k, cache.v, s, **cache.scale_kwargs())


def read(mgr, seq, layer=0):
    """`(k, v)` of a sequence's cached tokens, `[seq_len, HKV, D]`."""
    cache = mgr.caches[layer]
    s = torch.tensor(mgr.tables.slots(seq, 0, mgr.seq_len(seq)))
    rows = (s // mgr.block_size, s % mgr.block_size)
    return cache.k[rows], cache.v[rows]


def test_allocate_append_free_over_all_layers():
    mgr = manager()
    assert len(mgr.caches) == 2 and mgr.caches[0].k.shape == (16, 4, HKV, D)
    assert mgr.add("a") == 0
    slots = mgr.append("a", 6) + mgr.append("a", 3)
    assert len(set(slots)) == 9 and mgr.seq_len("a") == 9 and len(mgr.block_table("a")) == 3
    mgr.add("b")
    mgr.append("b", 1)
    assert mgr.num_free_blocks == 12
    k, v = torch.randn(9, HKV, D), torch.randn(9, HKV, D)
    write(mgr, slots, k, v)
    for layer in (0, 1):
        got_k, got_v = read(mgr, "a", layer)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)
    mgr.free("a")
    mgr.free("b")
    assert mgr.num_free_blocks == 16
    with pytest.raises(TypeError, match="a token count with prefix_caching=False"):
        mgr.append("c", [1, 2])


def test_prefix_caching_shares_full_blocks_and_evicts_lru():
    mgr = manager(num_blocks=6, block_size=4, prefix_caching=True)
    prompt = list(range(100, 110))
    assert mgr.add("a", prompt) == 0
    mgr.append("a", prompt)
    table_a = mgr.block_table("a")
    # Same first 9 tokens: the two full blocks are reused; at least one token is left to compute.
    assert mgr.add("b", prompt[:9] + [7]) == 8
    assert mgr.block_table("b") == table_a[:2]
    assert mgr.add("c", prompt[:8]) == 4  # 7 tokens may be cached: one block
    assert mgr.add("d", prompt[:4] + [0] * 6) == 4 and mgr.block_table("d") == table_a[:1]
    assert mgr.add("e", [0] + prompt[1:]) == 0
    for seq in "abcde":
        mgr.free(seq)
    assert mgr.allocator.num_free == 4 and mgr.num_free_blocks == 6  # 2 blocks stay cached
    mgr.add("f")
    mgr.append("f", [1] * 6 * 4)  # needs every block: evicts the cached ones
    assert mgr.allocator.num_free == 0
    assert mgr.add("g", prompt) == 0
    with pytest.raises(OutOfBlocksError):
        mgr.append("g", prompt)


def test_fork_copies_shared_block_on_write_in_every_layer():
    mgr = manager(block_size=4)
    mgr.add("p")
    k, v = torch.randn(6, HKV, D), torch.randn(6, HKV, D)
    write(mgr, mgr.append("p", 6), k, v)
    mgr.fork("p", "c")
    k_child, v_child = torch.randn(3, HKV, D), torch.randn(3, HKV, D)
    child_slots = mgr.append("c", 3)
    mgr.apply_pending()  # the half-filled shared block is copied before the write
    write(mgr, child_slots, k_child, v_child)
    k_parent, v_parent = torch.randn(1, HKV, D), torch.randn(1, HKV, D)
    write(mgr, mgr.append("p", 1), k_parent, v_parent)
    for layer in (0, 1):
        got_k, got_v = read(mgr, "c", layer)
        assert torch.equal(got_k, torch.cat([k, k_child])) and torch.equal(got_v, torch.cat([v, v_child]))
        got_k, got_v = read(mgr, "p", layer)
        assert torch.equal(got_k, torch.cat([k, k_parent])) and torch.equal(got_v, torch.cat([v, v_parent]))
    assert mgr.block_table("c")[0] == mgr.block_table("p")[0]  # the full block stays shared


def _rope(x, positions, cos_sin):
    return reference.apply_rope(x, torch.as_tensor(positions), cos_sin, True, x.dtype)


@pytest.mark.parametrize("sink_tokens", [0, 3])
def test_sliding_window_decode_matches_dense_attention(sink_tokens):
    """Decode one token at a time (prefill chunks in between) with a window cache and RoPE.
    Each step's paged_decode over the recycled cache must equal dense attention over the
    sequence as StreamingLLM defines it: the cached tokens at their positions within the cache,
    keys rotated at those positions (with no sinks that is plain sliding-window attention at
    absolute positions), window and sinks applied, plus ALiBi so that distances are checked."""
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    bs, window_left, hq = 4, rng.randint(5, 11), 4
    cos_sin = reference.rope_cos_sin_cache(256, D)
    mgr = manager(num_blocks=12, block_size=bs, window_left=window_left, sink_tokens=sink_tokens,
                  cos_sin_cache=cos_sin)
    slopes = reference.alibi_slopes(hq)
    raw_k, raw_v = [], []  # unrotated keys of every token so far (the naive StreamingLLM cache)
    mgr.add(0)
    steps = [rng.choice([1, 1, 1, 3]) for _ in range(40)]
    for n in steps:
        total = len(raw_k) + n
        k, v = torch.randn(n, HKV, D, dtype=torch.float64), torch.randn(n, HKV, D, dtype=torch.float64)
        raw_k += list(k)
        raw_v += list(v)
        slots = mgr.append(0, n)
        mgr.apply_pending()
        offset = mgr.position_offset(0)
        positions = torch.arange(total - n, total)  # absolute
        write(mgr, slots, _rope(k, positions, cos_sin).float(), v.float())
        q = torch.randn(n, hq, D, dtype=torch.float64)
        cache = mgr.caches[0]
        seq_len = mgr.seq_len(0)
        table = torch.tensor([mgr.block_table(0)], dtype=torch.int32)
        out, _ = torch.ops.attn.paged_prefill(
            _rope(q, positions, cos_sin).float(), cache.k, cache.v, table,
            torch.tensor([0, n], dtype=torch.int32), torch.tensor([seq_len], dtype=torch.int32),
            window_left=window_left, sink_tokens=sink_tokens, alibi_slopes=slopes)

        # The naive cache: sink blocks, then everything after the dropped tokens.
        sink_end = -(-sink_tokens // bs) * bs
        kept = list(range(min(sink_end, total))) + list(range(sink_end + offset, total))
        assert len(kept) == seq_len and total - offset == seq_len
        cache_pos = torch.arange(seq_len)
        keys = _rope(torch.stack([raw_k[i] for i in kept]), cache_pos, cos_sin)
        values = torch.stack([raw_v[i] for i in kept])
        q_cache = _rope(q, cache_pos[-n:], cos_sin)
        if not sink_tokens:  # no sinks: the same as attention at absolute positions
            assert kept == list(range(offset, total))
        results = [reference.attend(q_cache.to(dt), keys.to(dt), values.to(dt), cache_pos[-n:], causal=True,
                                    window_left=window_left, sink_tokens=sink_tokens,
                                    alibi_slopes=slopes, compute_dtype=dt)[0]
                   for dt in (torch.float64, torch.float32)]
        assert_error_ratio(out, *results, ratio=4.0)
        # Recycling: at most the sink blocks plus the blocks the window spans.
        assert len(mgr.block_table(0)) <= sink_end // bs + (window_left + n) // bs + 2
    assert mgr.position_offset(0) > 0


def test_bad_configuration():
    with pytest.raises(ValueError, match="sink_tokens needs a sliding window"):
        manager(sink_tokens=4)
    with pytest.raises(ValueError, match="prefix_caching and a sliding window"):
        manager(prefix_caching=True, window_left=8)
    with pytest.raises(ValueError, match="window_left must be an int >= -1"):
        manager(window_left=-2)


def _canonical(mgr, seqs) -> tuple:
    """The manager's state up to a renaming of block ids: tables (shared blocks stay shared),
    lengths, position offsets, free blocks, and the queued copies (in any order: `apply_pending`
    makes them at once) and sink rotations."""
    names: dict[int, int] = {}
    rename = lambda b: names.setdefault(b, len(names))  # noqa: E731
    slot = lambda s: rename(s // mgr.block_size) * mgr.block_size + s % mgr.block_size  # noqa: E731
    tables = [([rename(b) for b in mgr.block_table(s)], mgr.seq_len(s), mgr.position_offset(s))
              for s in seqs]
    copies = sorted((rename(a), rename(b)) for a, b in mgr.tables.take_copies())  # applied at once
    shifts = [([slot(s) for s in slots], shift) for slots, shift in mgr._sink_shifts]
    mgr._sink_shifts = []
    return tables, copies, shifts, mgr.num_free_blocks


@pytest.mark.parametrize("policy", [dict(window_left=6, sink_tokens=3), dict(prefix_caching=True)])
def test_append_batch_equals_one_by_one(policy):
    """Requests arriving (their prompt appended in their first step), forking, decoding and
    finishing, on two managers: one appends each step's tokens with `append_batch`, the other
    with `append` per request. Sliding-window recycling, sink retention and prefix sharing stay
    the same (up to block ids, which may be handed out in another order when windows release
    blocks)."""
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    cos_sin = reference.rope_cos_sin_cache(64, D) if "window_left" in policy else None
    batched, one_by_one = (manager(num_blocks=200, cos_sin_cache=cos_sin, **policy) for _ in range(2))
    prefix = [rng.randrange(50) for _ in range(9)]
    live, pending, cached = [], {}, 0
    for step in range(60):
        if rng.random() < 0.3 or not live:
            seq = f"r{step}"
            prompt = prefix[:rng.randint(0, 9)] + [rng.randrange(50) for _ in range(rng.randint(1, 6))]
            hit = batched.add(seq, prompt)
            assert one_by_one.add(seq, prompt) == hit
            pending[seq], cached = prompt[hit:], cached + hit
            live.append(seq)
        running = [s for s in live if s not in pending]
        if rng.random() < 0.15 and "window_left" in policy and running:
            parent, child = rng.choice(running), f"f{step}"
            for mgr in (batched, one_by_one):
                mgr.fork(parent, child)
            live.append(child)
        if rng.random() < 0.15 and len(live) > 1:
            seq = live.pop(rng.randrange(len(live)))
            pending.pop(seq, None)
            for mgr in (batched, one_by_one):
                mgr.free(seq)
        running = [s for s in live if s not in pending]
        # All running requests half the time: often the last step's list (rows from memory).
        seqs = list(pending) + (running if rng.random() < 0.5 else
                                rng.sample(running, rng.randint(0, len(running))))
        new = [pending.pop(s) if s in pending else [rng.randrange(50)] for s in seqs]
        if not batched.prefix_caching:
            new = [len(t) for t in new]
        batched.append_batch(seqs, new)
        for seq, t in zip(seqs, new):
            one_by_one.append(seq, t)
        assert _canonical(batched, live) == _canonical(one_by_one, live)
    assert cached if batched.prefix_caching else any(batched.position_offset(s) for s in live)
