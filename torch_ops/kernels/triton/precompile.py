"""Compiling the Triton kernels a block of code would launch, in parallel processes, before it runs.

`recorded()` collects the launches a block makes (through `TritonLaunch` or a kernel's JIT)
without running them: their outputs stay unwritten, and the C++ front records nothing meanwhile.
`compile_ahead()` hands each distinct variant, as soon as it is recorded, to a pool of processes
(up to one per core) that compile it into Triton's on-disk cache; the block's first real launch
of a variant then loads it instead of compiling it (Triton compiles with the GIL held: threads
would take turns). The processes fork from one server that imported torch and Triton, and
compile from tensor descriptions (no CUDA memory, no CUDA context), so that each starts without
importing torch again. A ledger in that cache (`attn_ops_precompiled`) lists the variants
compiled so: a warm cache starts no process.

A variant is what Triton compiles under (`variant_key`): the kernel, its constexprs and launch
options, each tensor's dtype and 16-byte alignment, each integer's width and, unless the kernel
marks it `do_not_specialize`, whether it is 1 or a multiple of 16.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import inspect
import logging
import multiprocessing
from multiprocessing import forkserver
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, MockTensor

from ... import backends, replay
from .launcher import TritonLaunch, settle_cache_key

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Launch:
    """One recorded launch: the kernel (`module`.`kernel`), its positional arguments (a tensor as
    `("tensor", dtype name, 16-byte aligned)`), grid and keyword arguments."""

    module: str
    kernel: str
    args: tuple
    grid: tuple
    meta: tuple

    @property
    def fn(self):
        return getattr(importlib.import_module(self.module), self.kernel)

    @functools.cached_property
    def variant(self) -> tuple:
        return variant_key(self.fn, self.args, dict(self.meta))


def _params(fn) -> list[tuple[str, bool, bool, object]]:
    """(name, constexpr, do_not_specialize, default) of each parameter of a Triton kernel, compiled
    (`JITFunction`) or interpreted (TRITON_INTERPRET=1)."""
    if hasattr(fn, "params"):
        return [(p.name, p.is_constexpr, p.do_not_specialize, p.default) for p in fn.params]
    plain = set(fn.kwargs.get("do_not_specialize") or ())
    return [(name, "constexpr" in str(p.annotation), name in plain, None if p.default is p.empty else p.default)
            for name, p in inspect.signature(fn.fn).parameters.items()]


def _integer(value: int, specialize: bool) -> tuple:
    width = "i32" if -2**31 <= value < 2**31 else "i64" if value < 2**63 else "u64"
    return (width, value == 1, value % 16 == 0) if specialize else (width,)


def variant_key(fn, args: tuple, meta: dict) -> tuple:
    """What Triton compiles `fn(*args, **meta)` under (see the module docstring); a tensor may be
    a `Launch` tensor description."""
    params = _params(fn)
    values = dict(zip((name for name, *_ in params), args))
    values.update(meta)
    spec = []
    for name, constexpr, plain, default in params:
        v = values.get(name, default)
        if constexpr:
            spec.append(v)
        elif isinstance(v, torch.Tensor):
            spec.append((str(v.dtype).removeprefix("torch."), v.data_ptr() % 16 == 0))
        elif isinstance(v, tuple) and v[:1] == ("tensor",):
            spec.append(v[1:])
        elif isinstance(v, bool) or v is None:
            spec.append(v)
        elif isinstance(v, int):
            spec.append(_integer(v, not plain))
        else:
            spec.append(type(v).__name__)
    names = {name for name, *_ in params}
    options = tuple(sorted((k, v) for k, v in meta.items() if k not in names))
    return fn.__name__, tuple(spec), options


def _describe(x):
    if isinstance(x, torch.Tensor):
        return ("tensor", str(x.dtype).removeprefix("torch."), x.data_ptr() % 16 == 0)
    return x


def _launch(fn, args: tuple, grid, meta: dict) -> Launch:
    python = fn.fn
    return Launch(python.__module__, python.__name__, tuple(map(_describe, args)), tuple(grid),
                  tuple(sorted(meta.items())))


@contextlib.contextmanager
def recorded(on_launch=None):
    """Collect, into the yielded list, the Triton launches of the block instead of running them;
    `on_launch(launch)` is called on each as it is recorded."""
    launches: list[Launch] = []
    call, runs = TritonLaunch.__call__, (JITFunction.run, InterpretedFunction.run)
    described: dict[tuple, Launch] = {}   # (TritonLaunch, its tensors' descriptions) -> its Launch

    def add(launch: Launch) -> None:
        launches.append(launch)
        if on_launch is not None:
            on_launch(launch)

    def record(self, *tensors):
        key = (self, *map(_describe, tensors))   # a plan's launch recorded again: one lookup
        if key not in described:
            described[key] = _launch(self.fn, (*tensors, *self.scalars), self.grid, self.meta)
        add(described[key])

    def record_jit(self, *args, grid, warmup, **kwargs):
        add(_launch(self, args, grid if isinstance(grid, tuple) else (grid,), kwargs))

    replay.configure(bypass=True)   # the C++ front records no skipped launch
    TritonLaunch.__call__ = record
    JITFunction.run = InterpretedFunction.run = record_jit
    try:
        yield launches
    finally:
        TritonLaunch.__call__ = call
        JITFunction.run, InterpretedFunction.run = runs
        backends.clear_plans()   # plans made meanwhile would not be recorded by the C++ front


class _Tensor(MockTensor):
    """What Triton specializes a tensor argument on, without memory or a CUDA context: its dtype
    and whether its address is 16-byte aligned."""

    def __init__(self, description: tuple):
        _, dtype, aligned = description
        super().__init__(getattr(torch, dtype))
        self.address = 0 if aligned else 2

    def data_ptr(self) -> int:
        return self.address


def _forkserver():
    """Workers forked from one server process (the process's forkserver, started here if it is not
    running) that imported torch and Triton and never CUDA: a worker starts without importing
    them again. Starting it returns at once; the server imports in the background."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "triton"])
    forkserver.ensure_running()
    return context


