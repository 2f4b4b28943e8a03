"""The `cutlass` backend: `attn::context_attention` and `attn::paged_prefill` on Hopper through
csrc/fmha_sm90.cu: which kernel serves a call, and its launch through the C ABI of csrc/fmha_sm90.h.
The library's build, its cache and the ABI mirror are in `fmha_sm90_build`, beside it.

`PERSISTENT` picks the grid: True runs the persistent kernels (one CTA per SM, each looping over
work tiles), False the plain ones (one CTA per work tile), None (the default) reads
`ATTN_CUTLASS_PERSISTENT` (0, 1, or unset / `auto`). Automatic: the persistent grid for short
sequences where it measured faster (`PERSISTENT_SHORT`), the plain one elsewhere; paged_prefill
runs it for the D = 64 cluster kernels on chunks of 512+ queries (`paged_runs_persistent`), the
plain one elsewhere (slower on most batches). The default build holds those persistent objects
only; forcing the persistent grid builds all of them, the paged ones too (their own JIT cache
folder; `ATTN_CUTLASS_PERSISTENT=1` at install for the prebuilt library).
"""

from __future__ import annotations

import math

import torch

from ... import errors, gpu
from .fmha_sm90_build import (CLUSTER_VARIANTS, KERNELS, NOT_BUILT, OUT_DTYPES, PAGED16_HEAD_DIM, PAGED_KERNELS,
                            PAGED_PERSISTENT_FAMILY, PAGED_PERSISTENT_KERNELS, PAGED_PERSISTENT_MIN_QUERIES,
                            PERSISTENT_SHORT, V_TOKENS, V_TRANSPOSED, V_TRANSPOSED_INTERLEAVED, FmhaArgs,
                            build_unavailable, entry, library_built, persistent_mode)
from ...replay import c_call

BLOCK_M = 128            # query rows per work tile (TileShape's M in csrc/fmha_sm90_config.cuh)
L2_SECTION_BYTES = 32 << 20   # K/V bytes the heads of one section of the work order may share in L2
# plain/paged grids run in sections only when causal and at most this many waves of 128-row tiles
SECTION_MAX_WAVES = 16

PERSISTENT: bool | None = None   # the persistent kernels or not; None: ATTN_CUTLASS_PERSISTENT

PAGED_MIN_BOX_ROWS = 8    # block_size must be a multiple of this (TMA boxes of whole swizzled rows)
PAGED_KEY_TILE = 128      # keys per tile of the paged kernels (TileShape's N in csrc/fmha_sm90_config.cuh)
# automatic choice (H200 and H100, docs/cutlass.md): paged_prefill goes to Triton for sequences of fewer
# queries (the Triton kernel packs a group's query heads into its tile rows; ours pads them to 128-row
# tiles), and for caches whose blocks take TMA boxes of fewer bytes per CTA (8 tokens at D = 64: 0.87x as
# fast as Triton; 8 at D = 128: 1.23-1.26x faster; a cluster kernel's box serves two CTAs: 8 tokens at
# D = 64 1.13x faster than Triton)
PAGED_MIN_QUERIES = 64
PAGED_AUTO_MIN_BOX_BYTES = 2048
# the cluster kernels against the others, H200: boxes of
# 8 tokens 1.12-1.26x, 16 1.08-1.14x, 32 1.03x; 64 and 128 0.96-1.01x (0.96-0.98x on the shortest case)
PAGED_CLUSTER_MAX_BOX_ROWS = 32
UNSUPPORTED_OPTIONS = {  # option -> (value meaning "off", what the kernel lacks)
    "alibi_slopes": (None, "ALiBi"), "window_left": (-1, "sliding windows"), "sink_tokens": (0, "sink tokens"),
    "sinks": (None, "learned sinks"), "softcap": (0.0, "soft-capping"), "positions": (None, "fused RoPE"),
    "key_mask": (None, "a per-key mask"),
}


# ---- the persistent grid -------------------------------------------------------------------------


