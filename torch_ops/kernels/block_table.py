"""Block-table helpers shared by the paged Triton kernels."""

import triton
import triton.language as tl


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
    lies outside `[0, num_blocks)`. Programs call it before their key loop, which then only
    clamps such ids (in bounds) and masks their keys: the loop carries no error state."""
    if INTERPRET:   # the interpreter takes no loaded value as a `range` bound (numpy >= 2.4)
        p = page_lo
        while p < page_hi:
            _flag_chunk(bt_row, stride_btp, p, page_hi, num_blocks, Err, BIT, CHUNK)
            p += CHUNK
    else:
        for p in range(page_lo, page_hi, CHUNK):
            _flag_chunk(bt_row, stride_btp, p, page_hi, num_blocks, Err, BIT, CHUNK)