def _compile(launch: Launch, device: int) -> str | None:
    """Compile `launch`'s variant into Triton's cache (in a worker process); an error's text."""
    try:
        if device != torch.cuda.current_device():   # the GPU Triton compiles for
            torch.cuda.set_device(device)
        args = [_Tensor(a) if isinstance(a, tuple) and a[:1] == ("tensor",) else a for a in launch.args]
        settle_cache_key(launch.fn)
        launch.fn.warmup(*args, grid=launch.grid, **dict(launch.meta))
        return None
    except Exception as e:  # noqa: BLE001 - reported; the real launch compiles it again and raises
        return f"{launch.kernel}: {type(e).__name__}: {e}"


class Compiler:
    """Compiles for CUDA `device` (compute capability `target`), in up to `workers` processes
    started as needed, each variant `add`ed that is new, of a compiled Triton kernel, and not in
    the ledger; `finish` waits for them."""

    def __init__(self, workers: int, device: int, target: tuple):
        self.workers, self.device, self.target = workers, device, target
        self.seen, self.todo, self.pool = set(), [], None

    def add(self, launch: Launch) -> None:
        key = launch.variant
        if key in self.seen or not isinstance(launch.fn, JITFunction):
            return
        self.seen.add(key)
        if not uncompiled([launch], self.target):
            return
        if self.pool is None:
            self.pool = ProcessPoolExecutor(self.workers, mp_context=_forkserver())
        self.todo.append((launch, self.pool.submit(_compile, launch, self.device)))

    def finish(self) -> int:
        """Wait for the compiles, log failures, add the others to the ledger; how many ran."""
        if self.pool is None:
            return 0
        errors = [future.result() for _, future in self.todo]
        self.pool.shutdown()
        for error in filter(None, errors):
            log.warning("attn-ops: compiling ahead failed (the first launch compiles it): %s", error)
        record_compiled([launch for (launch, _), error in zip(self.todo, errors) if not error], self.target)
        return len(self.todo)


def _ledger() -> Path:
    return Path(triton.knobs.cache.dir) / "attn_ops_precompiled"


def _stamp(launch: Launch, target: tuple) -> str:
    """What Triton's cache key for `launch` depends on: the variant, the kernel's source (with the
    functions it calls), Triton's version, the GPU's compute capability and Triton's settings."""
    settings = sorted((k, v) for k, v in os.environ.items() if k.startswith("TRITON_"))
    text = repr((launch.variant, settle_cache_key(launch.fn), triton.__version__, tuple(target), settings))
    return hashlib.sha256(text.encode()).hexdigest()


def uncompiled(launches: list[Launch], target: tuple) -> list[Launch]:
    """The launches whose variants the ledger does not list as compiled for `target`."""
    try:
        done = set(_ledger().read_text().split())
    except OSError:
        done = set()
    return [launch for launch in launches if _stamp(launch, target) not in done]


def record_compiled(launches: list[Launch], target: tuple) -> None:
    """Add `launches`' variants to the ledger (one line each, appended: writers may overlap)."""
    if not launches:
        return
    try:
        _ledger().parent.mkdir(parents=True, exist_ok=True)
        with open(_ledger(), "a") as ledger:
            ledger.write("".join(_stamp(launch, target) + "\n" for launch in launches))
    except OSError as e:
        log.warning("attn-ops: could not write %s (%s): warm-ups will compile ahead again", _ledger(), e)


def _worker_count(workers: int | None) -> int:
    return workers if workers is not None else int(os.environ.get("ATTN_COMPILE_WORKERS") or os.cpu_count() or 1)


def compile_ahead(run, *, workers: int | None = None) -> int:
    """Record the launches of `run()`, compiling each new variant in parallel processes as it is
    recorded (up to `workers`, default `ATTN_COMPILE_WORKERS`, else one per core), each once,
    into Triton's on-disk cache; returns how many were compiled. With fewer than 2 workers or no
    CUDA device nothing is recorded (the caller's own run compiles). Failures are logged: the real
    launch compiles its variant again, and raises."""
    workers = _worker_count(workers)
    if workers < 2 or not torch.cuda.is_available():
        return 0
    device = torch.cuda.current_device()
    compiler = Compiler(workers, device, torch.cuda.get_device_capability(device))
    try:
        with recorded(compiler.add):
            run()
    finally:
        compiled = compiler.finish()
    return compiled
