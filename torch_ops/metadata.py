"""Per-step attention metadata (lengths, block tables, slots, positions, token ids) built on the
host and copied to a persistent device buffer with one async copy, never reading device data
back.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import torch

from torch_ops.kv_cache import BlockTables

_INT32_MAX = 2**31 - 1
_MAX_LAYOUTS = 256  # cached batch shapes (views are cheap to recreate; addresses never change)
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}  # by itemsize: negatives -> huge
_ALIGN = 4   # int32 elements: every section starts 16-byte aligned (kernels compile one variant)


@dataclass
class AttentionMetadata:
    """Metadata of one batch of `B` sequences and `T` new tokens (padding included).

    Device tensors (int32, views of the builder's persistent buffer, overwritten by its next
    `build`): `seq_lens [B]` (keys per sequence, new tokens included), `cu_seqlens_q [B + 1]`,
    `block_tables [B, max_blocks_per_seq]` (0 past each sequence's blocks), `slot_mapping [T]`
    (`block * block_size + offset` of each new token, -1 for padding tokens), `positions [T]`
    (absolute position `seq_len - query_len + i` of each new token, 0 for padding tokens),
    `token_ids [T]` (the model's input ids when `build` got them, 0 for padding tokens; else None).
    Host ints: `num_seqs` (B), `num_tokens` (T), `max_query_len`, `max_seq_len`, and `q_per_seq`
    (the query length shared by all sequences, e.g. 1 for decode; 0 if they differ or are 0).
    """

    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    token_ids: torch.Tensor | None
    num_seqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    q_per_seq: int


class _Layout(NamedTuple):
    """Where the metadata of `B` sequences and `T` tokens lies in the flat int32 buffers: the
    sections `seq_lens [B]`, `cu_seqlens_q [B + 1]`, `block_tables [B * max_blocks_per_seq]`,
    `slot_mapping [T]`, `positions [T]`, `token_ids [T]` packed one after the other, each
    starting on a 16-byte boundary, so that a step copies exactly the prefix it filled."""

    host: list[tuple[np.ndarray, ...]]  # per staging buffer: one numpy view per section
    device: tuple[torch.Tensor, ...]    # one device view per section (block_tables [B, m])
    ends: tuple[int, int]               # the filled prefix without and with the token ids
    copies: list[tuple[tuple[torch.Tensor, torch.Tensor], ...]]  # per staging buffer and end:
    # (device prefix, staging prefix)
    uniform_cu: np.ndarray  # cu_seqlens_q [B + 1] if the batch is uniform (T / B tokens each)


class MetadataBuilder:
    """Builds `AttentionMetadata` into one device buffer allocated once; a batch shape `(B, T)`
    always lands at the same addresses (CUDA graphs captured per bucket stay valid).

    Capacities: `max_num_seqs` sequences (padding included), `max_num_tokens` new tokens,
    `max_blocks_per_seq` block-table columns. Each `build` fills a host staging buffer (pinned on
    CUDA; two used in turn) and issues exactly one non-blocking copy on the current stream,
    and no other device work: every tensor it returns is a cached view of the device buffer.
    """

    def __init__(
        self,
        max_num_seqs: int,
        max_num_tokens: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device | str,
    ):
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_tokens", max_num_tokens),
                            ("max_blocks_per_seq", max_blocks_per_seq),
                            ("block_size", block_size)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.device = torch.device(device)

        size = max_num_seqs * (2 + max_blocks_per_seq) + 1 + 3 * max_num_tokens + 6 * (_ALIGN - 1)
        self._device_buf = torch.zeros(size, dtype=torch.int32, device=self.device)
        # A CPU "device" is written through numpy: torch's copy_ would use intra-op threads.
        self._device_np = self._device_buf.numpy() if self.device.type == "cpu" else None
        cuda = self.device.type == "cuda"
        # Two staging buffers used in turn: build N waits only for the copy of build N - 2.
        self._staging = [torch.zeros(size, dtype=torch.int32, pin_memory=cuda) for _ in range(2)]
        self._staging_np = [buf.numpy() for buf in self._staging]
        self._copy_done = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self._turn = 0
        self._layouts: dict[tuple[int, int], _Layout] = {}
        self._arange = np.arange(max(max_num_seqs, max_num_tokens) + 1)
        self._arange32 = self._arange.astype(np.int32)  # cu_seqlens without a cast
        self._row_starts = self._arange[:max_num_seqs] * max_blocks_per_seq  # flat index of each row

    def _layout(self, batch: int, num_tokens: int) -> _Layout:
        """The (cached) views of a batch shape; slicing tensors costs microseconds per step."""
        layout = self._layouts.get((batch, num_tokens))
        if layout is None:
            if len(self._layouts) >= _MAX_LAYOUTS:
                self._layouts.clear()
            m = self.max_blocks_per_seq
            sizes = (batch, batch + 1, batch * m, num_tokens, num_tokens, num_tokens)
            starts = np.cumsum((0,) + tuple(-(-n // _ALIGN) * _ALIGN for n in sizes)).tolist()
            bounds = [(a, a + n) for a, n in zip(starts, sizes)]

            def views(buf):
                parts = [buf[a:b] for a, b in bounds]
                parts[2] = parts[2].reshape(batch, m)
                return tuple(parts)

            ends = (bounds[-2][1], bounds[-1][1])  # without and with the token ids
            layout = _Layout(
                host=[views(buf) for buf in self._staging_np],
                device=views(self._device_buf),
                ends=ends,
                copies=[tuple((self._device_buf[:n], buf[:n]) for n in ends) for buf in self._staging],
                uniform_cu=self._arange32[:batch + 1] * (num_tokens // max(batch, 1)),
            )
            self._layouts[batch, num_tokens] = layout
        return layout

    def build(
        self,
        seq_lens: Sequence[int] | np.ndarray,
        query_lens: Sequence[int] | np.ndarray,
        block_tables: Sequence[Sequence[int]] | np.ndarray | torch.Tensor,
        *,
        num_blocks: Sequence[int] | np.ndarray | None = None,
        rows: Sequence[int] | np.ndarray | None = None,
        pad_to: int | None = None,
        position_offsets: Sequence[int] | np.ndarray | None = None,
        token_ids: Sequence[int] | np.ndarray | None = None,
    ) -> AttentionMetadata:
        """Metadata for `B` sequences from host data: `seq_lens[b]` keys (new tokens included),
        `query_lens[b]` new tokens (the last ones), `block_tables[b]` the block ids of sequence
        `b`, with `seq_lens[b] <= (blocks of b) * block_size`. Block tables are ragged lists, or
        a 2-D host array `[B, n]` (numpy or CPU tensor; the fast form): row `b` then holds
        `num_blocks[b]` block ids followed by zeros, or `n` ids when `num_blocks` is None.
        With `rows`, the 2-D array holds the tables of more sequences `[N, n]` (e.g.
        `BlockTables.array`), sequence `b`'s being row `rows[b]`, gathered straight into the
        staging buffer.

        `pad_to` pads the batch to that many sequences (CUDA-graph buckets) with `seq_len 0`
        sequences and zero block-table rows. Their query length is 0, except when the real batch
        is uniform (`q_per_seq = k > 0`, e.g. decode): then each padding sequence keeps `k`
        query rows (slot -1, position 0), so `T = pad_to * k` and the padded batch stays uniform
        for `paged_decode`, which yields zeros for `seq_len 0`.

        `position_offsets[b]` is added to sequence `b`'s `positions` (not to its slots): the
        tokens a sliding-window cache dropped before its first cached token, so that RoPE sees
        absolute positions while the ops see positions within the cache.

        `token_ids [sum(query_lens)]` (the model's input ids of the new tokens, packed in batch
        order) travel in the same copy and come back as `token_ids`.
        """
        seq, qlen, table, num_blocks, rows = self._parse(seq_lens, query_lens, block_tables,
                                                         num_blocks, rows)
        offsets = None if position_offsets is None else self._offsets_array(position_offsets, len(seq))
        return self._fill(seq, qlen, table, rows, pad_to, offsets, token_ids, trusted=False)

    def build_from_tables(
        self,
        tables: BlockTables,
        rows: np.ndarray,
        query_lens: Sequence[int] | np.ndarray,
        *,
        pad_to: int | None = None,
        position_offsets: bool = False,
        token_ids: Sequence[int] | np.ndarray | None = None,
    ) -> AttentionMetadata:
        """`build` for the sequences at `rows [B]` of `tables` (e.g. what `append_batch`
        returned), `query_lens[b]` new tokens each, with `tables.offsets[rows]` as the position
        offsets if `position_offsets`; `pad_to`, `token_ids` as in `build`.

        The serving fast path: `BlockTables` keeps each sequence's length within its blocks and
        its block ids in the allocator's range, so when `tables.array` is `max_blocks_per_seq`
        wide (`reserve_columns`) only `rows` and `query_lens` are checked, and the rows are
        gathered straight into the staging buffer. Otherwise this is `build` with its checks.
        """
        if not isinstance(tables, BlockTables):
            raise TypeError(f"tables must be a BlockTables, got {type(tables).__name__}")
        if tables.block_size != self.block_size:
            raise ValueError(f"tables has block_size {tables.block_size}, the builder "
                             f"{self.block_size}")
        qlen = np.asarray(query_lens, dtype=np.int64)
        if qlen.ndim != 1:
            raise ValueError(f"query_lens must be 1-D (one entry per sequence), got shape {qlen.shape}")
        if not (tables.issued(rows) and len(rows) == len(qlen)):
            rows = self._rows_array(rows, len(qlen), len(tables.lens))
        seq = tables.lens[rows]
        offsets = tables.offsets[rows] if position_offsets else None
        if (tables.array.shape[1] != self.max_blocks_per_seq
                or tables.allocator.num_blocks * self.block_size > _INT32_MAX):
            return self.build(seq, qlen, tables.array, rows=rows, num_blocks=tables.num_blocks[rows],
                              pad_to=pad_to, position_offsets=offsets, token_ids=token_ids)
        return self._fill(seq, qlen, tables.array, rows, pad_to, offsets, token_ids, trusted=True)

    def _fill(self, seq, qlen, table, rows, pad_to, offsets, token_ids, trusted: bool):
        """Write the host arrays of `B` sequences (`seq`, `qlen`, `offsets [B]`; the block table
        `table [B, n]`, or `[N, n]` with `rows [B]`) into the staging buffer, copy it to the
        device and return the metadata. The arrays passed `_parse`'s checks, except for the
        block ids (checked here as they are copied); or they are a `BlockTables`' own
        (`trusted`): then only `qlen` against `seq` is checked here."""
        num_real = len(seq)
        if pad_to is not None and not (isinstance(pad_to, int) and pad_to >= num_real):
            raise ValueError(f"pad_to must be an int >= the batch size {num_real}, got {pad_to!r}")
        batch = num_real if pad_to is None else pad_to
        if batch > self.max_num_seqs:
            raise ValueError(
                f"the batch has {batch} sequences (padding included), more than "
                f"max_num_seqs={self.max_num_seqs}"
            )
        max_query_len = int(qlen.max(initial=0))
        min_query_len = int(qlen.min(initial=max_query_len))
        uniform = min_query_len == max_query_len
        if trusted:
            # Uniform: is a sequence shorter than the max_query_len tokens of all?
            short = seq.min(initial=max_query_len) < max_query_len if uniform else (qlen > seq).any()
            if short or min_query_len < 0:
                self._raise_bad_query_lens(seq, qlen)
        # Uniform batches keep query rows in padding sequences (see `build`).
        q_per_seq = max_query_len if num_real and uniform else 0
        real_tokens = num_real * q_per_seq if q_per_seq else int(qlen.sum())
        num_tokens = real_tokens + (batch - num_real) * q_per_seq
        if num_tokens > self.max_num_tokens:
            raise ValueError(
                f"the batch has {num_tokens} query tokens (padding included), more than "
                f"max_num_tokens={self.max_num_tokens}"
            )
        ids = None if token_ids is None else self._token_ids_array(token_ids, real_tokens)

        self._wait_for_staging()
        layout = self._layout(batch, num_tokens)
        h_seq, h_cu, h_bt, h_slot, h_pos, h_ids = layout.host[self._turn]
        m = self.max_blocks_per_seq
        if rows is not None and table.shape[1] == m and table.dtype == np.int32:
            # e.g. BlockTables.reserve_columns(m); rows are checked, and "clip" writes unbuffered
            np.take(table, rows, axis=0, out=h_bt[:num_real], mode="clip")
            if not trusted:
                self._check_block_ids(h_bt[:num_real])
        else:
            width = min(table.shape[1], m)  # columns past m are zeros (num_blocks <= m, checked)
            src = table[:, :width] if rows is None else table[rows, :width]
            self._check_block_ids(src)  # before the cast to int32 (the int64 ids of ragged lists)
            h_bt[:num_real, :width] = src
            h_bt[:num_real, width:] = 0
        h_seq[:num_real] = seq
        if batch > num_real:
            h_bt[num_real:] = 0
            h_seq[num_real:] = 0
        if q_per_seq:
            h_cu[:] = layout.uniform_cu
        else:
            h_cu[0] = 0
            np.cumsum(qlen, out=h_cu[1:num_real + 1])
            h_cu[num_real + 1:] = real_tokens

        # Token t of the real batch: position pos[t] within the cache of the sequence whose
        # table row starts at index row_start[t] of the flat h_bt; its slot is
        # table[block] * block_size + pos % block_size with block = pos // block_size.
        if q_per_seq == 1:  # decode: one token per sequence, the last one
            pos, row_start = seq - 1, self._row_starts[:num_real]
        else:
            pos = np.repeat(seq - h_cu[1:num_real + 1], qlen)
            pos += self._arange[:real_tokens]
            row_start = np.repeat(self._row_starts[:num_real], qlen)
        block = pos // self.block_size
        h_slot[:real_tokens] = (h_bt.reshape(-1)[block + row_start] - block) * self.block_size + pos
        if offsets is not None:
            pos += offsets if q_per_seq == 1 else np.repeat(offsets, qlen)
        h_pos[:real_tokens] = pos
        if ids is not None:
            h_ids[:real_tokens] = ids
        if num_tokens > real_tokens:
            h_slot[real_tokens:] = -1
            h_pos[real_tokens:] = 0
            h_ids[real_tokens:] = 0

        self._copy_to_device(layout, with_ids=ids is not None)
        d_seq, d_cu, d_bt, d_slot, d_pos, d_ids = layout.device
        return AttentionMetadata(d_seq, d_cu, d_bt, d_slot, d_pos, None if ids is None else d_ids,
                                 num_seqs=batch, num_tokens=num_tokens, max_query_len=max_query_len,
                                 max_seq_len=int(seq.max(initial=0)), q_per_seq=q_per_seq)

    def _parse(self, seq_lens, query_lens, block_tables, num_blocks, rows):
        """Validated host arrays: `(seq_lens, query_lens, block table [B or N, n], blocks per
        sequence, rows or None)`; block ids are checked once copied (`_check_block_ids`)."""
        seq = np.asarray(seq_lens, dtype=np.int64)
        qlen = np.asarray(query_lens, dtype=np.int64)
        array = isinstance(block_tables, (np.ndarray, torch.Tensor)) and block_tables.ndim == 2
        num_tables = len(seq) if rows is not None and array else len(block_tables)
        if seq.ndim != 1 or qlen.shape != seq.shape or num_tables != len(seq):
            raise ValueError(
                "seq_lens, query_lens and block_tables (or rows) must have one entry per sequence, "
                f"got {seq.shape}, {qlen.shape} and {num_tables} entries"
            )
        if array:
            table = np.asarray(block_tables)
            if table.dtype.kind not in "iu":
                raise TypeError(f"block_tables must hold integer block ids, got {table.dtype}")
            if rows is not None:
                rows = self._rows_array(rows, len(seq), len(table))
            if num_blocks is None:
                num_blocks = np.full(len(seq), table.shape[1], dtype=np.int64)
            num_blocks = np.asarray(num_blocks)
            if num_blocks.shape != seq.shape:
                raise ValueError(f"num_blocks must hold one count per sequence, got shape "
                                 f"{num_blocks.shape} for {len(seq)} sequences")
        elif num_blocks is not None or rows is not None:
            raise ValueError("num_blocks and rows go with a 2-D block_tables array, not ragged lists")
        else:
            num_blocks = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(seq))
            table = np.zeros((len(seq), int(num_blocks.max(initial=0))), dtype=np.int64)
            table[np.arange(table.shape[1]) < num_blocks[:, None]] = np.fromiter(
                itertools.chain.from_iterable(block_tables), dtype=np.int64,
                count=int(num_blocks.sum()))
        # One combined test on the fast path (qlen <= seq with qlen >= 0 implies seq >= 0).
        if ((qlen < 0) | (qlen > seq) | (num_blocks > self.max_blocks_per_seq)
                | (seq > num_blocks * self.block_size)).any():
            self._raise_bad_lengths(seq, qlen, num_blocks)
        return seq, qlen, table, num_blocks, rows

    @staticmethod
    def _rows_array(rows, num_seqs: int, num_rows: int) -> np.ndarray:
        rows = np.asarray(rows)
        # Negative rows are huge once seen as unsigned: one max checks both ends.
        if rows.shape != (num_seqs,) or (num_seqs and (
                rows.dtype.kind not in "iu" or rows.view(_UNSIGNED[rows.itemsize]).max() >= num_rows)):
            raise ValueError(f"rows must hold {num_seqs} row indices of block_tables (0.."
                             f"{num_rows - 1}), one per sequence, got {rows.tolist()}")
        return rows

    def _check_block_ids(self, table: np.ndarray) -> None:
        """Block ids must be >= 0 with `(id + 1) * block_size` within int32: one pass over the
        ids seen as unsigned, where negative ids are huge."""
        if table.size and (int(table.view(_UNSIGNED[table.itemsize]).max()) + 1) * self.block_size > _INT32_MAX:
            raise ValueError(
                "block ids must be >= 0 with (block + 1) * block_size within int32, got ids in "
                f"{int(table.min())}..{int(table.max())}"
            )

    @staticmethod
    def _raise_bad_query_lens(seq: np.ndarray, qlen: np.ndarray):
        bad = (qlen < 0) | (qlen > seq)
        if bad.any():
            b = int(np.argmax(bad))
            raise ValueError(
                f"need 0 <= query_lens[b] <= seq_lens[b], got query_lens[{b}]={int(qlen[b])}, "
                f"seq_lens[{b}]={int(seq[b])}"
            )

    def _raise_bad_lengths(self, seq: np.ndarray, qlen: np.ndarray, num_blocks: np.ndarray):
        self._raise_bad_query_lens(seq, qlen)
        too_long = num_blocks > self.max_blocks_per_seq
        if too_long.any():
            b = int(np.argmax(too_long))
            raise ValueError(
                f"block_tables[{b}] has {int(num_blocks[b])} blocks, more than "
                f"max_blocks_per_seq={self.max_blocks_per_seq}"
            )
        b = int(np.argmax(seq > num_blocks * self.block_size))
        raise ValueError(
            f"seq_lens[{b}]={int(seq[b])} exceeds the capacity of block_tables[{b}]: "
            f"{int(num_blocks[b])} blocks * block_size {self.block_size}"
        )

    @staticmethod
    def _offsets_array(position_offsets, num_seqs: int) -> np.ndarray:
        offsets = np.asarray(position_offsets, dtype=np.int64)
        if offsets.shape != (num_seqs,) or (offsets < 0).any():
            raise ValueError(
                f"position_offsets must hold {num_seqs} ints >= 0 (one per sequence), got "
                f"{offsets.tolist()}"
            )
        return offsets

    @staticmethod
    def _token_ids_array(token_ids, num_tokens: int) -> np.ndarray:
        ids = np.asarray(token_ids)
        if ids.shape != (num_tokens,) or (num_tokens and ids.dtype.kind not in "iu"):
            raise ValueError(f"token_ids must hold {num_tokens} ints (one per new token), got "
                             f"shape {ids.shape} of {ids.dtype}")
        return ids

    def _wait_for_staging(self) -> None:
        """The staging buffer about to be reused may still feed an async copy: wait for it."""
        event = self._copy_done[self._turn]
        if event is not None:
            event.synchronize()

    def _copy_to_device(self, layout: _Layout, with_ids: bool) -> None:
        """The step's one host-to-device copy (the filled prefix of the staging buffer), then
        switch staging buffers."""
        if self._device_np is not None:
            n = layout.ends[with_ids]
            self._device_np[:n] = self._staging_np[self._turn][:n]
        else:
            dst, src = layout.copies[self._turn][with_ids]
            dst.copy_(src, non_blocking=True)
            event = self._copy_done[self._turn]
            if event is not None:
                event.record()
        self._turn ^= 1
