"""Building and loading the library of the `cutlass` backend (`fmha_sm90`): csrc/fmha_sm90.cu and
its headers, with the C ABI of csrc/fmha_sm90.h (`FmhaArgs`).

The CUDA code is built against the CUTLASS headers of the `nvidia-cutlass` wheel (and the FMHA
collectives of its example 88), one translation unit per (input dtype, head dim) and kernel
family (`VARIANTS`: contiguous K/V with one CTA per work tile ("plain") or a persistent grid, and
K/V from a paged cache for `PAGED_KERNELS`), linked into one shared library with a plain C ABI
that Python calls through ctypes: the build never sees torch headers, and a CPU install never
needs nvcc. Always sm_90a, whatever GPU is present (or none). Which persistent objects a build
holds follows the grid asked for (`persistent_mode`, `built_variants`).

The library comes from, in order: `torch_ops/_fmha_sm90.so` (built at install with
`ATTN_BUILD_CUDA=1`), or a just-in-time build on first use, cached under `ATTN_CACHE_DIR`
(default `~/.cache/attn_ops`) in a folder named by a hash of the sources (the headers they include
too), the CUTLASS version, nvcc's version and the flags. `ATTN_NVCC` names the compiler (default:
`nvcc` on PATH, then `$CUDA_HOME/bin/nvcc`); `MAX_JOBS` caps parallel compiles;
`ATTN_CUTLASS_LIBRARY` points at a library built elsewhere (e.g. a tuning variant).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ...csrc_build import ARCH, CSRC, CsrcLibrary, find_nvcc, source_key
from ...csrc_build import run_tool as _run_tool

log = logging.getLogger(__name__)

SOURCES = ("fmha_sm90.cu", "fmha_sm90.h")
PREBUILT = Path(__file__).resolve().parents[2] / "_fmha_sm90.so"   # in torch_ops/, where setup.py builds it
LIBRARY_NAME = "libattn_fmha_sm90.so"
# the paged kernel families; "paged16": for 16-token boxes at D = 128, "x2": in clusters of two CTAs (see
# `fmha_sm90.paged_kernel`)
PAGED_FAMILIES = ("paged", "paged16", "pagedx2", "paged16x2")
PAGED_DEFINES = {"paged": 1, "paged16": 2, "pagedx2": 1, "paged16x2": 2}   # family -> -DATTN_PAGED
CLUSTER_VARIANTS = ("pagedx2", "paged16x2")   # -DATTN_CLUSTER=2: two CTAs share each K/V box (multicast)
# kernel variant -> entry suffix: the plain and persistent grids over contiguous K/V, the paged families,
# and the paged families in the persistent grid ("<family>_persistent", built when that grid is forced)
VARIANTS = {"plain": "", "persistent": "_persistent", **{f: f"_{f}" for f in PAGED_FAMILIES},
            **{f"{f}_persistent": f"_{f}_persistent" for f in PAGED_FAMILIES}}

# (input dtype, head dim) -> the translation unit's element name; entry `attn_fmha_sm90_<e>_d<D><variant>`.
KERNELS = {
    (torch.float8_e4m3fn, 128): "e4m3", (torch.float8_e4m3fn, 256): "e4m3",
    (torch.bfloat16, 64): "bf16", (torch.bfloat16, 128): "bf16", (torch.bfloat16, 256): "bf16",
    (torch.float16, 64): "fp16", (torch.float16, 128): "fp16", (torch.float16, 256): "fp16",
}
# the paged_prefill kernels (K/V from a cache [num_blocks, block_size, Hkv, D]): 16-bit, D 64 and 128
PAGED_KERNELS = {(t, d): e for (t, d), e in KERNELS.items() if t != torch.float8_e4m3fn and d <= 128}
# (input dtype, head dim) -> the longest mean query length (non-causal, causal) for which context
# attention runs the persistent grid automatically. H200, 16k tokens, 32 heads, persistent vs plain
# on one library in one process, non-causal / causal: FP8 D = 128 S = 512 1.31x /
# 1.43x, 1k 1.16x / 1.27x, 2k 1.03x / 1.11x, 4k 0.96x / 0.97x; bf16 D = 128 1.09x / 1.20x, 1k 1.02x /
# 1.07x, 2k 0.94x / 1.00x, 4k 0.93x / 0.83x; bf16 D = 64 1.23x / 1.37x, 2k 1.05x / 1.11x, 4k 0.97x /
# 0.98x; fp16 the same within 2-3%. FP8 D = 256 loses everywhere but causal 512 (1.03x).
PERSISTENT_SHORT = {(torch.float8_e4m3fn, 128): (2048, 2048),
                    (torch.bfloat16, 128): (512, 1024), (torch.float16, 128): (512, 1024),
                    (torch.bfloat16, 64): (2048, 2048), (torch.float16, 64): (2048, 2048)}
PAGED16_HEAD_DIM = 128    # the paged16 kernels' head dim
# paged_prefill on the cluster kernels at D = 64 runs the persistent grid automatically when its sequences
# bring at least PAGED_PERSISTENT_MIN_QUERIES queries on average. H200, 16-token blocks, persistent / plain:
# 4 x 512 on 2k 1.06-1.08x, 4 x 2k on 8k 1.055-1.07x, 1 x 4k on 16k 1.045x, but 16 x 256 on 4k 0.848x (the
# static work order balances badly over many short sequences: docs/cutlass.md); at D = 128 (paged16x2)
# 1.00x / 0.96x.
PAGED_PERSISTENT_FAMILY = "pagedx2"
PAGED_PERSISTENT_KERNELS = {key: e for key, e in PAGED_KERNELS.items() if key[1] == 64}
PAGED_PERSISTENT_MIN_QUERIES = 512
OUT_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float8_e4m3fn: 2}   # AttnOutDtype
V_TOKENS, V_TRANSPOSED, V_TRANSPOSED_INTERLEAVED = 0, 1, 2   # AttnValueLayout


# ---- build ---------------------------------------------------------------------------------------


def cutlass_include_dirs() -> list[Path]:
    """Header folders of the installed nvidia-cutlass wheel (raises ImportError without it)."""
    import cutlass_library

    root = Path(cutlass_library.__file__).resolve().parent / "source"
    return [root / "include", root / "tools" / "util" / "include", root / "examples" / "88_hopper_fmha"]


def compile_command(nvcc: str, element: str, head_dim: int, output: Path, include_dirs: list[Path],
                    defines: tuple[str, ...] = (), variant: str = "plain") -> list[str]:
    """nvcc command line that compiles the `element` x `head_dim` instantiation of kernel family
    `variant` (a key of `VARIANTS`) to an object."""
    family = variant.removesuffix("_persistent")
    return [
        nvcc, "-std=c++17", "-O3", "-DNDEBUG", f"-gencode=arch=compute_{ARCH},code=sm_{ARCH}",
        "--expt-relaxed-constexpr", "-Xcompiler=-fPIC,-fvisibility=hidden", "-lineinfo", "-ftz=true",
        f"-DATTN_ELEMENT_{element.upper()}", f"-DATTN_HEAD_DIM={head_dim}",
        f"-DATTN_PERSISTENT={int(variant.endswith('persistent'))}", f"-DATTN_PAGED={PAGED_DEFINES.get(family, 0)}",
        f"-DATTN_CLUSTER={2 if family in CLUSTER_VARIANTS else 1}",
        *(f"-D{d}" for d in defines),
        *(f"-I{p}" for p in include_dirs), f"-I{CSRC}",
        "-c", str(CSRC / "fmha_sm90.cu"), "-o", str(output),
    ]


def link_command(nvcc: str, objects: list[Path], output: Path) -> list[str]:
    """Links the objects into one shared library with the CUDA runtime linked statically."""
    return [nvcc, "-shared", f"-gencode=arch=compute_{ARCH},code=sm_{ARCH}", "-cudart=static",
            *map(str, objects), "-o", str(output)]


def _cutlass_version() -> str:
    from importlib.metadata import version

    return version("nvidia-cutlass")


def persistent_mode() -> bool | None:
    """The grid asked for: `fmha_sm90.PERSISTENT` if set, else `ATTN_CUTLASS_PERSISTENT` (1:
    persistent, 0: plain); None (unset or `auto`): chosen per call by `fmha_sm90.runs_persistent`."""
    from .fmha_sm90 import PERSISTENT   # the knob lives on the backend's module, where users set it

    if PERSISTENT is not None:
        if not isinstance(PERSISTENT, bool):
            raise TypeError("torch_ops.kernels.cuda.fmha_sm90.PERSISTENT must be True, False or None, "
                            f"got {PERSISTENT!r}")
        return PERSISTENT
    value = os.environ.get("ATTN_CUTLASS_PERSISTENT", "auto").strip()
    if value not in ("0", "1", "auto"):
        raise ValueError(f"ATTN_CUTLASS_PERSISTENT must be 0, 1 or auto, got {value!r}")
    return None if value == "auto" else value == "1"


def built_variants() -> tuple[str, ...]:
    """The kernel families a build compiles (see `kernels_of`)."""
    paged_persistent = PAGED_FAMILIES if persistent_mode() is True else (PAGED_PERSISTENT_FAMILY,)
    return ("plain", *PAGED_FAMILIES, "persistent", *(f"{f}_persistent" for f in paged_persistent))


def kernels_of(variant: str) -> dict:
    """The (input dtype, head dim) instantiations a build compiles for kernel family `variant`: every
    one for the plain grid, `PAGED_KERNELS` for the paged families, and for the persistent grid
    `PERSISTENT_SHORT`'s over contiguous K/V and `PAGED_PERSISTENT_KERNELS`, or all when that grid is forced."""
    family = variant.removesuffix("_persistent")
    if variant == f"{PAGED_PERSISTENT_FAMILY}_persistent" and persistent_mode() is not True:
        return PAGED_PERSISTENT_KERNELS
    if family in ("paged", "pagedx2"):
        return PAGED_KERNELS
    if family in ("paged16", "paged16x2"):
        return {key: e for key, e in PAGED_KERNELS.items() if key[1] == PAGED16_HEAD_DIM}
    if variant == "persistent" and persistent_mode() is not True:
        return {key: KERNELS[key] for key in PERSISTENT_SHORT}
    return KERNELS


