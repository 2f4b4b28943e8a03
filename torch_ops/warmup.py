"""`torch_ops.warmup()`: do ahead of time what the first calls would otherwise do while serving."""

from __future__ import annotations

import sys
import time
from typing import Callable, Iterable

import torch

from . import backends, cuda_decode, cutlass


def warmup(calls: Iterable[Callable[[], object]] = (), *, libraries: bool = True, progress: bool = True) -> float:
    """Build the CUDA libraries the automatic choice would use but never builds (on a Hopper GPU
    with nvcc: the CUTLASS library, about 105 s on 16 cores, and the CUDA decode library, 20-30 s;
    cached on disk), then run each of `calls` once and synchronize: a call compiles its Triton
    kernels (or loads them from Triton's disk cache) and caches its plan. Pass one call per shape
    class your loop will see. Returns the seconds taken; `progress` prints a line per step."""
    start = time.perf_counter()

    def say(message: str) -> None:
        if progress:
            print(f"[attn-ops warmup {time.perf_counter() - start:6.1f} s] {message}", file=sys.stderr, flush=True)

    if libraries and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        for name, module in (("CUDA decode", cuda_decode), ("CUTLASS", cutlass)):
            if module.library_built():
                say(f"{name} library: built")
                continue
            try:
                say(f"{name} library: building")
                module.library_path()
                say(f"{name} library: built")
            except (RuntimeError, ImportError, OSError) as e:
                say(f"{name} library: not built ({e}); its kernels stay unused")
        backends.clear_plans()
    calls = list(calls)
    for i, call in enumerate(calls):
        call()
        say(f"call {i + 1}/{len(calls)}")
    if calls and torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start
