"""Block-table helpers shared by the paged Triton kernels: lengths clamped into the table, and bad
block ids found before a key loop, which then reads only ids known to lie in the cache."""

import triton
import triton.language as tl

from ... import errors

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
