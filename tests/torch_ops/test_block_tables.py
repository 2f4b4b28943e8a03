"""Block management of `torch_ops.kv_cache`: `BlockAllocator` and `BlockTables`."""

import random

import numpy as np
import pytest
import torch

from torch_ops.kv_cache import BlockAllocator, BlockTables, OutOfBlocksError


def test_block_allocator_allocate_free_refcount():
    alloc = BlockAllocator(8)
    a = alloc.allocate(3)
    b = alloc.allocate(5)
    assert sorted(a + b) == list(range(8)) and alloc.num_free == 0
    assert all(alloc.refcount(x) == 1 for x in a + b)
    with pytest.raises(OutOfBlocksError, match="cannot allocate 1 blocks: 0 of 8 are free"):
        alloc.allocate(1)
    alloc.free(a)
    assert alloc.num_free == 3 and alloc.refcount(a[0]) == 0
    assert sorted(alloc.allocate(3)) == sorted(a)


def test_block_allocator_out_of_blocks_allocates_nothing():
    alloc = BlockAllocator(4)
    alloc.allocate(3)
    with pytest.raises(OutOfBlocksError):
        alloc.allocate(2)
    assert alloc.num_free == 1
    assert isinstance(OutOfBlocksError("x"), RuntimeError)


def test_block_allocator_share_and_double_free():
    alloc = BlockAllocator(4)
    blocks = alloc.allocate(2)
    alloc.share(blocks)
    assert alloc.refcount(blocks[0]) == 2
    alloc.free(blocks)
    assert alloc.num_free == 2 and alloc.refcount(blocks[1]) == 1
    alloc.free(blocks)
    assert alloc.num_free == 4
    with pytest.raises(ValueError, match="double free"):
        alloc.free(blocks)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.share(blocks)


def test_block_allocator_free_is_all_or_nothing():
    alloc = BlockAllocator(4)
    x, y = alloc.allocate(2)
    with pytest.raises(ValueError, match=f"block {x} freed 2 time"):
        alloc.free([y, x, x])
    assert alloc.refcount(x) == alloc.refcount(y) == 1 and alloc.num_free == 2
    with pytest.raises(ValueError, match=r"block must be an int in 0\.\.3, got 4"):
        alloc.refcount(4)


def _expected_slots(table, block_size, start, n):
    return [table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]


def test_block_tables_add_append_slots():
    alloc = BlockAllocator(32)
    alloc.allocate(5)  # so that sequences get non-trivial block ids
    tables = BlockTables(alloc, block_size=4)
    slots = tables.add("a", 6)
    table = tables.block_table("a")
    assert len(table) == 2 and tables.seq_len("a") == 6
    assert slots == _expected_slots(table, 4, 0, 6)
    free_before = alloc.num_free
    assert tables.append("a") == _expected_slots(table, 4, 6, 1)  # token 6: same block
    assert tables.append("a") == _expected_slots(table, 4, 7, 1)  # token 7: same block
    assert alloc.num_free == free_before
    new = tables.append("a", 5)  # tokens 8..12: two new blocks
    assert alloc.num_free == free_before - 2
    table = tables.block_table("a")
    assert len(table) == 4 and new == _expected_slots(table, 4, 8, 5)
    assert tables.slots("a", 3, 4) == _expected_slots(table, 4, 3, 4)
    assert len(set(tables.slots("a", 0, 13))) == 13


