"""The `cuda` backend: `attn::paged_decode` of small problems through csrc/decode_sm90.cu.

One launch per call: the keys of a (sequence, KV head) are split over the CTAs of a thread-block
cluster (`cluster_size`) and over each CTA's 8 warps; the partial softmax states meet in shared
memory, then in distributed shared memory (the kernel's header says how). No split-K workspace
and no merge kernel: at small batch those, and the Triton kernel's long per-tile instruction
chain, are most of the Triton kernel's time.

Serves bf16/fp16 caches of the query's dtype, FP8 (e4m3/e5m2, per-tensor or per-head scales) and
group-quantized INT8/INT4 caches with 1 to 4 scale groups per head (`quant_group >= D / 4`), head
dims 64 and 128, block sizes that are multiples of 16, up to 16 query rows per KV head
(`q_per_seq x Hq / Hkv`), and the plain options (`scale`, `q_scaling`). INT8/INT4 caches on
grids of more than one wave run a build for two CTAs per SM (`ctas_per_sm`). The automatic choice
takes it where it measured faster than the Triton kernel (`auto_declines`).

The library comes from `torch_ops/_decode_sm90.so` (installed with `ATTN_BUILD_CUDA=1`), else a
just-in-time build on first use (one translation unit without CUTLASS headers, about 35 s on 16
cores), cached under `ATTN_CACHE_DIR` in a folder named by `csrc_build.source_key` (the sources with the
headers they include, nvcc's version, the flags); `ATTN_DECODE_LIBRARY` points at a library built elsewhere.
`ATTN_DECODE_PDL=1` launches it with programmatic dependent launch (`PDL`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import tempfile
from pathlib import Path
from typing import Callable

import torch

from ... import errors, gpu, quant
from ...csrc_build import ARCH, CSRC, CsrcLibrary, find_nvcc, run_tool, source_key
from ...replay import c_call

log = logging.getLogger(__name__)

SOURCES = ("decode_sm90.cu", "decode_sm90.h")
PREBUILT = Path(__file__).resolve().parents[2] / "_decode_sm90.so"   # in torch_ops/, where setup.py builds it
LIBRARY_NAME = "libattn_decode_sm90.so"
HEAD_DIMS = (64, 128)
MAX_ROWS = 16            # query rows per KV head: two 8-column MMA tiles
TILE_ROWS = 8            # query rows of one MMA column tile (NQ = 1 in the kernel)
BLOCK_MULTIPLE = 16      # block_size must be a multiple of the kernel's key tile
WARPS = 8                # per CTA (ATTN_DECODE_WARPS in the kernel)
MAX_CLUSTER = 16         # CTAs per cluster (16 is the non-portable maximum on Hopper)
MIN_WARP_KEYS = 16       # the cluster size leaves each warp at least one 16-key tile of the table
# automatic choice: tables of up to SHORT_KEYS keys, or up to MID_KEYS keys when the grid fills
# FULL_GRID of the SMs, or up to LONG_KEYS keys in clusters of LONG_CLUSTERS CTAs (see auto_declines)
SHORT_KEYS, MID_KEYS, LONG_KEYS = 1024, 4096, 32768
FULL_GRID = 0.75
LONG_CLUSTERS = (4, 8)   # bf16/fp16 at D = 128 only
QUANT_MID_CLUSTERS = 2   # FP8/INT8/INT4: the <= MID_KEYS clause with clusters of at most 2
GROUPED_GRID = 0.45      # INT8/INT4 caches: from MID_KEYS keys, grids of >= 0.45 x SMs (sequence, KV head) pairs
GROUPED_SHORT_KEYS = 256  # ... and from this many keys on grids of up to 2 x SMs pairs (D = 128)
TWO_CTA_HEAD_DIMS = (128,)   # INT8/INT4 at <= TILE_ROWS rows: the build for two CTAs per SM on multi-wave grids
DTYPES = {torch.bfloat16: 0, torch.float16: 1}   # AttnDecodeDtype
MAX_SCALE_GROUPS = 4     # INT8/INT4: one scale per thread's slice of a key row (quant_group >= D / 4)
# programmatic dependent launch (ATTN_DECODE_PDL=1): each call's grid is scheduled while the previous
# kernel on the stream finishes, and waits for it before touching memory. Off by default: on an H200
# it gains 0.1-0.8 us only after kernels that use it too, and loses 0.1-0.3 us after others
PDL = os.environ.get("ATTN_DECODE_PDL", "0") == "1"
PLAIN_OPTIONS = {  # option -> (value meaning "off", what the kernel lacks)
    "alibi_slopes": (None, "ALiBi"), "window_left": (-1, "sliding windows"), "sink_tokens": (0, "sink tokens"),
    "sinks": (None, "learned sinks"), "softcap": (0.0, "soft-capping"), "out_scale": (None, "FP8 output"),
    "key_mask": (None, "a per-key mask"),
}


# ---- build ---------------------------------------------------------------------------------------


def compile_command(nvcc: str, output: Path, defines: tuple[str, ...] = ()) -> list[str]:
    return [
        nvcc, "-std=c++17", "-O3", "-DNDEBUG", f"-gencode=arch=compute_{ARCH},code=sm_{ARCH}",
        "-shared", "-cudart=static", "-Xcompiler=-fPIC,-fvisibility=hidden", "-lineinfo", "-ftz=true",
        "-split-compile=0",   # the 64 kernels optimized in parallel on all cores
        *(f"-D{d}" for d in defines), f"-I{CSRC}", str(CSRC / "decode_sm90.cu"), "-o", str(output),
    ]


def build_key(nvcc: str) -> str:
    return source_key(SOURCES, CSRC, nvcc, " ".join(compile_command("nvcc", Path("o"))))


def build(output: Path, *, nvcc: str | None = None, defines: tuple[str, ...] = ()) -> Path:
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise RuntimeError("no nvcc found (set ATTN_NVCC or CUDA_HOME) to build the CUDA decode kernel")
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output.parent) as tmp:
        staged = Path(tmp) / LIBRARY_NAME
        cmd = compile_command(nvcc, staged, defines)
        result = run_tool(cmd)
        if result.returncode != 0:
            raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{result.stderr[-4000:]}")
        os.replace(staged, output)
    return output


LIBRARY = CsrcLibrary(
    "ATTN_DECODE_LIBRARY", PREBUILT, LIBRARY_NAME, "CUDA decode library", SOURCES[0],
    folder=lambda nvcc: f"decode_sm90-{build_key(nvcc)}",
    build=lambda target, nvcc: build(target, nvcc=nvcc),
    describe=lambda: f"the CUDA decode kernel (csrc/decode_sm90.cu, sm_{ARCH})")


@functools.cache
def library_path() -> Path:
    return LIBRARY.path(log)


def library_built() -> bool:
    """Whether the library loads without compiling: given, prebuilt, or built before (cached)."""
    return library_path.cache_info().currsize > 0 or LIBRARY.built()


NOT_BUILT = ("the CUDA decode library is not built yet, and the automatic choice builds nothing: "
             "torch_ops.warmup() builds it (about 35 s on 16 cores), or install with ATTN_BUILD_CUDA=1")


class DecodeArgs(ctypes.Structure):
    """Mirror of `AttnDecodeArgs` (csrc/decode_sm90.h), field by field."""

    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "out", "lse")),
        *((name, ctypes.c_int64) for name in (
            "q_token_stride", "q_head_stride", "k_block_stride", "k_token_stride", "k_head_stride",
            "v_block_stride", "v_token_stride", "v_head_stride", "block_table_stride",
            "out_token_stride", "out_head_stride", "lse_token_stride", "lse_head_stride")),
        *((name, ctypes.c_int32) for name in (
            "batch", "hq", "hkv", "head_dim", "q_per_seq", "block_size", "dtype", "cluster_size")),
        ("softmax_scale", ctypes.c_float),
        ("kv_format", ctypes.c_int32),
        ("k_scale", ctypes.c_void_p), ("v_scale", ctypes.c_void_p),
        *((name, ctypes.c_int64) for name in (
            "ks_block_stride", "ks_token_stride", "ks_head_stride", "vs_block_stride", "vs_token_stride", "vs_head_stride")),
        *((name, ctypes.c_int32) for name in ("scale_per_head", "scale_fp32", "quant_group", "pdl", "ctas_per_sm",
                                               "num_blocks", "max_blocks", "err_block_tables", "err_seq_lens")),
        ("err", ctypes.c_void_p),
    ]


@functools.lru_cache(maxsize=None)
def _library(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.attn_decode_sm90.argtypes = [ctypes.POINTER(DecodeArgs), ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    lib.attn_decode_sm90.restype = ctypes.c_int
    lib.attn_decode_sm90_max_clusters.argtypes = [ctypes.POINTER(DecodeArgs)]
    lib.attn_decode_sm90_max_clusters.restype = ctypes.c_int
    return lib


@functools.lru_cache(maxsize=None)
def resident_clusters(path: Path, device_index: int, dtype: torch.dtype, head_dim: int, size: int,
                      cache_dtype: torch.dtype | None = None, per_sm: int = 1) -> int:
    """Clusters of `size` CTAs of the build for `per_sm` CTAs per SM that fit on the device at once
    (the hardware's answer)."""
    args = DecodeArgs(head_dim=head_dim, dtype=DTYPES[dtype], cluster_size=size, hq=1, hkv=1, q_per_seq=1, batch=1,
                      kv_format=quant.abi_code(cache_dtype or dtype), ctas_per_sm=per_sm)
    with torch.cuda.device(device_index):
        n = _library(path).attn_decode_sm90_max_clusters(ctypes.byref(args))
    if n < 0:
        raise RuntimeError(f"cudaOccupancyMaxActiveClusters failed for clusters of {size}")
    return n


# ---- the problems it serves ------------------------------------------------------------------------


def cluster_size(batch: int, num_kv_heads: int, capacity: int, resident: Callable[[int], int]) -> int:
    """CTAs per (sequence, KV head), from shapes only (CUDA-graph safe): the largest power of two
    whose clusters, one per (sequence, KV head), are all resident at once (`resident(size)`: how
    many the device holds), leaving each warp at least `MIN_WARP_KEYS` of the table's `capacity`.
    H200, D = 128: a second wave of clusters doubles the time; sizes that are not powers of two
    (3, 6, 9) run 2-12% slower than the power of two below them."""
    units = batch * num_kv_heads
    size = 1
    while (size * 2 <= MAX_CLUSTER and capacity >= size * 2 * WARPS * MIN_WARP_KEYS
           and units <= resident(size * 2)):
        size *= 2
    return size


def query_rows(query, k_cache, seq_lens) -> int:
    """Query rows per KV head of a call (`q_per_seq x Hq / Hkv`), the kernel's MMA columns."""
    batch = seq_lens.shape[0]
    return (query.shape[0] // batch) * (query.shape[1] // k_cache.shape[2]) if batch else 0


def ctas_per_sm(cache_dtype: torch.dtype, head_dim: int, rows: int, units: int, single: int) -> int:
    """Which build runs a call: 1, or 2 CTAs per SM (INT8/INT4 caches, `TWO_CTA_HEAD_DIMS`, <= 8 query
    rows) when the grid's `units` (sequence, KV head) pairs outnumber the `single` CTAs of the
    one-CTA build that fit at once. H200, 32/8 heads: 1.03-1.11x on 3.9-15.5 waves at D = 128; 0.79-0.98x on one wave, 0.94-0.95x at D = 64."""
    two = cache_dtype in (torch.int8, torch.uint8) and head_dim in TWO_CTA_HEAD_DIMS and rows <= TILE_ROWS
    return 2 if two and units > single else 1


def _grid(query, k_cache, block_tables, seq_lens) -> tuple[int, int, int, int, int]:
    """(cluster size, CTAs per SM of the build, CTAs, resident single CTAs of the one-CTA build, SMs)
    of a call."""
    d, batch, hkv = query.shape[-1], seq_lens.shape[0], k_cache.shape[2]
    path = library_path()
    index = query.device.index if query.device.index is not None else torch.cuda.current_device()

    def resident(n: int, per_sm: int = 1) -> int:
        return resident_clusters(path, index, query.dtype, d, n, k_cache.dtype, per_sm)

    single = resident(1)
    per_sm = ctas_per_sm(k_cache.dtype, d, query_rows(query, k_cache, seq_lens), batch * hkv, single)
    capacity = max(1, block_tables.shape[1]) * k_cache.shape[1]
    size = cluster_size(batch, hkv, capacity, lambda n: resident(n, per_sm))
    return size, per_sm, size * batch * hkv, single, gpu.sm_count(index)


@functools.cache
def _build_unavailable() -> str | None:
    """Why the library can be neither loaded nor built here (None: it can)."""
    return LIBRARY.unavailable()


def _scale_reasons(k_cache, k_scale, v_scale, d: int) -> list[str]:
    """Why the kernel cannot read these dequantization scales (the front has checked their shapes)."""
    if k_scale is None or v_scale is None:
        return [f"a {k_cache.dtype} cache needs k_scale and v_scale"]
    if k_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return [f"{name} must have unit stride" for name, t in (("k_scale", k_scale), ("v_scale", v_scale))
                if t.dim() == 1 and t.shape[0] > 1 and t.stride(0) != 1]
    groups = k_scale.shape[-1]
    if groups > MAX_SCALE_GROUPS:
        return [f"{groups} scale groups per head (quant_group {d // groups}) > {MAX_SCALE_GROUPS}: the CUDA kernel "
                f"needs quant_group >= D / {MAX_SCALE_GROUPS}"]
    row = groups * k_scale.element_size()
    if row not in (4, 8, 16):
        return [f"{row}-byte scale rows ({groups} x {k_scale.dtype}); the CUDA kernel copies rows of 4, 8 or 16 bytes"]
    why = []
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t.stride(-1) != 1 or t.data_ptr() % row or any(s * t.element_size() % row for s in t.stride()[:3]):
            why.append(f"{name} needs unit stride over its groups and rows aligned to {row} bytes")
    return why


def unsupported(query, *args, **options) -> list[str]:
    """Reasons this kernel cannot run the call (the front has validated shapes and dtypes)."""
    why = []
    if query.device.type != "cuda":
        why.append(f"the CUDA decode kernel needs CUDA tensors, got {query.device.type}")
    elif gpu.capability(query.device) != (9, 0):
        why.append("the CUDA decode kernel is built for sm_90a (Hopper) only")
    elif _build_unavailable():
        why.append(_build_unavailable())
    return why + problem_reasons(query, *args, **options)


def _quantized(cache_dtype: torch.dtype) -> bool:
    return quant.kv_format(cache_dtype) is not quant.KVFormat.PLAIN


def problem_reasons(query, k_cache, v_cache, block_tables, seq_lens, *, k_scale=None, v_scale=None,
                    **options) -> list[str]:
    """The device-independent part of `unsupported`: dtypes, head dim, layout, options."""
    why = []
    if query.dtype not in DTYPES or not (k_cache.dtype == query.dtype or _quantized(k_cache.dtype)):
        why.append(f"bf16/fp16 queries with caches of their dtype or FP8/INT8/INT4, got {query.dtype} and {k_cache.dtype}")
    d = query.shape[-1]
    if d not in HEAD_DIMS:
        why.append(f"head dim {d} is not built (built: {HEAD_DIMS})")
    elif _quantized(k_cache.dtype):
        why += _scale_reasons(k_cache, k_scale, v_scale, d)
    if v_cache.shape[-1] != k_cache.shape[-1]:
        why.append(f"a value head dim of its own (D_v = {v_cache.shape[-1]}, D = {d}) is not implemented")
    batch, hkv = seq_lens.shape[0], k_cache.shape[2]
    rows = query_rows(query, k_cache, seq_lens)
    if rows > MAX_ROWS:
        why.append(f"{rows} query rows per KV head (q_per_seq x Hq / Hkv) > {MAX_ROWS}")
    if k_cache.shape[1] % BLOCK_MULTIPLE:
        why.append(f"block_size {k_cache.shape[1]} is not a multiple of {BLOCK_MULTIPLE}")
    for name, tensor in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache)):
        if tensor.data_ptr() % 16 or any(s * tensor.element_size() % 16 for s in tensor.stride()[:-1]):
            why.append(f"{name} needs 16-byte aligned data and strides, got strides {tensor.stride()} of "
                       f"{tensor.element_size()}-byte elements")
    if batch > 65535 or hkv > 65535:
        why.append("batch and KV heads must be at most 65535 (grid dimensions)")
    for name, (off, what) in PLAIN_OPTIONS.items():
        value = options.get(name, off)
        if (value is not None) if off is None else (value != off):
            why.append(f"{what} ({name}) is not implemented in the CUDA decode kernel")
    return why


