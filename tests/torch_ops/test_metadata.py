"""`torch_ops.metadata`: values against a plain Python computation, padding, fixed addresses,
validation, and no device-to-host sync on CUDA."""

import random

import numpy as np
import pytest
import torch

from torch_ops.kv_cache import BlockAllocator, BlockTables
from torch_ops.metadata import AttentionMetadata, MetadataBuilder

BLOCK_SIZE = 4
MAX_BLOCKS = 12


def fresh_rng() -> random.Random:
    """A Python RNG seeded from torch's, which tests/conftest.py seeds afresh for every test."""
    return random.Random(int(torch.randint(0, 2**31, ())))


def random_batch(rng: random.Random, num_seqs: int, *, decode_q: int = 0):
    """Ragged sequences: decode (`decode_q` tokens each if given), else a mix of decode, chunked
    prefill and full prefill. Block tables hold distinct ids and sometimes spare blocks."""
    ids = rng.sample(range(1, 1000), num_seqs * MAX_BLOCKS)
    seq_lens, query_lens, tables = [], [], []
    for b in range(num_seqs):
        seq_len = rng.randint(max(1, decode_q), MAX_BLOCKS * BLOCK_SIZE - 4)
        q = decode_q or rng.choice([1, seq_len, rng.randint(0, seq_len)])
        num_blocks = min(MAX_BLOCKS, -(-seq_len // BLOCK_SIZE) + rng.randint(0, 1))
        seq_lens.append(seq_len)
        query_lens.append(q)
        tables.append(ids[b * MAX_BLOCKS:b * MAX_BLOCKS + num_blocks])
    return seq_lens, query_lens, tables


def expected_metadata(seq_lens, query_lens, tables, block_size=BLOCK_SIZE):
    """The straightforward per-token computation (no padding)."""
    cu, slots, positions = [0], [], []
    for seq_len, q, table in zip(seq_lens, query_lens, tables):
        cu.append(cu[-1] + q)
        for i in range(q):
            pos = seq_len - q + i
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    rows = [table + [0] * (MAX_BLOCKS - len(table)) for table in tables]
    return cu, slots, positions, rows


def check(md: AttentionMetadata, seq_lens, query_lens, tables):
    cu, slots, positions, rows = expected_metadata(seq_lens, query_lens, tables)
    for t in (md.seq_lens, md.cu_seqlens_q, md.block_tables, md.slot_mapping, md.positions):
        assert t.dtype == torch.int32
    assert md.seq_lens.tolist() == list(seq_lens)
    assert md.cu_seqlens_q.tolist() == cu
    assert md.block_tables.shape == (len(seq_lens), MAX_BLOCKS)
    assert md.block_tables.tolist() == rows
    assert md.slot_mapping.tolist() == slots
    assert md.positions.tolist() == positions
    assert (md.num_seqs, md.num_tokens) == (len(seq_lens), cu[-1])
    assert md.max_query_len == max(query_lens, default=0)
    assert md.max_seq_len == max(seq_lens, default=0)


def builder(device="cpu", max_num_seqs=16, max_num_tokens=1024):
    return MetadataBuilder(max_num_seqs, max_num_tokens, MAX_BLOCKS, BLOCK_SIZE, device)


def test_random_ragged_batches():
    rng = fresh_rng()
    mb = builder()
    for _ in range(10):  # the same builder, several steps
        batch = random_batch(rng, rng.randint(1, 16))
        md = mb.build(*batch)
        check(md, *batch)
        uniform = len(set(batch[1])) == 1 and batch[1][0] > 0
        assert md.q_per_seq == (batch[1][0] if uniform else 0)


@pytest.mark.parametrize("q", [1, 3])
def test_decode_batch(q):
    rng = fresh_rng()
    batch = random_batch(rng, 9, decode_q=q)
    md = builder().build(*batch)
    check(md, *batch)
    assert md.q_per_seq == q and md.num_tokens == 9 * q


def test_block_tables_as_2d_array():
    rng = fresh_rng()
    seq_lens, query_lens, tables = random_batch(rng, 7)
    table = np.array([t + [0] * (MAX_BLOCKS - len(t)) for t in tables], dtype=np.int32)
    from_lists = builder().build(seq_lens, query_lens, [list(r) for r in table])
    for arg in (table, torch.from_numpy(table)):
        md = builder().build(seq_lens, query_lens, arg)
        for name in ("seq_lens", "cu_seqlens_q", "block_tables", "slot_mapping", "positions"):
            assert torch.equal(getattr(md, name), getattr(from_lists, name))
    check(from_lists, seq_lens, query_lens, [list(r) for r in table])


def test_padding_mixed_batch_adds_empty_sequences():
    rng = fresh_rng()
    seq_lens, query_lens, tables = random_batch(rng, 5)
    query_lens[:2] = [1, 0]  # not uniform
    md = builder().build(seq_lens, query_lens, tables, pad_to=8)
    num_tokens = sum(query_lens)
    assert md.num_seqs == 8 and md.num_tokens == num_tokens and md.q_per_seq == 0
    assert md.seq_lens.tolist() == seq_lens + [0, 0, 0]
    cu, slots, positions, rows = expected_metadata(seq_lens, query_lens, tables)
    assert md.cu_seqlens_q.tolist() == cu + [num_tokens] * 3
    assert md.block_tables.tolist() == rows + [[0] * MAX_BLOCKS] * 3
    assert md.slot_mapping.tolist() == slots and md.positions.tolist() == positions


def test_padding_uniform_decode_keeps_query_rows():
    rng = fresh_rng()
    seq_lens, query_lens, tables = random_batch(rng, 3, decode_q=2)
    token_ids = [rng.randrange(1, 1000) for _ in range(6)]
    md = builder().build(seq_lens, query_lens, tables, pad_to=6, token_ids=token_ids)
    assert md.num_seqs == 6 and md.num_tokens == 12 and md.q_per_seq == 2
    assert md.token_ids.dtype == torch.int32 and md.token_ids.tolist() == token_ids + [0] * 6
    assert md.seq_lens.tolist() == seq_lens + [0, 0, 0]
    assert md.cu_seqlens_q.tolist() == list(range(0, 13, 2))
    cu, slots, positions, rows = expected_metadata(seq_lens, query_lens, tables)
    assert md.block_tables.tolist() == rows + [[0] * MAX_BLOCKS] * 3
    assert md.slot_mapping.tolist() == slots + [-1] * 6
    assert md.positions.tolist() == positions + [0] * 6
    assert md.max_query_len == 2


def test_buffers_keep_their_addresses():
    rng = fresh_rng()
    mb = builder()
    first = mb.build(*random_batch(rng, 4, decode_q=1), pad_to=16)
    ptrs = [t.data_ptr() for t in (first.seq_lens, first.cu_seqlens_q, first.block_tables,
                                   first.slot_mapping, first.positions)]
    for num_seqs in (16, 1, 9):
        batch = random_batch(rng, num_seqs, decode_q=1)
        md = mb.build(*batch, pad_to=16)
        assert [t.data_ptr() for t in (md.seq_lens, md.cu_seqlens_q, md.block_tables,
                                       md.slot_mapping, md.positions)] == ptrs
        assert md.seq_lens.tolist() == batch[0] + [0] * (16 - num_seqs)
        assert md.slot_mapping.tolist()[num_seqs:] == [-1] * (16 - num_seqs)
        check(mb.build(*batch), *batch)  # unpadded builds reuse the same memory too


@pytest.mark.parametrize("num_seqs, decode_q", [(1, 1), (3, 0), (5, 2), (7, 0)])
def test_every_tensor_starts_16_byte_aligned(num_seqs, decode_q):
    rng = fresh_rng()
    batch = random_batch(rng, num_seqs, decode_q=decode_q)
    md = builder().build(*batch, token_ids=[0] * sum(batch[1]))
    for t in (md.seq_lens, md.cu_seqlens_q, md.block_tables, md.slot_mapping, md.positions, md.token_ids):
        assert t.data_ptr() % 16 == 0
    check(md, *batch)


def test_token_ids_travel_with_the_metadata():
    rng = fresh_rng()
    mb = builder()
    for _ in range(3):
        batch = random_batch(rng, rng.randint(1, 16))
        token_ids = np.array([rng.randrange(50000) for _ in range(sum(batch[1]))])
        md = mb.build(*batch, token_ids=token_ids)
        check(md, *batch)
        assert md.token_ids.tolist() == token_ids.tolist()
        assert mb.build(*batch).token_ids is None
    batch = random_batch(rng, 3, decode_q=1)   # a random batch may hold no new tokens: then nothing is wrong
    token_ids = np.arange(3)
    for bad in (token_ids[:-1], token_ids.astype(np.float32)):
        with pytest.raises(ValueError, match=f"token_ids must hold {len(token_ids)} ints"):
            mb.build(*batch, token_ids=bad)


def test_empty_batch():
    md = builder().build([], [], [], pad_to=2)
    assert md.seq_lens.tolist() == [0, 0] and md.cu_seqlens_q.tolist() == [0, 0, 0]
    assert md.num_tokens == 0 and md.slot_mapping.numel() == 0
    assert (md.q_per_seq, md.max_query_len, md.max_seq_len) == (0, 0, 0)


@pytest.mark.parametrize(
    "seq_lens, query_lens, tables, kwargs, message",
    [
        ([5], [6], [[1, 2]], {}, r"query_lens\[0\]=6, seq_lens\[0\]=5"),
        ([5, 3], [1, -1], [[1, 2], [3]], {}, r"query_lens\[1\]=-1"),
        ([5, 9], [1, 1], [[1, 2], [3, 4]], {}, r"seq_lens\[1\]=9 exceeds the capacity of "
                                                 r"block_tables\[1\]: 2 blocks \* block_size 4"),
        ([5], [1], [[1, 2]] * 2, {}, "one entry per sequence"),
        ([5, 5], [1], [[1, 2]] * 2, {}, "one entry per sequence"),
        ([5], [1], [list(range(1, 14))], {}, r"block_tables\[0\] has 13 blocks, more than "
                                             "max_blocks_per_seq=12"),
        ([5], [1], [[1, -2]], {}, "block ids must be >= 0"),
        ([5], [1], [[1, 2**30]], {}, "within int32"),
        ([1] * 17, [1] * 17, [[1]] * 17, {}, "17 sequences .* max_num_seqs=16"),
        ([1] * 3, [1] * 3, [[1]] * 3, {"pad_to": 17}, "17 sequences"),
        ([1] * 3, [1] * 3, [[1]] * 3, {"pad_to": 2}, "pad_to must be an int >= the batch size 3"),
        ([40] * 4, [40] * 4, [list(range(10))] * 4, {"pad_to": 8}, "320 query tokens .* "
                                                                   "max_num_tokens=200"),
    ],
)
def test_bad_input(seq_lens, query_lens, tables, kwargs, message):
    mb = builder(max_num_tokens=200)
    with pytest.raises(ValueError, match=message):
        mb.build(seq_lens, query_lens, tables, **kwargs)


def test_builder_rejects_bad_capacities():
    with pytest.raises(ValueError, match="max_num_tokens must be a positive int, got 0"):
        MetadataBuilder(4, 0, 4, 16, "cpu")


@pytest.mark.gpu  # skipped without CUDA by tests/conftest.py
def test_cuda_build_never_syncs():
    rng = fresh_rng()
    mb = builder("cuda")
    batches = [random_batch(rng, n) for n in (5, 16, 2, 11)]
    results = []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in batches:  # more builds than staging buffers
            md = mb.build(*batch, pad_to=16)
            results.append([t.clone() for t in (md.seq_lens, md.cu_seqlens_q, md.block_tables,
                                                md.slot_mapping, md.positions)])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert md.seq_lens.device.type == "cuda" and all(buf.is_pinned() for buf in mb._staging)
    reference = builder("cpu")
    for batch, got in zip(batches, results):
        md = reference.build(*batch, pad_to=16)
        want = (md.seq_lens, md.cu_seqlens_q, md.block_tables, md.slot_mapping, md.positions)
        for g, w in zip(got, want):
            assert torch.equal(g.cpu(), w)


def test_position_offsets_shift_positions_not_slots():
    rng = fresh_rng()
    seq_lens, query_lens, tables = random_batch(rng, 5)
    offsets = [rng.randint(0, 100) for _ in seq_lens]
    md = builder().build(seq_lens, query_lens, tables, pad_to=7, position_offsets=offsets)
    cu, slots, positions, _ = expected_metadata(seq_lens, query_lens, tables)
    shifted = [p + offsets[b] for b in range(5) for p in positions[cu[b]:cu[b + 1]]]
    assert md.positions.tolist()[:cu[-1]] == shifted and md.slot_mapping.tolist()[:cu[-1]] == slots
    with pytest.raises(ValueError, match="position_offsets must hold 5 ints >= 0"):
        builder().build(seq_lens, query_lens, tables, position_offsets=[1, 2])


def test_block_table_array_with_num_blocks():
    """A zero-padded `[B, n]` array with per-row counts (the serving layer's form, `n` larger
    or smaller than max_blocks_per_seq) gives the same metadata as ragged lists."""
    rng = fresh_rng()
    seq_lens, query_lens, tables = random_batch(rng, 6)
    counts = [len(t) for t in tables]
    for width in (max(counts), MAX_BLOCKS + 5):
        table = np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32)
        md = builder().build(seq_lens, query_lens, table, num_blocks=counts, pad_to=8)
        want = builder().build(seq_lens, query_lens, tables, pad_to=8)
        for name in ("seq_lens", "cu_seqlens_q", "block_tables", "slot_mapping", "positions"):
            assert torch.equal(getattr(md, name), getattr(want, name))
    with pytest.raises(ValueError, match="num_blocks must hold one count per sequence"):
        builder().build(seq_lens, query_lens, table, num_blocks=counts[:2])
    with pytest.raises(ValueError, match="num_blocks and rows go with a 2-D block_tables array"):
        builder().build(seq_lens, query_lens, tables, num_blocks=counts)
    too_many = np.zeros((1, MAX_BLOCKS + 1), dtype=np.int32)
    with pytest.raises(ValueError, match=r"block_tables\[0\] has 13 blocks"):
        builder().build([4], [1], too_many, num_blocks=[MAX_BLOCKS + 1])


def test_rows_of_a_larger_table():
    """`rows` picks each sequence's row of a table of more sequences (in any order, wider or
    narrower than max_blocks_per_seq): the same metadata as the gathered rows."""
    rng = fresh_rng()
    seq_lens, query_lens, tables = random_batch(rng, 6)
    counts = [len(t) for t in tables]
    rows = rng.sample(range(10), 6)
    for width in (max(counts), MAX_BLOCKS, MAX_BLOCKS + 5):  # MAX_BLOCKS: taken into staging as is
        table = np.array([[rng.randint(1, 999) for _ in range(width)] for _ in range(10)], dtype=np.int32)
        for r, t in zip(rows, tables):
            table[r] = t + [0] * (width - len(t))
        md = builder().build(seq_lens, query_lens, table, rows=rows, num_blocks=counts, pad_to=8)
        want = builder().build(seq_lens, query_lens, tables, pad_to=8)
        for name in ("seq_lens", "cu_seqlens_q", "block_tables", "slot_mapping", "positions"):
            assert torch.equal(getattr(md, name), getattr(want, name))
    for bad in ([0, 1], [0, 1, 2, 3, 4, 10], [-1, 1, 2, 3, 4, 5]):
        with pytest.raises(ValueError, match=r"rows must hold 6 row indices of block_tables \(0\.\.9\)"):
            builder().build(seq_lens, query_lens, table, rows=bad, num_blocks=counts)
    with pytest.raises(ValueError, match="num_blocks and rows go with a 2-D block_tables array"):
        builder().build(seq_lens, query_lens, tables, rows=rows)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_block_ids_checked_in_the_copied_columns(dtype):
    """Negative or too large ids raise whatever the table's dtype (int64 ids past int32 too,
    which an int32 copy would wrap); ids past max_blocks_per_seq columns are never read."""
    table = np.zeros((2, MAX_BLOCKS + 3), dtype=dtype)
    table[:, MAX_BLOCKS:] = -7  # outside the copied columns
    builder().build([4, 4], [1, 1], table, rows=[1, 0], num_blocks=[1, 1])
    for bad in (-1, 2**29, 2**32 + 1 if dtype == np.int64 else 2**31 - 1):
        table[1, 0] = bad
        with pytest.raises(ValueError, match="block ids must be >= 0 with"):
            builder().build([4, 4], [1, 1], table, rows=[1, 0], num_blocks=[1, 1])
    with pytest.raises(TypeError, match="block_tables must hold integer block ids, got float32"):
        builder().build([4], [1], np.zeros((1, 2), dtype=np.float32))


def random_tables(rng: random.Random, num_seqs: int, columns: int = MAX_BLOCKS):
    """A `BlockTables` of `num_seqs` sequences (ids 0.., 1 to 40 tokens, tables `columns` wide)
    spread over rows that hold freed sequences in between; some tokens dropped from the front."""
    tables = BlockTables(BlockAllocator(num_seqs * (MAX_BLOCKS + 2)), BLOCK_SIZE)
    tables.reserve_columns(columns)
    for seq in range(num_seqs):
        tables.add(("gone", seq), rng.randint(0, 9))
        tables.add(seq, rng.randint(1, 40))
        tables.free(("gone", seq))
        if rng.random() < 0.3 and tables.seq_len(seq) >= 2 * BLOCK_SIZE:
            tables.drop_blocks(seq, 0, 1)
    assert tables.array.shape[1] == columns  # as reserved: build_from_tables trusts its rows
    return tables


def assert_same_metadata(got: AttentionMetadata, want: AttentionMetadata):
    for name in ("seq_lens", "cu_seqlens_q", "block_tables", "slot_mapping", "positions", "token_ids"):
        g, w = getattr(got, name), getattr(want, name)
        assert (g is None and w is None) or torch.equal(g, w), name
    for name in ("num_seqs", "num_tokens", "max_query_len", "max_seq_len", "q_per_seq"):
        assert getattr(got, name) == getattr(want, name), name


@pytest.mark.parametrize("kind", ["decode", "uniform", "mixed"])
def test_build_from_tables_equals_build(kind):
    """The serving path (rows of a BlockTables, checks left to the tables) gives what `build`
    gives for the same sequences as ragged lists, steps after steps on one builder, padded or
    not, with position offsets and token ids; a narrower table takes the checked path."""
    rng = fresh_rng()
    tables = random_tables(rng, 12)
    mb = builder()
    for step in range(6):
        seqs = rng.sample(range(12), rng.randint(1, 12))
        lens = [tables.seq_len(s) for s in seqs]
        q = {"decode": [1] * len(seqs), "uniform": [min(lens)] * len(seqs),
             "mixed": [rng.randint(0, n) for n in lens]}[kind]
        kwargs = dict(pad_to=rng.choice([None, 12]),
                      token_ids=[rng.randrange(1000) for _ in range(sum(q))] if step % 2 else None)
        offsets = [tables.position_offset(s) for s in seqs]
        want = builder().build(lens, q, [tables.block_table(s) for s in seqs],
                               position_offsets=offsets, **kwargs)
        got = mb.build_from_tables(tables, tables.rows(seqs), np.array(q), position_offsets=True,
                                   **kwargs)
        assert_same_metadata(got, want)
        without_offsets = builder().build(lens, q, [tables.block_table(s) for s in seqs], **kwargs)
        assert_same_metadata(mb.build_from_tables(tables, tables.rows(seqs), q, **kwargs),
                             without_offsets)
    narrow = BlockTables(BlockAllocator(8), BLOCK_SIZE)  # 8 columns, not MAX_BLOCKS
    narrow.add(0, 13)
    assert_same_metadata(builder().build_from_tables(narrow, narrow.rows([0]), [2]),
                         builder().build([13], [2], [narrow.block_table(0)]))


def test_build_from_tables_bad_input():
    rng = fresh_rng()
    tables = random_tables(rng, 3)
    rows = tables.rows([0, 1, 2])
    lens = tables.lens[rows].tolist()
    mb = builder()
    with pytest.raises(TypeError, match="tables must be a BlockTables, got ndarray"):
        mb.build_from_tables(tables.array, rows, [1, 1, 1])
    with pytest.raises(ValueError, match="tables has block_size 8, the builder 4"):
        mb.build_from_tables(BlockTables(BlockAllocator(2), 8), rows, [1, 1, 1])
    for bad in ([0, 1], [0, 1, len(tables.lens)], [0, -1, 2], np.array([0.0, 1.0, 2.0])):
        with pytest.raises(ValueError, match=r"rows must hold 3 row indices of block_tables"):
            mb.build_from_tables(tables, bad, [1, 1, 1])
    with pytest.raises(ValueError, match=r"rows must hold 2 row indices"):  # rows the tables issued
        mb.build_from_tables(tables, rows, [1, 1])
    with pytest.raises(ValueError, match="query_lens must be 1-D"):
        mb.build_from_tables(tables, rows, [[1, 1, 1]])
    for q in ([lens[0] + 1] * 3, [1, 1, -1], [1, lens[1] + 1, 0]):  # uniform, then not
        b = next(i for i in range(3) if not 0 <= q[i] <= lens[i])
        with pytest.raises(ValueError, match=rf"got query_lens\[{b}\]={q[b]}, seq_lens\[{b}\]={lens[b]}"):
            mb.build_from_tables(tables, rows, q)
    with pytest.raises(ValueError, match="pad_to must be an int >= the batch size 3"):
        mb.build_from_tables(tables, rows, [1, 1, 1], pad_to=2)
    long = random_tables(rng, 1)
    long.append(0, (MAX_BLOCKS + 1) * BLOCK_SIZE - long.seq_len(0))  # the table outgrows the builder
    with pytest.raises(ValueError, match=rf"block_tables\[0\] has {MAX_BLOCKS + 1} blocks, more than"):
        mb.build_from_tables(long, long.rows([0]), [1])