def test_block_tables_fork_then_copy_on_write():
    alloc = BlockAllocator(8)
    tables = BlockTables(alloc, block_size=2)
    tables.add(0, 3)  # one full block, one half-filled
    full, partial = tables.block_table(0)
    tables.fork(0, 1)
    assert tables.block_table(1) == [full, partial] and tables.seq_len(1) == 3
    assert alloc.refcount(full) == alloc.refcount(partial) == 2
    assert tables.take_copies() == []
    # The child writes into the shared half-filled block: it gets its own copy.
    slots = tables.append(1, 2)
    own, extra = tables.block_table(1)[1:]
    assert tables.block_table(1)[0] == full and own not in (full, partial)
    assert tables.take_copies() == [(partial, own)] and tables.take_copies() == []
    assert slots == [own * 2 + 1, extra * 2]
    assert (alloc.refcount(full), alloc.refcount(partial)) == (2, 1)
    # The parent now owns its half-filled block alone: appending copies nothing.
    assert tables.append(0) == [partial * 2 + 1] and tables.take_copies() == []
    tables.free(0)
    assert (alloc.refcount(full), alloc.refcount(partial)) == (1, 0)
    tables.free(1)
    assert alloc.num_free == 8


def test_block_tables_append_at_a_block_boundary_copies_nothing():
    alloc = BlockAllocator(8)
    tables = BlockTables(alloc, block_size=2)
    tables.add(0, 4)
    tables.fork(0, 1)
    tables.append(1, 1)
    assert tables.take_copies() == [] and tables.block_table(1)[:2] == tables.block_table(0)


def test_block_tables_copy_on_write_is_all_or_nothing():
    alloc = BlockAllocator(3)
    tables = BlockTables(alloc, block_size=4)
    tables.add(0, 6)
    tables.fork(0, 1)
    with pytest.raises(OutOfBlocksError):
        tables.append(1, 7)  # needs a copy and two more blocks, one is free
    assert tables.block_table(1) == tables.block_table(0) and tables.seq_len(1) == 6
    assert tables.take_copies() == [] and alloc.num_free == 1


def test_block_tables_make_writable_and_shared_prefix():
    alloc = BlockAllocator(8)
    tables = BlockTables(alloc, block_size=2)
    tables.add(0, 4)
    prefix = tables.block_table(0)
    tables.add(1, 5, shared_blocks=prefix)  # blocks 0-1 shared, one fresh
    assert tables.block_table(1)[:2] == prefix and alloc.refcount(prefix[0]) == 2
    tables.make_writable(1, [0])
    copy = tables.block_table(1)[0]
    assert tables.take_copies() == [(prefix[0], copy)] and alloc.refcount(prefix[0]) == 1
    tables.make_writable(1, [0, 2])  # already its own: nothing to do
    assert tables.take_copies() == []
    with pytest.raises(ValueError, match="3 shared blocks hold more than the sequence's 5 tokens"):
        tables.add(2, 5, shared_blocks=prefix + [copy])


def test_block_tables_drop_blocks():
    alloc = BlockAllocator(8)
    tables = BlockTables(alloc, block_size=2)
    tables.add(0, 7)
    table = tables.block_table(0)
    tables.drop_blocks(0, 1, 2)
    assert tables.block_table(0) == [table[0], table[3]] and tables.seq_len(0) == 3
    assert alloc.refcount(table[1]) == alloc.refcount(table[2]) == 0
    assert tables.slots(0, 2, 1) == [table[3] * 2]
    with pytest.raises(ValueError, match="not all full"):
        tables.drop_blocks(0, 1, 1)


def test_block_allocator_reclaim_hook():
    held = []
    alloc = BlockAllocator(4, reclaim=lambda n: alloc.free([held.pop() for _ in range(min(n, len(held)))]))
    held += alloc.allocate(3)
    assert sorted(alloc.allocate(2) + held) == [0, 1, 2, 3]  # one block reclaimed
    with pytest.raises(OutOfBlocksError):
        alloc.allocate(3)


def test_block_tables_out_of_blocks_leaves_sequence_unchanged():
    alloc = BlockAllocator(3)
    tables = BlockTables(alloc, block_size=4)
    tables.add(0, 8)
    with pytest.raises(OutOfBlocksError):
        tables.append(0, 9)
    assert tables.seq_len(0) == 8 and len(tables.block_table(0)) == 2 and alloc.num_free == 1
    with pytest.raises(OutOfBlocksError):
        tables.add(1, 5)
    with pytest.raises(KeyError, match="unknown sequence 1"):
        tables.seq_len(1)