def _scale_fields(k_cache, k_scale, v_scale, d: int) -> dict:
    """The DecodeArgs fields of the cache's dequantization scales."""
    if k_scale is None:
        return {}
    if k_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return {"k_scale": k_scale.data_ptr(), "v_scale": v_scale.data_ptr(), "scale_per_head": int(k_scale.numel() > 1)}
    return {"k_scale": k_scale.data_ptr(), "v_scale": v_scale.data_ptr(),
            **dict(zip(("ks_block_stride", "ks_token_stride", "ks_head_stride"), k_scale.stride()[:3])),
            **dict(zip(("vs_block_stride", "vs_token_stride", "vs_head_stride"), v_scale.stride()[:3])),
            "scale_fp32": int(k_scale.dtype == torch.float32), "quant_group": d // k_scale.shape[-1]}


def run(*args, **kwargs) -> None:
    prepare(*args, **kwargs)(*args, **kwargs)


def prepare(query, k_cache, v_cache, block_tables, seq_lens, *, out, lse, scale=None, q_scaling=1.0,
            k_scale=None, v_scale=None, **options):
    """`launch(*args, **kwargs)` for calls of this signature: the kernel's arguments are filled once
    (`DecodeArgs`); a call copies them and sets its tensors' addresses."""
    t, hq, d = query.shape
    batch = seq_lens.shape[0]
    if t == 0 or batch == 0:
        return lambda *args, **kwargs: None
    _, block_size, hkv, _ = k_cache.shape
    no_tables = torch.zeros(batch, 1, dtype=torch.int32, device=query.device) if not block_tables.numel() else None
    tables = block_tables.to(torch.int32) if no_tables is None else no_tables   # what a call passes: its strides
    size, per_sm = _grid(query, k_cache, tables, seq_lens)[:2]
    template = DecodeArgs(
        0, 0, 0, 0, 0, 0, 0,
        query.stride(0), query.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        tables.stride(0),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        batch, hq, hkv, d, t // batch, block_size, DTYPES[query.dtype],
        size,
        (scale if scale is not None else 1.0 / math.sqrt(d)) / q_scaling,
        quant.abi_code(k_cache.dtype),
        **_scale_fields(k_cache, k_scale, v_scale, d),
        pdl=int(PDL), ctas_per_sm=per_sm,
        num_blocks=k_cache.shape[0], max_blocks=block_tables.shape[1],
        err_block_tables=errors.BLOCK_TABLES, err_seq_lens=errors.SEQ_LENS,
        err=errors.device_flag(query.device).data_ptr(),
    )
    entry = _library(library_path()).attn_decode_sm90
    index = query.device.index if query.device.index is not None else torch.cuda.current_device()

    def launch(query, k_cache, v_cache, block_tables, seq_lens, *, out, lse, k_scale=None, v_scale=None, **_):
        args = DecodeArgs.from_buffer_copy(template)
        # int32 copies stay referenced until the launch: freed earlier, their memory could be reused
        lens = seq_lens.to(torch.int32)
        rows = no_tables if no_tables is not None else block_tables.to(torch.int32)
        args.block_tables, args.seq_lens = rows.data_ptr(), lens.data_ptr()
        args.q, args.k_cache, args.v_cache = query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()
        args.out, args.lse = out.data_ptr(), lse.data_ptr()
        if k_scale is not None:
            args.k_scale, args.v_scale = k_scale.data_ptr(), v_scale.data_ptr()
        c_call(entry, args, index, "CUDA paged_decode")

    launch.describe = (f"CUDA decode (csrc/decode_sm90.cu): a cluster of {size} CTA(s) per (sequence, KV head), "
                       f"the build for {per_sm} CTA(s) per SM")
    return launch


class CudaDecodeBackend:
    """`attn::paged_decode` of small problems through csrc/decode_sm90.cu."""

    name = "cuda"
    auto_devices = ("cuda",)

    def reasons(self, op, args, kwargs):
        if op != "paged_decode":
            return [f"no CUDA kernel for attn::{op}"]
        return unsupported(*args, **{k: v for k, v in kwargs.items() if k not in ("out", "lse")})

    def auto_declines(self, op, args, kwargs):
        """Where the Triton kernel is faster. H200, D = 128, bf16, 16-token pages, one process:
        this kernel streams ~45 GB/s per SM and starts in a few µs, the Triton kernel needs split-K
        and a merge kernel below ~100 (sequence, KV head) pairs but reaches the HBM limit with all
        SMs on long tables. So: one wave of CTAs at most; then tables of <= 1k keys (1.02-1.4x the
        Triton kernel), <= 4k keys if the grid covers 3/4 of the SMs (1.02-1.11x), and up to 32k
        keys in clusters of 4 or 8 (1.01-1.19x; a grid of 64 CTAs in clusters of 2 or 16 loses
        3-22% from 2k keys).
        FP8/INT8/INT4 caches: the same without the long tables in clusters, where each warp's
        dequantizing chain sets the pace (0.55-0.9x); and INT8/INT4 from 4k keys on grids of
        >= 0.45 x SMs (sequence, KV head) pairs, with any number of waves (the kernel with keys as
        the MMA's rows and, on multi-wave grids, two CTAs per SM; 32/8: INT8 1.08-1.14x, INT4
        1.03-1.38x at D = 128, 1.04-1.79x at D = 64; INT4 at B = 256 ctx 4k down to 0.96x, where
        the Triton kernel's time varies from 492 to 590 µs); and INT8/INT4 at D = 128 from 256 keys
        on grids of up to 2 x SMs pairs (B = 32 at 32/8, ctx 256 / 512 / 1k: INT8 1.10 / 1.19 / 1.20x,
        INT4 1.05 / 1.16 / 1.22x; at B = 64 the Triton kernel wins, 0.84-0.97x).
        Quantized long tables stay on Triton in clusters of any size: with up to 256 splits the
        Triton kernel is 1.01-1.62x faster than clusters of 16 (B x Hkv <= 7). Clusters of 16 fill
        only a few GPCs: at B = 1 32/4, 64 CTAs in clusters of 16 run as slowly as 32 CTAs in
        clusters of 8.
        D = 64: long tables in clusters lose (0.86-0.88x), and so do quantized 4k-key tables in
        clusters of 4-16 (0.83-0.91x); both clauses are off there. The rest holds (0.97-1.6x)."""
        if not library_built():
            return [NOT_BUILT]
        query, k_cache, _, block_tables, seq_lens = args[:5]
        size, _, ctas, single, sms = _grid(query, k_cache, block_tables, seq_lens)
        keys = block_tables.shape[1] * k_cache.shape[1]
        units = seq_lens.shape[0] * k_cache.shape[2]
        quantized = _quantized(k_cache.dtype)
        if k_cache.dtype in (torch.int8, torch.uint8) and units >= GROUPED_GRID * sms and (
                keys >= MID_KEYS or (keys >= GROUPED_SHORT_KEYS and units <= 2 * sms and query.shape[-1] in TWO_CTA_HEAD_DIMS)):
            return []
        if units > single:
            return ["more (sequence, KV head) pairs than resident CTAs: the Triton kernel is faster (measured)"]
        mid_tables = ctas >= FULL_GRID * sms and (not quantized or size <= QUANT_MID_CLUSTERS)
        long_tables = query.shape[-1] == 128 and not quantized and size in LONG_CLUSTERS
        if keys <= SHORT_KEYS or (keys <= MID_KEYS and mid_tables) or (keys <= LONG_KEYS and long_tables):
            return []
        return [f"{keys} keys per sequence over {ctas} CTAs in clusters of {size} ({k_cache.dtype} cache): "
                "the Triton kernel is faster (measured)"]

    def run(self, op, args, kwargs):
        run(*args, **kwargs)

    def prepare(self, op, args, kwargs):
        return prepare(*args, **kwargs)
