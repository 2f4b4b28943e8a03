"""`torch_ops.warmup()`: do ahead of time what the first calls would otherwise do while serving."""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

import torch

from . import backends, gpu, replay
from .kernels.cuda import decode_sm90, fmha_sm90_build


def warmup(calls: Iterable[Callable[[], object]] = (), *, libraries: bool = True, progress: bool = True) -> float:
    """Build the libraries the automatic choice would use but never builds (cached on disk): the
    C++ op front (`torch_ops.replay`, 12 s) on any CUDA GPU, and on a Hopper GPU with nvcc the
    CUTLASS library (about 130 s) and the CUDA decode library (about 35 s), side by side (H200
    machine, 16 cores). Then run each of `calls` once and synchronize: a call compiles its Triton
    kernels (or loads them from Triton's disk cache) and caches its plan. On CUDA the calls first
    run with their Triton launches recorded, not run, and those kernels compile in parallel
    processes (`kernels.triton.precompile`, `ATTN_COMPILE_WORKERS`). Pass one call per shape
    class your loop will see. Returns the seconds taken; `progress` prints a line per step."""
    start = time.perf_counter()

    def say(message: str) -> None:
        if progress:
            print(f"[attn-ops warmup {time.perf_counter() - start:6.1f} s] {message}", file=sys.stderr, flush=True)

    if libraries and torch.cuda.is_available():
        steps = [("C++ op front", replay.installed, lambda: replay.install(build=True))]
        if gpu.capability() == (9, 0):
            steps += [(name, module.library_built, module.library_path)
                      for name, module in (("CUDA decode", decode_sm90), ("CUTLASS", fmha_sm90_build))]

        def build(name, built, make):
            if built():
                return say(f"{name} library: built")
            try:
                say(f"{name} library: building")
                make()
                say(f"{name} library: built")
            except (RuntimeError, ImportError, OSError) as e:
                say(f"{name} library: not built ({e}); it stays unused")

        with ThreadPoolExecutor(len(steps)) as pool:   # the compilers run side by side
            list(pool.map(lambda step: build(*step), steps))
        backends.clear_plans()
    calls = list(calls)
    if calls and torch.cuda.is_available():
        from .kernels.triton import precompile

        compiled = precompile.compile_ahead(lambda: [call() for call in calls])
        say(f"{compiled} kernel variants compiled in parallel")
    for i, call in enumerate(calls):
        call()
        say(f"call {i + 1}/{len(calls)}")
    if calls and torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start