def test_block_tables_errors():
    tables = BlockTables(BlockAllocator(8), block_size=4)
    tables.add(0, 5)
    with pytest.raises(ValueError, match="already exists"):
        tables.add(0, 1)
    with pytest.raises(ValueError, match="already exists"):
        tables.fork(0, 0)
    with pytest.raises(KeyError, match="unknown sequence 7"):
        tables.append(7)
    with pytest.raises(ValueError, match=r"tokens 3\.\.5 are outside sequence 0 of length 5"):
        tables.slots(0, 3, 3)
    with pytest.raises(ValueError, match="num_tokens must be an int >= 0"):
        tables.append(0, -1)
    tables.free(0)
    with pytest.raises(KeyError):
        tables.free(0)


def test_block_tables_host_arrays_follow_every_change():
    """The numpy rows the metadata path gathers equal `block_table`/`seq_len`, zero-padded,
    through growth past the initial capacity, forks, drops and row reuse after `free`."""
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    tables = BlockTables(BlockAllocator(400), block_size=2)
    live = []
    for step in range(60):
        op = rng.random()
        if op < 0.35 or not live:
            seq = f"s{step}"
            tables.add(seq, rng.randint(0, 9))
            live.append(seq)
        elif op < 0.5:
            child = f"f{step}"
            tables.fork(rng.choice(live), child)
            live.append(child)
        elif op < 0.6:
            seq = live.pop(rng.randrange(len(live)))
            tables.free(seq)
        elif op < 0.7:
            seq = rng.choice(live)
            if tables.seq_len(seq) >= 4:
                tables.drop_blocks(seq, 0, 1)
        else:
            tables.append(rng.choice(live), rng.randint(0, 20))
    rows = tables.rows(live)
    assert len(set(rows.tolist())) == len(live)
    for seq, row in zip(live, rows):
        table = tables.block_table(seq)
        assert tables.array[row].tolist() == table + [0] * (tables.array.shape[1] - len(table))
        assert (tables.num_blocks[row], tables.lens[row]) == (len(table), tables.seq_len(seq))
        assert tables.offsets[row] == tables.position_offset(seq)
    with pytest.raises(KeyError, match="unknown sequence 'nope'"):
        tables.rows(["nope"])


def test_block_tables_rows_remembers_its_last_list_until_a_sequence_is_freed():
    tables = BlockTables(BlockAllocator(64), block_size=2)
    for seq in range(4):
        tables.add(seq, 3)
    ids = [3, 0, 2]
    rows = tables.rows(ids)
    assert tables.rows([3, 0, 2]) is rows and not rows.flags.writeable
    assert tables.issued(rows) and not tables.issued(rows.copy())
    ids[0] = 1  # the caller's list changes: a new lookup
    assert tables.rows(ids).tolist() == [tables.rows((1,))[0], rows[1], rows[2]]
    assert tables.append_batch(ids, [1, 1, 1]) is tables.append_batch(ids, [1, 1, 1])
    assert tables.seq_len(1) == 5
    issued = tables.rows(ids)
    tables.free(0)
    assert not tables.issued(issued)
    with pytest.raises(KeyError, match="unknown sequence 0"):
        tables.rows([1, 0, 2])
    tables.rows([1, 2])
    tables.add(0, 1)  # takes the freed row again
    tables.add(9, 1)
    assert tables.rows([1, 9]).tolist() == [tables.rows((1,))[0], tables.rows((9,))[0]]
    assert tables.rows([0])[0] == rows[1]
    tables.rows([2, 2])
    with pytest.raises(ValueError, match="seq_ids must be distinct"):
        tables.append_batch([2, 2], [1, 1])