def build_units(variants: tuple[str, ...]) -> list[tuple[str, int, str]]:
    """(element, head dim, variant) of every translation unit a build of `variants` compiles."""
    return sorted({(e, d, v) for v in variants for (_, d), e in kernels_of(v).items()})


def build_key(nvcc: str, defines: tuple[str, ...] = (), variants: tuple[str, ...] = ("plain",)) -> str:
    """Hash of what the library depends on: sources, CUTLASS version, nvcc version, flags, grids."""
    flags = compile_command("nvcc", "x", 0, Path("o"), [], defines)
    return source_key(SOURCES, CSRC, nvcc, _cutlass_version(), " ".join(flags),
                      *(f"{e}_d{d}_{v}" for e, d, v in build_units(variants)))


def build(output: Path, *, nvcc: str | None = None, defines: tuple[str, ...] = (), jobs: int | None = None,
          variants: tuple[str, ...] | None = None) -> Path:
    """Compile the instantiations of the kernel families `variants` (default `built_variants()`)
    in parallel and link them into `output`."""
    variants = built_variants() if variants is None else variants
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise RuntimeError("no nvcc found (set ATTN_NVCC or CUDA_HOME) to build the CUTLASS kernels")
    include_dirs = cutlass_include_dirs()
    jobs = jobs or int(os.environ.get("MAX_JOBS", 0)) or os.cpu_count() or 1
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output.parent) as tmp:
        units = build_units(variants)
        objects = [Path(tmp) / f"{e}_d{d}{VARIANTS[v]}.o" for e, d, v in units]
        commands = [compile_command(nvcc, e, d, o, include_dirs, defines, v) for (e, d, v), o in zip(units, objects)]
        with ThreadPoolExecutor(jobs) as pool:
            for cmd, result in zip(commands, pool.map(_run_tool, commands)):
                if result.returncode != 0:
                    raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{result.stderr[-4000:]}")
        staged = Path(tmp) / LIBRARY_NAME
        result = _run_tool(link_command(nvcc, objects, staged))
        if result.returncode != 0:
            raise RuntimeError(f"linking the CUTLASS kernels failed:\n{result.stderr[-4000:]}")
        os.replace(staged, output)   # atomic: a concurrent reader sees the old file or the whole new one
    return output


