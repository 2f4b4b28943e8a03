"""Triton `attn::cache_attention` (PPL's MultiHeadCacheAttention) on the existing kernels: no
attention kernel of its own, only views, one small metadata kernel and three launches.

Semantics: docs/ops.md (`cache_attention`); `reference.cache_attention` is the oracle.

1. **Views, not copies.** One layer of the PPL cache (any of its four layouts) is a pair of
   `[MaxT, Hkv, Dh]` row views (k and v; `scale` alike). Writes see them as a paged cache of
   block size 1 (`[MaxT, 1, Hkv, Dh]`, slot = cache row). Reads see them as *overlapping* blocks
   `[MaxT - bs + 1, bs, Hkv, Dh]` whose block stride is one row: block id `r` is the `bs` rows
   starting at row `r`, so any run of consecutive rows is one block whatever its alignment. In
   offset mode a sequence's rows are consecutive (`cachestarts[b] + p`): block `j` of sequence
   `b` is row `cachestarts[b] + j * bs`, with `bs = OFFSET_BLOCK` (a multiple of every key tile
   of the kernels: one block-table load per tile). In page-table mode `bs` divides `page_size`
   (`page_size` itself up to 256), so a block never crosses a page.
2. **Metadata on the device** (`_metadata_kernel`, one launch, grid from shapes only: CUDA-graph
   safe, no host sync): the cache row of every current token (the write's slot mapping), the
   key count of every sequence (`kvstarts[b+1] - kvstarts[b]`, clamped into `[0, max_kvlen]`,
   `max_kvlen` as the front buckets it: the next power of two) and the block table
   `[B, cdiv(max_kvlen, bs)]` (the row of key `j * bs`, -1 for a block outside the cache: an
   absent block), int64 rows. A token finds its sequence
   by a binary search over `seqstarts`.
3. `kv_cache_write` writes current k/v at those rows (INT8/INT4 quantized with the scale cache),
   then one attention launch reads past + current keys: `paged_decode` when every sequence has
   the same 1..8 new tokens (known from shapes: `T == B * max_seqlen`), else one `paged_prefill`
   for the whole mixed batch. `decoding_batches` is never read: a decode has one new token (the
   contract), for which causal and non-causal attention agree, so one causal launch serves the
   mixed batch and nothing waits for that tensor's value.

Not served (`unsupported` says why; the automatic choice then takes `vanilla`): a custom
`attn_mask`; what the underlying kernels do not serve (head dims > 256).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ... import errors, gpu, ops, replay
from ...checks import ppl_cache_views
from . import kv_cache_write, paged_decode, paged_prefill, prefill_attention
from .launcher import TritonLaunch

OFFSET_BLOCK = 128          # keys per block of offset-mode views
MAX_BLOCK = 256             # the paged kernels' largest block size
TOKENS_PER_PROGRAM = 128    # current tokens per program of the metadata kernel
BLOCKS_PER_PROGRAM = 128    # block-table entries per program of the metadata kernel
_ERR_ROWS = tl.constexpr(errors.CACHESTARTS)
_ERR_KV = tl.constexpr(errors.KVSTARTS)


@triton.jit
def _row(Cachestarts, b, pos, ok, stride_cb, stride_cp, max_pages, max_rows, PAGE_SIZE: tl.constexpr):
    """Cache row of position `pos` of sequence `b` (offset mode when PAGE_SIZE == 0): the row
    where `ok` and inside the cache (page-table mode: the page within `cachestarts` and all its
    rows inside the cache), else -1; and where `ok` but outside the cache (to flag)."""
    if PAGE_SIZE == 0:
        start = tl.load(Cachestarts + b * stride_cb + pos * 0, mask=ok, other=0).to(tl.int64)   # b may be scalar
        row = start + pos
        inside = (row >= 0) & (row < max_rows)
    else:
        page = pos // PAGE_SIZE
        in_table = (pos >= 0) & (page < max_pages)
        start = tl.load(Cachestarts + b * stride_cb + page * stride_cp, mask=ok & in_table, other=-1).to(tl.int64)
        row = start + pos % PAGE_SIZE
        inside = in_table & (start >= 0) & (start + PAGE_SIZE <= max_rows)
    return tl.where(ok & inside, row, -1), ok & ~inside


@triton.jit
def _metadata_kernel(
    Seqstarts, Kvstarts, Cachestarts, StartPos, Slots, SeqLens, BlockTables, Err,
    num_tokens, num_seqs, max_pages, max_rows, max_kvlen, num_blocks, token_programs, table_programs,
    stride_cb, stride_cp, stride_btb,
    PAGE_SIZE: tl.constexpr, BS: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_J: tl.constexpr,
):
    """Programs [0, token_programs): slots of BLOCK_T current tokens (-1: not written). Then
    `table_programs` per sequence: BLOCK_J entries of its block-table row each (-1: an absent
    block; the first program also writes its key count). Out-of-range metadata sets its bits in
    `Err`: key counts are clamped into [0, max_kvlen] (offset mode: to the rows left in the cache
    from `cachestarts[b]`, none when it is negative)."""
    pid = tl.program_id(0)
    if pid < token_programs:
        t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = t < num_tokens
        # the last sequence b with seqstarts[b] <= t
        lo = tl.zeros([BLOCK_T], tl.int32)
        hi = lo + num_seqs - 1
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi + 1) // 2
            go = tl.load(Seqstarts + mid, mask=t_ok, other=0) <= t
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid - 1)
        first = tl.load(Seqstarts + lo, mask=t_ok, other=0)
        pos = tl.load(StartPos + lo, mask=t_ok, other=0).to(tl.int64) + (t - first)
        row, outside = _row(Cachestarts, lo, pos, t_ok, stride_cb, stride_cp, max_pages, max_rows, PAGE_SIZE)
        tl.atomic_or(Err + t * 0, _ERR_ROWS, mask=outside)
        tl.store(Slots + t, row, mask=t_ok)
    else:
        seq = (pid - token_programs) // table_programs
        chunk = (pid - token_programs) % table_programs
        raw = tl.load(Kvstarts + seq + 1).to(tl.int64) - tl.load(Kvstarts + seq)
        kv_len = tl.minimum(tl.maximum(raw, 0), max_kvlen)
        if PAGE_SIZE == 0:
            start = tl.load(Cachestarts + seq * stride_cb).to(tl.int64)
            if chunk == 0:
                tl.atomic_or(Err, _ERR_ROWS, mask=(kv_len > 0) & ((start < 0) | (start + kv_len > max_rows)))
            kv_len = tl.where(start < 0, 0, tl.minimum(kv_len, tl.maximum(max_rows - start, 0)))
        if chunk == 0:
            tl.atomic_or(Err, _ERR_KV, mask=(raw < 0) | (raw > max_kvlen))
            tl.store(SeqLens + seq, kv_len.to(tl.int32))
        j = chunk * BLOCK_J + tl.arange(0, BLOCK_J)
        key = (j * BS).to(tl.int64)
        block, outside = _row(Cachestarts, seq, key, key < kv_len, stride_cb, stride_cp, max_pages, max_rows,
                              PAGE_SIZE)
        tl.atomic_or(Err + j * 0, _ERR_ROWS, mask=outside)
        tl.store(BlockTables + seq * stride_btb + j, block, mask=j < num_blocks)


def _blocks(rows: torch.Tensor, bs: int) -> torch.Tensor:
    """Overlapping blocks `[MaxT - bs + 1, bs, Hkv, last]` of the row view `[MaxT, Hkv, last]`:
    block `r` is rows `r .. r + bs - 1`."""
    max_t, hkv, last = rows.shape
    st, sh, sd = rows.stride()
    return rows.as_strided((max(max_t - bs + 1, 0), bs, hkv, last), (st, st, sh, sd))


def _block_size(max_t: int, cache_mode: int, page_size: int) -> int:
    """Keys per block of the read views: OFFSET_BLOCK (offset mode) or the largest divisor of
    `page_size` up to MAX_BLOCK, and never more than the cache's rows."""
    limit = max(1, min(max_t, OFFSET_BLOCK if cache_mode == 0 else MAX_BLOCK))
    if cache_mode == 0:
        return limit
    return next(s for s in range(min(limit, page_size), 0, -1) if page_size % s == 0)