def test_block_tables_drop_blocks_counts_the_offset():
    tables = BlockTables(BlockAllocator(8), block_size=2)
    tables.add(0, 7)
    tables.drop_blocks(0, 1, 2)
    tables.fork(0, 1)
    assert tables.position_offset(0) == tables.position_offset(1) == 4


def _tables_state(tables: BlockTables, seqs) -> tuple:
    alloc = tables.allocator
    return ([(tables.block_table(s), tables.seq_len(s), tables.position_offset(s)) for s in seqs],
            alloc.refcounts.tolist(), alloc._free[:alloc.num_free].tolist())


def test_block_tables_append_batch_equals_one_by_one():
    """Random arrivals, forks (several children of one parent: shared half-filled blocks with
    refcounts above 2), frees and drops applied to two tables; one grows by `append_batch`,
    the other by `append` per sequence. Blocks, refcounts, free order and copies stay equal."""
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    bs = rng.choice([2, 3, 4])  # block_size 1 has no half-filled blocks to copy
    batched, one_by_one = (BlockTables(BlockAllocator(4000), block_size=bs) for _ in range(2))
    live, copies = [], 0
    for step in range(150):
        op = rng.random()
        if op < 0.15 or not live:
            seq, n = f"s{step}", rng.randint(0, 9)
            for t in (batched, one_by_one):
                t.add(seq, n)
            live.append(seq)
        elif op < 0.3:
            parent = rng.choice(live)
            for i in range(rng.randint(1, 3)):
                for t in (batched, one_by_one):
                    t.fork(parent, f"f{step}.{i}")
                live.append(f"f{step}.{i}")
        elif op < 0.38:
            seq = live.pop(rng.randrange(len(live)))
            for t in (batched, one_by_one):
                t.free(seq)
        elif op < 0.45:
            seq = rng.choice(live)
            if batched.seq_len(seq) >= 2 * bs:
                for t in (batched, one_by_one):
                    t.drop_blocks(seq, 0, 1)
        else:
            seqs = rng.sample(live, rng.randint(0, len(live)))
            counts = [rng.choice([0, 1, 1, 1, rng.randint(0, 3 * bs)]) for _ in seqs]
            rows = batched.append_batch(seqs, counts)
            assert rows.tolist() == batched.rows(seqs).tolist()
            for seq, n in zip(seqs, counts):
                one_by_one.append(seq, n)
        expected = one_by_one.take_copies()
        assert batched.take_copies() == expected
        copies += len(expected)
        assert _tables_state(batched, live) == _tables_state(one_by_one, live)
        # append_batch looks for copies only while this count is not 0
        refcounts = batched.allocator.refcounts
        assert batched.allocator.num_shared_refs == np.maximum(refcounts - 1, 0).sum()
    assert copies  # copy-on-write happened


def test_block_tables_append_batch_is_all_or_nothing():
    alloc = BlockAllocator(6)
    tables = BlockTables(alloc, block_size=2)
    tables.add(0, 3)
    tables.fork(0, 1)
    tables.add(2, 2)
    before = _tables_state(tables, [0, 1, 2])
    with pytest.raises(OutOfBlocksError):  # 1 copy + 1 block for seq 1, then 2 for seq 2: 4 > 3
        tables.append_batch([1, 2], [2, 3])
    assert _tables_state(tables, [0, 1, 2]) == before and tables.take_copies() == []
    tables.append_batch([1, 2], [2, 1])  # 1 copy + 1 block, then 1 block: fits
    assert tables.seq_len(1) == 5 and tables.seq_len(2) == 3 and alloc.num_free == 0
    with pytest.raises(ValueError, match="seq_ids must be distinct"):
        tables.append_batch([0, 0], [0, 0])
    with pytest.raises(ValueError, match=r"num_tokens must hold 2 ints >= 0 \(one per sequence\)"):
        tables.append_batch([0, 2], [1, -1])