def runs_persistent(dtype: torch.dtype, head_dim: int, causal: bool, total_q: int, num_seqs: int) -> bool:
    """Whether context attention runs the persistent grid: as forced (`persistent_mode`), else where
    `PERSISTENT_SHORT` has the kernel and the mean query length `total_q / num_seqs` is at most its
    limit. From shapes only (CUDA-graph safe)."""
    mode = persistent_mode()
    if mode is not None:
        return mode
    limits = PERSISTENT_SHORT.get((dtype, head_dim))
    return limits is not None and total_q <= limits[int(causal)] * num_seqs


def paged_runs_persistent(family: str, dtype: torch.dtype, head_dim: int, total_q: int, num_seqs: int) -> bool:
    """Whether paged_prefill on kernel family `family` runs the persistent grid: as forced
    (`persistent_mode`), else for `PAGED_PERSISTENT_FAMILY` at `PAGED_PERSISTENT_KERNELS` when the mean query
    length is at least `PAGED_PERSISTENT_MIN_QUERIES`. From shapes only (CUDA-graph safe)."""
    mode = persistent_mode()
    if mode is not None:
        return mode
    return (family == PAGED_PERSISTENT_FAMILY and (dtype, head_dim) in PAGED_PERSISTENT_KERNELS
            and total_q >= PAGED_PERSISTENT_MIN_QUERIES * num_seqs)