def library_path() -> Path:
    """`ATTN_CUTLASS_LIBRARY` if set (a library built with `build`), the prebuilt library, or the
    cached JIT build (building it on a miss, under a file lock so that concurrent processes build once)."""
    return LIBRARY.path(log)


def library_built() -> bool:
    """Whether the library loads without compiling: given, prebuilt, or built before (cached)."""
    return entry.cache_info().currsize > 0 or LIBRARY.built()


def _cutlass_headers_missing() -> str | None:
    try:
        cutlass_include_dirs()
    except ImportError:
        return "the nvidia-cutlass wheel is not installed (pip install 'attn-ops[cutlass]')"
    return None


LIBRARY = CsrcLibrary(
    "ATTN_CUTLASS_LIBRARY", PREBUILT, LIBRARY_NAME, "CUTLASS library", SOURCES[0],
    folder=lambda nvcc: f"fmha_sm90-{build_key(nvcc, variants=built_variants())}",
    build=lambda target, nvcc: build(target, nvcc=nvcc, variants=built_variants()),
    describe=lambda: (f"the CUTLASS FMHA kernels (csrc/fmha_sm90.cu, {len(build_units(built_variants()))} "
                      f"instantiations, sm_{ARCH})"),
    requirement=_cutlass_headers_missing)


