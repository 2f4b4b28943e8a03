"""Block-table helpers shared by the paged Triton kernels: lengths clamped into the table, and bad
block ids found before a key loop, which then reads only ids known to lie in the cache."""

import torch
import triton
import triton.language as tl

from ... import errors, gpu, replay

_ERR_LEN = tl.constexpr(errors.SEQ_LENS)
_EMPTY_TABLES: dict[torch.device, torch.Tensor] = {}


def table_for_no_blocks(device: torch.device) -> torch.Tensor:
    """A `[1, 1]` int32 block table for calls whose table is empty (the kernels clamp every length
    to 0 and read no entry): kept for the life of the process, so that such calls record and
    replay like any other and never allocate inside a CUDA graph's pool."""
    device = torch.device(device)
    if device not in _EMPTY_TABLES:
        _EMPTY_TABLES[device] = replay.keep(gpu.kept_tensor(
            lambda: torch.zeros(1, 1, dtype=torch.int32, device=device), device))
    return _EMPTY_TABLES[device]


def key_capacity(max_blocks: int, block_size: int, num_blocks: int) -> int:
    """Keys a block table of `max_blocks` entries addresses (`kv_cap`, the bound lengths are
    clamped to): none in a cache of no blocks, where no id is valid."""
    return max_blocks * block_size if num_blocks else 0


@triton.jit
def clamped_seq_len(SeqLens, b, kv_cap, Err, FLAG: tl.constexpr):
    """Sequence `b`'s key count, clamped into the block table's capacity `kv_cap`: a bad length
    reads no memory outside it (and, with FLAG, sets the `seq_lens` bit in `Err`)."""
    raw = tl.load(SeqLens + b)
    if FLAG:
        tl.atomic_or(Err, _ERR_LEN, mask=(raw < 0) | (raw > kv_cap), sem="relaxed")
    return tl.minimum(tl.maximum(raw, 0), kv_cap).to(tl.int32)


@triton.jit
def _absent_in_chunk(bt_row, stride_btp, p, page_hi, num_blocks, CHUNK: tl.constexpr):
    idx = p + tl.arange(0, CHUNK)
    ids = tl.load(bt_row + idx * stride_btp, mask=idx < page_hi, other=0)
    return tl.max(((ids < 0) | (ids >= num_blocks)).to(tl.int32), 0)


@triton.jit
def any_absent_block(bt_row, stride_btp, page_lo, page_hi, num_blocks,
                     CHUNK: tl.constexpr, INTERPRET: tl.constexpr):
    """1 if a block id among table entries `[page_lo, page_hi)` lies outside `[0, num_blocks)`,
    else 0. Programs call it on the entries their key loop will read, and skip the loop on 1: a
    per-tile check inside the loop would cost it its pipelining (sm_90)."""
    absent = page_lo * 0
    if INTERPRET:   # the interpreter takes no loaded value as a `range` bound (numpy >= 2.4)
        p = page_lo
        while p < page_hi:
            absent = tl.maximum(absent, _absent_in_chunk(bt_row, stride_btp, p, page_hi, num_blocks, CHUNK))
            p += CHUNK
    else:
        for p in range(page_lo, page_hi, CHUNK):
            absent = tl.maximum(absent, _absent_in_chunk(bt_row, stride_btp, p, page_hi, num_blocks, CHUNK))
    return absent