def section_heads(hq: int, hkv: int, keys: int, head_dim: int, element_size: int) -> int:
    """Query heads per section of the kernels' work order, from shapes only (CUDA-graph safe).

    Work runs section by section, each q tile over the section's heads together (heaviest causal
    tiles first across those heads). A section is the largest divisor of `hq` whose KV heads, K
    and V of `keys` keys each, fit `L2_SECTION_BYTES`; at least one head."""
    kv_head_bytes = 2 * keys * head_dim * element_size
    group = hq // hkv
    fits = [s for s in range(1, hq + 1) if hq % s == 0 and -(-s // group) * kv_head_bytes <= L2_SECTION_BYTES]
    return max(fits, default=1)


def sectioned(causal: bool, total_q: int, hq: int, num_sms: int) -> bool:
    """Whether a plain or paged launch runs its work in sections of heads rather than head by head.

    H200, one process, one library: sections
    put the heaviest causal tiles of all heads first, which shortens the tail of a grid of few
    waves (paged 2k prefill 114 -> 95 us, the first mixed benchmark batch 448 -> 413 us, 8k
    prefill 1.03x); head by head keeps one head's K/V hot in L2 for many CTAs, which non-causal
    grids need (bf16 S = 2k 0.90x, FP8 and bf16 8k 0.97x, D = 256 0.96x in sections) and which
    causal grids of 31 waves prefer too (bf16 S = 512 0.93x). So: causal, and at most
    `SECTION_MAX_WAVES` waves of 128-row tiles (`floor(total_q / 128) * hq` CTAs)."""
    return causal and (total_q // BLOCK_M) * hq <= SECTION_MAX_WAVES * num_sms


def persistent_ctas(total_q: int, num_seqs: int, hq: int, num_sms: int) -> int:
    """CTAs of the persistent grid: one per SM (a CTA's shared memory fills most of an SM), no more
    than there are work tiles (`(total_q // BLOCK_M + min(num_seqs, total_q)) * hq`)."""
    return min((total_q // BLOCK_M + min(num_seqs, total_q)) * hq, num_sms)


# ---- the backend ---------------------------------------------------------------------------------


def unsupported(query, key, value, cu_seqlens_q, cu_seqlens_k, *, out_dtype=None, out_scale=None, **options) -> list[str]:
    """Why the CUTLASS kernels cannot run this `context_attention` call (empty: they can)."""
    if query.device.type != "cuda":
        return [f"CUTLASS kernels need CUDA tensors, got {query.device.type}"]
    return problem_reasons(query, key, value, out_dtype=out_dtype, out_scale=out_scale, **options) + \
        _device_reasons(query)


def paged_unsupported(query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, *, out_scale=None,
                      k_scale=None, v_scale=None, **options) -> list[str]:
    """Why the CUTLASS kernels cannot run this `paged_prefill` call (empty: they can)."""
    if query.device.type != "cuda":
        return [f"CUTLASS kernels need CUDA tensors, got {query.device.type}"]
    return paged_problem_reasons(query, k_cache, v_cache, block_tables, out_scale=out_scale, **options) + \
        _device_reasons(query)


def _device_reasons(query) -> list[str]:
    why = []
    cap = gpu.capability(query.device)
    if cap != (9, 0):
        why.append(f"CUTLASS kernels are built for Hopper (sm_90a), this GPU is sm_{cap[0]}{cap[1]}")
    reason = build_unavailable()
    if reason:
        why.append(reason)
    return why


def problem_reasons(query, key, value=None, *, out_dtype=None, out_scale=None, **options) -> list[str]:
    """The device-independent part of `unsupported`: dtypes, head dims, options, sizes."""
    why = _kernel_reasons(KERNELS, "", query, out_dtype, out_scale, options)
    if value is not None and value.shape[-1] != query.shape[-1]:
        why.append(f"value head dim {value.shape[-1]} != query head dim {query.shape[-1]} (the CUTLASS kernels "
                   "need D_v = D)")
    if key.shape[0] == 0:
        why.append("key is empty (total_k == 0)")
    if max(query.numel(), key.numel()) >= 2**31:
        why.append("tensors of 2^31 or more elements (32-bit TMA strides)")
    return why


def paged_problem_reasons(query, k_cache, v_cache, block_tables, *, out_scale=None, **options) -> list[str]:
    """The device-independent part of `paged_unsupported`: dtypes, head dim, cache layout, options."""
    why = _kernel_reasons(PAGED_KERNELS, "paged ", query, None, out_scale, options)
    if v_cache.shape[-1] != k_cache.shape[-1]:
        why.append(f"v_cache head dim {v_cache.shape[-1]} != k_cache head dim {k_cache.shape[-1]} (the paged CUTLASS "
                   "kernels need D_v = D)")
    if k_cache.dtype != query.dtype:
        why.append(f"the paged CUTLASS kernels read {query.dtype} caches, not {k_cache.dtype} "
                   "(FP8/INT8/INT4 caches run on Triton)")
    num_blocks, block_size = k_cache.shape[:2]
    if block_size % PAGED_MIN_BOX_ROWS:
        why.append(f"block_size {block_size} is not a multiple of {PAGED_MIN_BOX_ROWS} (TMA boxes of whole "
                   "swizzled rows)")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        es, strides = cache.element_size(), cache.stride()
        if cache.data_ptr() % 16 or any(st * es % 16 for st in strides[:3]) or strides[3] != 1:
            why.append(f"{name} needs a 16-byte aligned base and block/token/head strides (TMA)")
        elif not strides[2] <= strides[1] <= strides[0]:
            why.append(f"{name} strides {strides} are not ordered head <= token <= block")
    if num_blocks == 0 or block_tables.shape[1] == 0:
        why.append("no cache blocks (num_blocks or max_blocks_per_seq is 0)")
    if max(query.numel(), num_blocks, block_tables.numel()) >= 2**31:
        why.append("tensors of 2^31 or more elements (32-bit TMA coordinates and strides)")
    return why


def _kernel_reasons(kernels: dict, family: str, query, out_dtype, out_scale, options) -> list[str]:
    why = []
    d = query.shape[-1]
    if (query.dtype, d) not in kernels:
        have = [f"{str(t).removeprefix('torch.')} d{hd}" for t, hd in sorted(kernels, key=lambda k: (str(k[0]), k[1]))]
        why.append(f"no {family}CUTLASS kernel for {query.dtype} with head dim {d} (have {', '.join(have)})")
    out = torch.float8_e4m3fn if out_scale is not None else out_dtype
    if out is not None and out not in OUT_DTYPES:
        why.append(f"CUTLASS epilogue writes bf16, fp16 or float8_e4m3fn, not {out}")
    for name, (off, what) in UNSUPPORTED_OPTIONS.items():
        value = options.get(name, off)
        if value is not off and (off is None or value != off):
            why.append(f"CUTLASS kernels do not implement {what} ({name})")
    return why


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """`t` if TMA can read it (16-byte aligned base and row/head strides), else a contiguous copy."""
    es = t.element_size()
    if t.data_ptr() % 16 or any(s * es % 16 for s in t.stride()[:-1]) or t.stride(-1) != 1:
        return t.contiguous()
    return t


def value_layout(dtype: torch.dtype, head_dim: int, variant: str) -> int:
    """How the kernel reads V (`AttnValueLayout` in csrc/fmha_sm90.h): token-major, except FP8 outside
    the persistent D = 128 kernels (which transpose V tiles in shared memory), where the FP8 wgmma
    wants V transposed, at D = 128 with the tokens of every 16 interleaved."""
    if dtype != torch.float8_e4m3fn or (head_dim == 128 and variant == "persistent"):
        return V_TOKENS
    return V_TRANSPOSED_INTERLEAVED if head_dim == 128 else V_TRANSPOSED


def value_operand(value: torch.Tensor, layout: int) -> tuple[torch.Tensor, dict]:
    """V in `layout`, with its `FmhaArgs` fields. The transposed layouts take one pass of
    `kernels.triton.transpose` over V (36 µs for 16k tokens x 32 heads x 128 on an H200) into a buffer of
    V's size (tokens padded to 16)."""
    if layout == V_TOKENS:
        v = _tma_ready(value)
        return v, dict(v_row_stride=v.stride(0), v_head_stride=v.stride(1), v_dim_stride=0, v_layout=layout)
    from ..triton import transpose
    tk, hkv, d = value.shape
    padded = -(-tk // 16) * 16   # whole interleaved groups; 16-byte TMA strides
    interleaved = layout == V_TRANSPOSED_INTERLEAVED
    v = transpose.tokens_last(value, value.new_empty(hkv, d, padded)[..., :padded if interleaved else tk],
                              interleave16=interleaved)
    return v, dict(v_row_stride=0, v_head_stride=v.stride(0), v_dim_stride=v.stride(1), v_layout=layout)


def run(*args, **kwargs) -> None:
    """Fill `out [Tq, Hq, D]` and `lse [Tq, Hq]` (V as `value_layout` says)."""
    prepare(*args, **kwargs)(*args, **kwargs)


def prepare(query, key, value, cu_seqlens_q, cu_seqlens_k, *, out, lse, causal=False, scale=None, q_scaling=1.0,
            out_scale=None, q_scale=None, k_scale=None, v_scale=None, **unused):
    """`launch(*args, **kwargs)` for `context_attention` calls of this signature."""
    tq, hq, d = query.shape
    tk, hkv, _ = key.shape
    if tq == 0:
        return _nothing
    num_seqs = cu_seqlens_q.shape[0] - 1
    variant = "persistent" if runs_persistent(query.dtype, d, causal, tq, num_seqs) else "plain"
    layout = value_layout(query.dtype, d, variant)
    q, k = _tma_ready(query), _tma_ready(key)
    copy_q, copy_k = q is not query, k is not key
    v_fields = value_operand(value, layout)[1]
    sms = gpu.sm_count(query.device)
    num_ctas = persistent_ctas(tq, num_seqs, hq, sms) if variant == "persistent" else 0
    section = 1
    if variant == "persistent" or sectioned(causal, tq, hq, sms):
        section = section_heads(hq, hkv, -(-tk // num_seqs), d, query.element_size())   # at the mean key length
    kernel = _kernel("context_attention", variant, q, out, lse, causal, scale, q_scaling, num_seqs, dict(
        k_row_stride=k.stride(0), k_head_stride=k.stride(1), **v_fields, total_k=tk, hkv=hkv,
        q_scale_stride=_scale_stride(q_scale), k_scale_stride=_scale_stride(k_scale),
        v_scale_stride=_scale_stride(v_scale), num_ctas=num_ctas, section_heads=section))

    def launch(query, key, value, cu_seqlens_q, cu_seqlens_k, *, out, lse, out_scale=None, q_scale=None,
               k_scale=None, v_scale=None, **_):
        q = query.contiguous() if copy_q else query
        k = key.contiguous() if copy_k else key
        v = value_operand(value, layout)[0]
        q_scale, k_scale, v_scale = _contiguous(q_scale), _contiguous(k_scale), _contiguous(v_scale)
        cu_q, cu_k = _int32(cu_seqlens_q), _int32(cu_seqlens_k)
        kernel(out, lse, q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), cu_seqlens_q=cu_q.data_ptr(),
               cu_seqlens_k=cu_k.data_ptr(), q_scale=_address(q_scale), k_scale=_address(k_scale),
               v_scale=_address(v_scale), out_scale=_address(out_scale))

    launch.describe = kernel.describe
    return launch


def _nothing(*args, **kwargs) -> None:
    """The launch of an empty call."""


def _scale_stride(s: torch.Tensor | None) -> int:
    return 1 if s is not None and s.dim() == 1 else 0


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.contiguous() if t is not None else None


def _address(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()


def paged_kernel(k_cache: torch.Tensor, v_cache: torch.Tensor, group: int) -> tuple[str, int]:
    """(kernel family, tokens per TMA box) for these caches and `group` query heads per KV head. A box
    spans the whole head dim and the largest power of two of tokens, up to the key tile, that divides
    block_size. At D = 128, boxes of 16 tokens go to the paged16 kernels (1.00-1.06x as fast as the
    paged ones there), larger boxes to the paged kernels where TMA sees each cache as one line of
    tokens (its blocks start a multiple of 8 tokens apart, the same in K and V: block_size for caches
    of their own, 2 x block_size for the K and V halves of one [num_blocks, 2, block_size, Hkv, D]
    tensor), else boxes of 16 to paged16 (csrc/fmha_sm90_paged.cuh, encode_pages). With an even group
    and boxes of at most `PAGED_CLUSTER_MAX_BOX_ROWS` tokens, the family's cluster kernels
    (`CLUSTER_VARIANTS`: two CTAs, two query heads of one KV head, share every box)."""
    block_size, d = k_cache.shape[1], k_cache.shape[-1]
    rows = math.gcd(block_size & -block_size, PAGED_KEY_TILE)
    variant = "paged"
    if d == PAGED16_HEAD_DIM and rows > PAGED_MIN_BOX_ROWS:
        (k_block, k_row), (v_block, v_row) = k_cache.stride()[:2], v_cache.stride()[:2]
        line = k_block // k_row if k_row > 0 and k_block % k_row == 0 else 0
        if rows == 16 or line % 8 or line < block_size or v_block != line * v_row:
            variant, rows = "paged16", 16
    return variant + "x2" if group % 2 == 0 and rows <= PAGED_CLUSTER_MAX_BOX_ROWS else variant, rows


def paged_run(*args, **kwargs) -> None:
    """Fill `out [Tq, Hq, D]` and `lse [Tq, Hq]` from the paged cache (see `paged_prepare`)."""
    paged_prepare(*args, **kwargs)(*args, **kwargs)


def paged_prepare(query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, *, out, lse, causal=True,
                  scale=None, q_scaling=1.0, out_scale=None, skip_q_len=0, **unused):
    """`launch(*args, **kwargs)` for `paged_prefill` calls of this signature: it fills `out` and
    `lse` except the rows of sequences of at most `skip_q_len` queries (left for another kernel; if
    `out` must go through a buffer, those rows get garbage and the other kernel must run after this
    one). The kernel reads the cache in TMA boxes of tokens x the whole head dim (`paged_kernel`);
    int64 block tables and lengths are first copied to int32 (a few KB)."""
    tq, hq, d = query.shape
    if tq == 0:
        return _nothing
    num_blocks, block_size, hkv, _ = k_cache.shape
    family, box_rows = paged_kernel(k_cache, v_cache, hq // hkv)
    sms = gpu.sm_count(query.device)
    persistent = paged_runs_persistent(family, query.dtype, d, tq, cu_seqlens_q.shape[0] - 1)
    variant = f"{family}_persistent" if persistent else family
    num_ctas = persistent_ctas(tq, cu_seqlens_q.shape[0] - 1, hq, sms) if persistent else 0
    section = 1
    if persistent or sectioned(causal, tq, hq, sms):   # at the table's capacity: lengths are on the device
        section = section_heads(hq, hkv, block_tables.shape[1] * block_size, d, k_cache.element_size())
    if family in CLUSTER_VARIANTS and section % 2:
        section *= 2   # a cluster's CTAs run query heads 2i and 2i + 1 of one section
    q = _tma_ready(query)
    copy_q = q is not query
    tables = _int32_rows(block_tables)
    kernel = _kernel("paged_prefill", variant, q, out, lse, causal, scale, q_scaling, cu_seqlens_q.shape[0] - 1, dict(
        k_row_stride=k_cache.stride(1), k_head_stride=k_cache.stride(2),
        v_row_stride=v_cache.stride(1), v_head_stride=v_cache.stride(2), hkv=hkv,
        block_table_stride=tables.stride(0),
        k_block_stride=k_cache.stride(0), v_block_stride=v_cache.stride(0), max_blocks=tables.shape[1],
        block_size=block_size, num_blocks=num_blocks, box_rows=box_rows,
        skip_q_len=skip_q_len, section_heads=section, num_ctas=num_ctas,
        err_block_tables=errors.BLOCK_TABLES, err_seq_lens=errors.SEQ_LENS))
    flag = errors.device_flag(query.device)

    def launch(query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, *, out, lse, out_scale=None, **_):
        q = query.contiguous() if copy_q else query
        tables, lens, cu_q = _int32_rows(block_tables), _int32(seq_lens), _int32(cu_seqlens_q)
        kernel(out, lse, q=q.data_ptr(), k=k_cache.data_ptr(), v=v_cache.data_ptr(), cu_seqlens_q=cu_q.data_ptr(),
               block_tables=tables.data_ptr(), seq_lens=lens.data_ptr(), out_scale=_address(out_scale),
               err_flag=flag.data_ptr())

    launch.describe = kernel.describe
    return launch


def _int32_rows(tables: torch.Tensor) -> torch.Tensor:
    tables = tables.to(torch.int32)
    return tables if tables.stride(-1) == 1 else tables.contiguous()


def _kernel(op: str, variant: str, q, out, lse, causal, scale, q_scaling, num_seqs: int, fields: dict):
    """The kernel of `variant` for q's dtype and head dim, with the `FmhaArgs` fields that a call's
    signature fixes (`fields`, and those of q, out and lse); `kernel(out, lse, **addresses)` runs a
    call, given its tensors' addresses (through contiguous out/lse buffers if the given ones have
    strided last dims, or an out whose base or strides are not 16-byte multiples: the epilogue
    writes 16-byte chunks)."""
    tq, hq, d = q.shape
    es = out.element_size()
    aligned = out.data_ptr() % 16 == 0 and all(st * es % 16 == 0 for st in out.stride()[:2])
    direct = aligned and out.stride(-1) == 1 and lse.stride(-1) == 1
    o, l = (out, lse) if direct else _contiguous_outputs(out, lse)
    template = FmhaArgs(
        q_row_stride=q.stride(0), q_head_stride=q.stride(1), out_row_stride=o.stride(0), out_head_stride=o.stride(1),
        lse_row_stride=l.stride(0), total_q=tq, num_seqs=num_seqs, hq=hq, head_dim=d, causal=int(causal),
        out_dtype=OUT_DTYPES[o.dtype], softmax_scale=(scale if scale is not None else 1.0 / math.sqrt(d)) / q_scaling,
        **fields)
    c_entry = entry(KERNELS[(q.dtype, d)], d, variant)
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()

    def kernel(out, lse, **addresses):
        o, l = (out, lse) if direct else _contiguous_outputs(out, lse)
        args = FmhaArgs.from_buffer_copy(template)
        for name, address in addresses.items():
            setattr(args, name, address)
        args.out, args.lse = o.data_ptr(), l.data_ptr()
        c_call(c_entry, args, index, f"CUTLASS {op}")
        if not direct:
            out.copy_(o)
            lse.copy_(l)

    ctas = fields.get("num_ctas")
    kernel.describe = f"CUTLASS {KERNELS[(q.dtype, d)]} D {d}, the {variant} kernel" + (f" on {ctas} CTAs" if ctas else "")
    return kernel


def _contiguous_outputs(out, lse):
    return (torch.empty_like(out, memory_format=torch.contiguous_format),
            torch.empty_like(lse, memory_format=torch.contiguous_format))


class CutlassBackend:
    """`attn::context_attention` (FP8 e4m3 / bf16 / fp16, D 64-256) and `attn::paged_prefill`
    (bf16 / fp16 caches, D 64 and 128) through csrc/fmha_sm90.cu."""

    name = "cutlass"
    auto_devices = ("cuda",)
    _OPS = {"context_attention": (unsupported, run), "paged_prefill": (paged_unsupported, paged_run)}

    def reasons(self, op, args, kwargs):
        if op not in self._OPS:
            return [f"no CUTLASS kernel for attn::{op}"]
        options = {k: v for k, v in kwargs.items() if k not in ("out", "lse")}
        return self._OPS[op][0](*args, **options)

    def auto_declines(self, op, args, kwargs):
        if not library_built():
            return [NOT_BUILT]
        if op != "paged_prefill":
            return []
        query, seq_lens = args[0], args[5]
        why = _small_boxes(*args[:3])
        if query.shape[0] < PAGED_MIN_QUERIES * seq_lens.shape[0]:
            why.append(f"fewer than {PAGED_MIN_QUERIES} queries per sequence on average: the Triton kernel's "
                       "packed heads waste less (measured)")
        return why

    def run(self, op, args, kwargs):
        self._OPS[op][1](*args, **kwargs)

    def prepare(self, op, args, kwargs):
        return (prepare if op == "context_attention" else paged_prepare)(*args, **kwargs)


def _small_boxes(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> list[str]:
    """Why the automatic choice leaves these caches to Triton: a CTA's TMA boxes too small (a box of
    a cluster kernel serves two CTAs, which counts as twice its bytes)."""
    variant, rows = paged_kernel(k_cache, v_cache, query.shape[1] // k_cache.shape[2])
    box_bytes = rows * k_cache.shape[-1] * k_cache.element_size()
    if box_bytes * (2 if variant in CLUSTER_VARIANTS else 1) < PAGED_AUTO_MIN_BOX_BYTES:
        return [f"TMA boxes of {rows} tokens (block_size {k_cache.shape[1]}) x {k_cache.shape[-1]} dims, {box_bytes} "
                f"bytes for one CTA, make the CUTLASS kernel slower than the Triton one (measured)"]
    return []


class MixedBatchBackend:
    """`attn::paged_prefill` over a batch of several sequences, long and short in any order (chunked
    prefill with decodes): the CUTLASS paged kernel serves the sequences of more than
    `PAGED_MIN_QUERIES` queries, the Triton kernel the others. Each kernel skips the other's
    sequences on the device: no host sync, and both grids come from shapes (CUDA-graph safe)."""

    name = "mixed"
    auto_devices = ("cuda",)

    def __init__(self):
        from ..triton import TritonBackend
        self._parts = (CutlassBackend(), TritonBackend())

    def reasons(self, op, args, kwargs):
        if op != "paged_prefill":
            return [f"the mixed backend serves attn::paged_prefill only, not attn::{op}"]
        return [why for backend in self._parts for why in backend.reasons(op, args, kwargs)]

    def auto_declines(self, op, args, kwargs):
        if not library_built():
            return [NOT_BUILT]
        query, cu_seqlens_q = args[0], args[4]
        why = _small_boxes(*args[:3])
        if cu_seqlens_q.shape[0] <= 2:
            why.append("one sequence: one kernel serves it")
        if query.shape[0] <= PAGED_MIN_QUERIES:
            why.append(f"no sequence can have more than {PAGED_MIN_QUERIES} queries: Triton serves them all")
        return why

    def run(self, op, args, kwargs):
        self.prepare(op, args, kwargs)(*args, **kwargs)

    def prepare(self, op, args, kwargs):
        from ..triton import paged_prefill
        # CUTLASS first: it may write garbage to the other sequences' rows
        launches = (paged_prepare(*args, **kwargs, skip_q_len=PAGED_MIN_QUERIES),
                    paged_prefill.prepare(*args, **kwargs, max_queries=PAGED_MIN_QUERIES))

        def launch(*args, **kwargs):
            for part in launches:
                part(*args, **kwargs)

        launch.describe = " for the long sequences, then ".join(getattr(part, "describe", "") for part in launches)
        return launch