@functools.cache
def build_unavailable() -> str | None:
    """Why the library can be neither loaded nor built here (None: it can)."""
    return LIBRARY.unavailable()


NOT_BUILT = ("the CUTLASS library is not built yet, and the automatic choice builds nothing: torch_ops.warmup() "
             "builds it (about 130 s on 16 cores), or install with ATTN_BUILD_CUDA=1")


class FmhaArgs(ctypes.Structure):
    """Mirror of `AttnFmhaArgs` in csrc/fmha_sm90.h (same order, same types)."""

    _fields_ = [
        *((n, ctypes.c_void_p) for n in ("q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k",
                                        "q_scale", "k_scale", "v_scale", "out_scale")),
        *((n, ctypes.c_int64) for n in ("q_row_stride", "q_head_stride", "k_row_stride", "k_head_stride",
                                       "v_row_stride", "v_head_stride", "v_dim_stride", "out_row_stride",
                                       "out_head_stride", "lse_row_stride")),
        *((n, ctypes.c_int32) for n in ("total_q", "total_k", "num_seqs", "hq", "hkv", "head_dim", "causal",
                                       "q_scale_stride", "k_scale_stride", "v_scale_stride", "out_dtype")),
        ("softmax_scale", ctypes.c_float),
        *((n, ctypes.c_int32) for n in ("num_ctas", "section_heads", "v_layout")),
        *((n, ctypes.c_void_p) for n in ("block_tables", "seq_lens")),
        *((n, ctypes.c_int64) for n in ("block_table_stride", "k_block_stride", "v_block_stride")),
        *((n, ctypes.c_int32) for n in ("max_blocks", "block_size", "num_blocks", "box_rows", "skip_q_len")),
        ("err_flag", ctypes.c_void_p),
        *((n, ctypes.c_int32) for n in ("err_block_tables", "err_seq_lens")),
    ]


@functools.cache
def entry(element: str, head_dim: int, variant: str):
    path, name = library_path(), f"attn_fmha_sm90_{element}_d{head_dim}{VARIANTS[variant]}"
    try:
        fn = getattr(ctypes.CDLL(str(path)), name)
    except AttributeError as e:
        hint = ("built without these persistent kernels (build it with ATTN_CUTLASS_PERSISTENT=1 set, or run the "
                "plain ones: ATTN_CUTLASS_PERSISTENT=0)" if variant.endswith("persistent") else
                "older than this source tree (rebuild it)")
        raise RuntimeError(f"the CUTLASS library {path} has no {name}: a library {hint}") from e
    fn.argtypes = [ctypes.POINTER(FmhaArgs), ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn
