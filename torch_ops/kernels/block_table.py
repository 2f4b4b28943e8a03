"""Block-table helpers shared by the paged Triton kernels: lengths clamped into the table, and bad
block ids found before a key loop (a program whose ids are all good runs its loop unchecked; one
that has a bad id runs the loop that masks absent blocks' keys)."""

import triton
import triton.language as tl

from .. import errors

_ERR_LEN = tl.constexpr(errors.SEQ_LENS)


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
    else 0. Programs call it on the entries their key loop reads: a loop over ids known good
    needs no per-tile check, which would cost the loop its pipelining."""
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


@triton.jit
def _flag_chunk(bt_row, stride_btp, p, page_hi, num_blocks, Err, BIT: tl.constexpr, CHUNK: tl.constexpr):
    idx = p + tl.arange(0, CHUNK)
    inside = idx < page_hi
    ids = tl.load(bt_row + idx * stride_btp, mask=inside, other=0)
    tl.atomic_or(Err + tl.zeros([CHUNK], tl.int32), BIT, mask=inside & ((ids < 0) | (ids >= num_blocks)),
                 sem="relaxed")


@triton.jit
def flag_absent_blocks(bt_row, stride_btp, page_lo, page_hi, num_blocks, Err, BIT: tl.constexpr,
                       CHUNK: tl.constexpr, INTERPRET: tl.constexpr):
    """Set `BIT` in the error flag `Err` if a block id among table entries `[page_lo, page_hi)`
    lies outside `[0, num_blocks)`."""
    if INTERPRET:
        p = page_lo
        while p < page_hi:
            _flag_chunk(bt_row, stride_btp, p, page_hi, num_blocks, Err, BIT, CHUNK)
            p += CHUNK
    else:
        for p in range(page_lo, page_hi, CHUNK):
            _flag_chunk(bt_row, stride_btp, p, page_hi, num_blocks, Err, BIT, CHUNK)


@triton.jit
def absent_bias(Err, page_ok, ONE_PAGE: tl.constexpr):
    """The score bias of a tile's keys, `[1, BLOCK_N]` (a scalar for a one-page tile): 0, or -inf
    in an absent block, loaded from the constants after the error flag (`errors.device_flag`)
    through an address that depends on the page id. Triton's pipeliner then keeps the block-table
    load an address-only load; a mask computed from it directly changes the loop's schedule
    (sm_90, FP8 and INT8 decode at B = 64, 4k keys: 1.4-1.7x the time)."""
    bias = tl.load(Err + tl.where(page_ok, 1, 2)).to(tl.float32, bitcast=True)
    if not ONE_PAGE:
        bias = bias[None, :]
    return bias
