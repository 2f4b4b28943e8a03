"""Backends that implement the `attn::` ops, the choice among them, and their registration.

A backend says for each call either nothing (it can run it) or the reasons it cannot. The
default choice is the first backend, in priority order, with no reasons; `vanilla` (the
reference) serves everything and comes last. An explicit request (`use_backend("triton")` or
`ATTN_BACKEND=triton`) never falls back: if that backend cannot serve a call, the call raises
a `ValueError` listing why.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Protocol

from . import checks, ops, reference


class Backend(Protocol):
    name: str
    auto_devices: tuple[str, ...]  # device types on which the automatic choice considers it

    def reasons(self, op: str, args: tuple, kwargs: dict) -> list[str]:
        """Why this backend cannot run `attn::op(*args, **kwargs)`; empty if it can."""

    # Optional: `auto_declines(op, args, kwargs) -> list[str]`, why the automatic choice passes
    # this backend over for a call it could run (another backend is faster there, measured).

    def run(self, op: str, args: tuple, kwargs: dict):
        """Run the op. Attention ops get `out`/`lse` buffers in `kwargs` and fill them."""


class VanillaBackend:
    """The pure-PyTorch reference: any device, any input the fronts accept; not graph-safe."""

    name = "vanilla"
    auto_devices = ("cpu", "cuda")

    def reasons(self, op, args, kwargs):
        return []

    def run(self, op, args, kwargs):
        fn = getattr(reference, op)
        if op not in ops.ATTENTION_OPS:
            return fn(*args, **kwargs)
        out, lse = kwargs.pop("out"), kwargs.pop("lse")
        o, l = fn(*args, **kwargs)
        out.copy_(o)
        lse.copy_(l)


_BACKENDS: list[Backend] = [VanillaBackend()]
_requested: contextvars.ContextVar[str | None] = contextvars.ContextVar("attn_backend", default=None)


def register_backend(backend: Backend) -> None:
    """Add a backend ahead of the ones registered before it (vanilla stays last)."""
    _BACKENDS.insert(0, backend)


def backend_names() -> list[str]:
    return [b.name for b in _BACKENDS]


@contextlib.contextmanager
def use_backend(name: str | None):
    """Run ops in this block on backend `name` only (None restores the automatic choice)."""
    if name is not None and name not in backend_names():
        raise ValueError(f"unknown backend {name!r}; available: {backend_names()}")
    token = _requested.set(name)
    try:
        yield
    finally:
        _requested.reset(token)


def select(op: str, args: tuple, kwargs: dict) -> Backend:
    requested = _requested.get() or os.environ.get("ATTN_BACKEND") or None
    if requested is None:
        return next(b for b in _BACKENDS if _automatic(b, op, args, kwargs))
    backend = next((b for b in _BACKENDS if b.name == requested), None)
    if backend is None:
        raise ValueError(f"unknown backend {requested!r} (ATTN_BACKEND or use_backend); available: {backend_names()}")
    why = backend.reasons(op, args, kwargs)
    if why:
        raise ValueError(f"backend {requested!r} cannot run attn::{op}: " + "; ".join(why))
    return backend


def _automatic(backend: Backend, op: str, args: tuple, kwargs: dict) -> bool:
    if args[0].device.type not in backend.auto_devices or backend.reasons(op, args, kwargs):
        return False
    declines = getattr(backend, "auto_declines", None)
    return not (declines and declines(op, args, kwargs))


# --- the real implementations registered for the ops -------------------------------------------


def _run(op: str, args: tuple, kwargs: dict):
    ops.SPECS[op].check(*args, **{k: v for k, v in kwargs.items() if k not in ("out", "lse")})
    if checks.debug_checks_enabled():
        checks.check_data(op, args, kwargs)
    return select(op, args, kwargs).run(op, args, dict(kwargs))


def _functional_attention(op: str):
    def impl(*args, **kwargs):
        out, lse = ops.SPECS[op].new_outputs(args, kwargs)
        _run(op, args, {**kwargs, "out": out, "lse": lse})
        return out, lse

    return impl


def _out_attention(op: str):
    def impl(*args, out, lse, **kwargs):
        ops.SPECS[op].check_outputs(args, kwargs, out, lse)
        _run(op, args, {**kwargs, "out": out, "lse": lse})

    return impl


def _plain(op: str):
    return lambda *args, **kwargs: _run(op, args, kwargs)


_IMPLS = {"kv_cache_write": _plain("kv_cache_write"), "cache_attention": _plain("cache_attention")}
for _op in ops.ATTENTION_OPS:
    _IMPLS[_op] = _functional_attention(_op)
    _IMPLS[f"{_op}.out"] = _out_attention(_op)
for _qualname, _impl in _IMPLS.items():
    for _device in ("CPU", "CUDA"):
        ops.LIB.impl(_qualname, ops.with_schema_defaults(_qualname, _impl), _device)


def backend_for(op: str, *args, **kwargs) -> str:
    """The name of the backend that would run this call (for tests, benchmarks and docs)."""
    return select(op, args, kwargs).name
