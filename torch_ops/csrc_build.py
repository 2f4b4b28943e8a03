"""What the CUDA libraries built from csrc/ share: finding nvcc, running it, the csrc files a build
reads, where a library comes from (given, prebuilt, or the on-disk cache of just-in-time builds:
`CsrcLibrary`, for `kernels.cuda.fmha_sm90_build` and `kernels.cuda.decode_sm90`; `replay` builds
the C++ op front through `cached_build`), and the device guard of their launches. Torch is
imported only by that guard."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

CSRC = Path(__file__).resolve().parent.parent / "csrc"
ARCH = "90a"


@contextlib.contextmanager
def on_device(index: int):
    """Make CUDA device `index` current for the block, if it is not already (cheaply)."""
    import torch

    if torch.cuda.current_device() == index:
        yield
    else:
        with torch.cuda.device(index):
            yield


def find_nvcc() -> str | None:
    """`ATTN_NVCC`, else `nvcc` on PATH, else `$CUDA_HOME/bin/nvcc` (None if none exists)."""
    if os.environ.get("ATTN_NVCC"):
        return os.environ["ATTN_NVCC"]
    found = shutil.which("nvcc")
    if found:
        return found
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidate = Path(cuda_home or "/usr/local/cuda") / "bin" / "nvcc"
    return str(candidate) if candidate.exists() else None


def sources_with_headers(names: tuple[str, ...], root: Path) -> list[str]:
    """`names` (files in `root`, e.g. `CSRC`), then every file of `root` that they include (`#include
    "..."`), directly or through one another: what a build of `names` reads from there (its cache key)."""
    found = list(names)
    for name in found:   # the list grows while it is walked: the headers' own includes
        for header in re.findall(r'^\s*#\s*include\s*"([^"]+)"', (root / name).read_text(), re.M):
            if header not in found and (root / header).is_file():
                found.append(header)
    return found


def source_key(sources: tuple[str, ...], root: Path, nvcc: str, *parts: str) -> str:
    """Hash of what a build depends on: the `sources` in `root` and every header they include
    (`sources_with_headers`), the version of `nvcc`, and `parts` (flags, library versions)."""
    h = hashlib.sha256()
    for name in sources_with_headers(sources, root):
        h.update((root / name).read_bytes())
    for part in (nvcc_version(nvcc), *parts):
        h.update(part.encode())
    return h.hexdigest()[:16]


@functools.cache
def nvcc_version(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout


def run_tool(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


def cache_dir() -> Path:
    """Where just-in-time builds are kept: `ATTN_CACHE_DIR`, default `~/.cache/attn_ops`."""
    return Path(os.environ.get("ATTN_CACHE_DIR") or Path.home() / ".cache" / "attn_ops")


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive lock on `path` across processes (so that concurrent processes build once)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cached(folder: str, library_name: str) -> bool:
    """Whether `cached_build(folder, library_name, ...)` would find the library built."""
    return (cache_dir() / folder / library_name).exists()


def cached_build(folder: str, library_name: str, what: str, build: Callable[[Path], object],
                 logger: logging.Logger) -> Path:
    """`cache_dir() / folder / library_name`, built by `build(target)` on a miss under a file lock
    (concurrent processes build once), logging one line when it starts (`what` is compiling) and
    one with the time and size when done."""
    target = cache_dir() / folder / library_name
    with file_lock(target.parent.with_suffix(".lock")):
        if not target.exists():
            logger.warning("attn-ops: compiling %s into %s", what, target.parent)
            start = time.perf_counter()
            build(target)
            logger.warning("attn-ops: built %s in %.0f s (%.1f MB)", target.name, time.perf_counter() - start,
                           target.stat().st_size / 1e6)
    return target


@dataclass(frozen=True)
class CsrcLibrary:
    """A library built from csrc/: the file `env` names if set, else the one `setup.py` built at
    install (`prebuilt`), else the just-in-time build cached under `folder(nvcc)`, which
    `build(target, nvcc)` makes from csrc/`source` (`cached_build`). `requirement()` says what
    else a build needs that is missing (None: nothing)."""

    env: str
    prebuilt: Path
    file_name: str
    what: str                                   # e.g. "CUDA decode library"
    source: str
    folder: Callable[[str], str]
    build: Callable[[Path, str], object]
    describe: Callable[[], str]                 # what a build compiles, for the log
    requirement: Callable[[], str | None] = lambda: None

    def unavailable(self) -> str | None:
        """Why the library can be neither loaded nor built here (None: it can)."""
        if os.environ.get(self.env) or self.prebuilt.exists():
            return None
        if find_nvcc() is None:
            return f"no prebuilt {self.what} (install with ATTN_BUILD_CUDA=1) and no nvcc to build one"
        missing = self.requirement()
        if missing:
            return missing
        if not (CSRC / self.source).exists():
            return f"csrc sources not found at {CSRC} (install from a source tree, or with ATTN_BUILD_CUDA=1)"
        return None

    def path(self, logger: logging.Logger) -> Path:
        """The library's path, building and caching it on a miss (under a file lock)."""
        if os.environ.get(self.env):
            return Path(os.environ[self.env])
        if self.prebuilt.exists():
            return self.prebuilt
        reason = self.unavailable()
        if reason:
            raise RuntimeError(reason)
        nvcc = find_nvcc()
        return cached_build(self.folder(nvcc), self.file_name, f"{self.describe()} with {nvcc}",
                            lambda target: self.build(target, nvcc), logger)

    def built(self) -> bool:
        """Whether the library loads without compiling: given, prebuilt, or built before (cached)."""
        if os.environ.get(self.env) or self.prebuilt.exists():
            return True
        return not self.unavailable() and cached(self.folder(find_nvcc()), self.file_name)