@functools.lru_cache(maxsize=None)
def _alibi_slopes(num_heads: int, device: torch.device) -> torch.Tensor:
    """Cached on the device, so that a call inside CUDA-graph capture copies nothing from the host
    (kept for the process: replays pass its address)."""
    return replay.keep(gpu.kept_tensor(lambda: ops.alibi_slopes(num_heads).to(device), device))


class _Problem:
    """One call's cache views: `k_rows`/`v_rows [MaxT, Hkv, last]` (and the scale rows, or None)."""

    def __init__(self, cache, scale, *, layer_idx, cache_layout, quant_bit, **_):
        if quant_bit == 4:
            cache = cache.view(torch.uint8)   # packed INT4 may come as an int8 tensor
        self.k_rows, self.v_rows = ppl_cache_views(cache, layer_idx, cache_layout)
        self.ks_rows, self.vs_rows = ppl_cache_views(scale, layer_idx, cache_layout) if quant_bit else (None, None)

    def write_views(self) -> tuple:
        """(k_cache, v_cache, k_scale, v_scale) of block size 1: slot = cache row."""
        views = [x if x is None else x.unsqueeze(1) for x in (self.k_rows, self.v_rows, self.ks_rows, self.vs_rows)]
        return tuple(views)

    def read_views(self, bs: int) -> tuple:
        """(k_cache, v_cache, k_scale, v_scale) of overlapping blocks of `bs` rows."""
        return tuple(x if x is None else _blocks(x, bs) for x in (self.k_rows, self.v_rows, self.ks_rows, self.vs_rows))


def unsupported(query, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, decoding_batches,
                max_seqlen, max_kvlen, cache, scale=None, attn_mask=None, **attrs) -> list[str]:
    """Reasons the Triton path cannot run the call (the front has validated shapes and dtypes)."""
    why = []
    if attn_mask is not None:
        why.append("a custom attn_mask is not served by the Triton kernels (the vanilla backend serves it)")
    problem = _Problem(cache, scale, **attrs)
    why += prefill_attention.unsupported(query, problem.k_rows.dtype)
    k, v, ks, vs = problem.write_views()
    why += kv_cache_write.unsupported(current_key, current_value, k, v, None, k_scale=ks, v_scale=vs)
    return why


def metadata_launch(num_tokens: int, cachestarts: torch.Tensor, *, max_kvlen: int, bs: int, cache_mode: int,
                    page_size: int, max_rows: int):
    """`metadata(seqstarts, kvstarts, cachestarts, start_pos) -> (slots [T] int64, seq_lens [B] int32,
    block_tables [B, cdiv(max_kvlen, bs)] int64)` on the device, one launch, for a cache of
    `max_rows` rows (rows and blocks outside it: -1); `metadata.outputs()` allocates the three."""
    num_seqs = cachestarts.shape[0]
    device = cachestarts.device
    num_blocks = max(1, -(-max_kvlen // bs))
    paged = cache_mode == 1
    token_programs = -(-num_tokens // TOKENS_PER_PROGRAM)
    table_programs = -(-num_blocks // BLOCKS_PER_PROGRAM)
    flag = errors.device_flag(device)

    def outputs():
        return (torch.empty(num_tokens, dtype=torch.int64, device=device),
                torch.empty(num_seqs, dtype=torch.int32, device=device),
                torch.empty((num_seqs, num_blocks), dtype=torch.int64, device=device))

    fill = TritonLaunch(_metadata_kernel, (token_programs + num_seqs * table_programs,), (
        num_tokens, num_seqs, cachestarts.shape[1] if paged else 0, max_rows, max_kvlen, num_blocks,
        token_programs, table_programs,
        cachestarts.stride(0), cachestarts.stride(1) if paged else 0, num_blocks,
    ), dict(PAGE_SIZE=page_size if paged else 0, BS=bs, SEARCH_STEPS=max(1, num_seqs.bit_length()),
            BLOCK_T=TOKENS_PER_PROGRAM, BLOCK_J=BLOCKS_PER_PROGRAM))

    def metadata(seqstarts, kvstarts, cachestarts, start_pos):
        slots, seq_lens, tables = outputs()
        if token_programs + num_seqs:
            fill(seqstarts, kvstarts, cachestarts, start_pos, slots, seq_lens, tables, flag)
        return slots, seq_lens, tables

    metadata.outputs = outputs
    return metadata


def run(*args, **kwargs) -> torch.Tensor:
    """Write current k/v into `cache` (and `scale`), then attend; returns `out [T, Hq, Dh]`."""
    return prepare(*args, **kwargs)(*args, **kwargs)


def prepare(query, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, decoding_batches,
            max_seqlen, max_kvlen, cache, scale=None, attn_mask=None, *, num_heads, head_dim, is_causal, is_alibi,
            num_kv_heads, num_layer, layer_idx, quant_bit, quant_group, cache_mode, cache_layout, page_size):
    """`launch(*args, **kwargs)` for calls of this signature (only the metadata is read). `max_kvlen`
    may stand for any upper bound of the calls' (the front plans with its power-of-two bucket):
    the block tables are that wide, and key counts are clamped to it."""
    t, num_seqs = query.shape[0], start_pos.shape[0]
    device = query.device
    if t == 0:
        return lambda query, *args, **kwargs: torch.empty_like(query)
    problem = _Problem(cache, scale, layer_idx=layer_idx, cache_layout=cache_layout, quant_bit=quant_bit)
    max_rows = problem.k_rows.shape[0]
    bs = _block_size(max_rows, cache_mode, page_size)
    metadata = metadata_launch(t, cachestarts, max_kvlen=max_kvlen, bs=bs, cache_mode=cache_mode,
                               page_size=page_size, max_rows=max_rows)
    slots_like, seq_lens_like, tables_like = metadata.outputs()
    slopes = _alibi_slopes(num_heads, device) if is_alibi else None

    k, v, ks, vs = problem.write_views()
    write = kv_cache_write.prepare(current_key, current_value, k, v, slots_like, k_scale=ks, v_scale=vs)
    k, v, ks, vs = problem.read_views(bs)
    out_like = torch.empty_like(query)
    lse_like = torch.empty((t, num_heads), dtype=torch.float32, device=device)
    # block id r: rows r .. r + bs - 1, of which the metadata lets the kernels read only the rows of keys
    # inside the cache (-1: an absent block, already flagged)
    options = dict(k_scale=ks, v_scale=vs, num_blocks=max_rows, block_error=0, alibi_slopes=slopes)
    uniform = t == num_seqs * max_seqlen and (max_seqlen == 1 or (is_causal and max_seqlen <= 8))
    decode = uniform and not paged_decode.unsupported(query, k, v, tables_like, seq_lens_like, k_scale=ks, v_scale=vs)
    if decode:
        attend = paged_decode.prepare(query, k, v, tables_like, seq_lens_like, out=out_like, lse=lse_like, **options)
    else:
        attend = paged_prefill.prepare(query, k, v, tables_like, seqstarts, seq_lens_like, out=out_like, lse=lse_like,
                                       causal=is_causal, **options)

    def launch(query, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, decoding_batches,
               max_seqlen, max_kvlen, cache, scale=None, attn_mask=None, **_):
        out = torch.empty_like(query)
        call = _Problem(cache, scale, layer_idx=layer_idx, cache_layout=cache_layout, quant_bit=quant_bit)
        slots, seq_lens, tables = metadata(seqstarts, kvstarts, cachestarts, start_pos)
        k, v, ks, vs = call.write_views()
        write(current_key, current_value, k, v, slots, k_scale=ks, v_scale=vs)
        k, v, ks, vs = call.read_views(bs)
        lse = torch.empty((t, num_heads), dtype=torch.float32, device=device)
        if decode:
            attend(query, k, v, tables, seq_lens, out=out, lse=lse, k_scale=ks, v_scale=vs, alibi_slopes=slopes)
        else:
            attend(query, k, v, tables, seqstarts, seq_lens, out=out, lse=lse, k_scale=ks, v_scale=vs,
                   alibi_slopes=slopes)
        return out

    launch.describe = f"Triton cache_attention: metadata + kv_cache_write + {getattr(attend, 'describe', '')}"
    return launch
