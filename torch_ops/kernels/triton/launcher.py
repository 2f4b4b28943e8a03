"""A Triton kernel launch whose grid, scalar arguments and meta-parameters are fixed.

The op front caches one per call signature (`torch_ops.backends`), so these are constant for
every call that reaches it; only the tensors change. The first call goes through Triton's JIT
(which compiles, or finds the compiled kernel) and keeps the compiled kernel; later calls hand
the arguments straight to its launcher, skipping the JIT's binding and specialization (the
signature fixes everything the specialization looks at: dtypes, integer values, 16-byte
alignment). Under the interpreter, with a launch hook set (profilers), or where the compiled
kernel lacks the launcher this relies on, every call goes through the JIT.
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
from triton.runtime import jit
from triton.runtime.errors import OutOfResources

from . import interpreting
from ... import replay


_RUNTIME = getattr(getattr(triton, "knobs", None), "runtime", None)
_JIT_CALLABLE = getattr(jit, "JITCallable", jit.JITFunction)


def settle_cache_key(fn, _seen=None) -> str | None:
    """`fn.cache_key` (None under the interpreter), computed after the keys of the JIT functions it
    calls. Triton 3.6 folds a callee's constexpr globals into its caller's key only if the callee's
    own key already exists, so a caller's key would depend on what the process compiled before: a
    compile-ahead worker and the serving process would cache the same kernel under two keys."""
    if not isinstance(fn, _JIT_CALLABLE):
        return None
    if fn.hash is not None:   # computed already (settled, if this computed it)
        return fn.cache_key
    seen = _seen if _seen is not None else set()
    seen.add(id(fn))   # not `fn`: a JIT function's hash is its cache key
    for name in fn.fn.__code__.co_names:
        callee = fn.__globals__.get(name)
        if isinstance(callee, _JIT_CALLABLE) and id(callee) not in seen:
            settle_cache_key(callee, seen)
    return fn.cache_key


def _hook_set(hook) -> bool:
    return hook is not None and bool(getattr(hook, "calls", True))


def _launch_hooks_set() -> bool:
    return _RUNTIME is not None and (_hook_set(_RUNTIME.launch_enter_hook) or _hook_set(_RUNTIME.launch_exit_hook))


class TritonLaunch:
    """`fn[grid](*tensors, *scalars, **meta)`: the kernel's leading parameters are the tensors a
    call passes; `scalars` and the meta-parameters (constexprs, num_warps, num_stages) follow.
    `shrink(meta)`, if given, is the next meta to try when the kernel does not fit the GPU
    (Triton's OutOfResources), or None to give up."""

    def __init__(self, fn, grid: tuple[int, ...], scalars: tuple, meta: dict,
                 shrink: Callable[[dict], dict | None] | None = None):
        self.fn, self.scalars, self.meta = fn, tuple(scalars), dict(meta)
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.shrink = shrink
        self.kernel = None   # the compiled kernel, once launched on a GPU (resources, for reports)
        self.direct = None   # the same, when later calls may go straight to its launcher
        self.device = None   # the device whose context loaded it
        self.tail: tuple = ()   # the arguments after the tensors: scalars, then meta-parameters

    def __call__(self, *tensors) -> None:
        compiled = self.direct
        jit = compiled is None or _launch_hooks_set() or torch.cuda.current_device() != self.device
        if jit:
            self._jit(tensors)
        else:
            g0, g1, g2 = self.grid
            compiled.run(g0, g1, g2, torch._C._cuda_getCurrentRawStream(self.device), compiled.function,
                         compiled.packed_metadata, None, None, None, *tensors, *self.tail)
        if replay.RECORDERS:
            replay.RECORDERS[-1].triton(self, tensors, jit)

    def _jit(self, tensors: tuple) -> None:
        settle_cache_key(self.fn)
        while True:
            try:
                compiled = self.fn[self.grid](*tensors, *self.scalars, **self.meta)
                break
            except OutOfResources:
                meta = self.shrink(self.meta) if self.shrink else None
                if meta is None:
                    raise
                self.meta = meta
        self.kernel = compiled
        if interpreting() or not hasattr(compiled, "packed_metadata"):
            return
        compiled.run   # noqa: B018  (loads the module: its launcher exists from here on)
        params = self.fn.params[len(tensors) + len(self.scalars):]
        self.tail = (*self.scalars, *(self.meta.get(p.name, p.default) for p in params))
        self.direct, self.device = compiled, torch.cuda.current_device()


def no_launch(*args, **kwargs) -> None:
    """The launch of a call with nothing to compute (no tokens, no sequences)."""


def scale_operands(mode: str, k_scale, v_scale, num_kv_heads: int, absent):
    """A call's K/V scale operands, the way its plan decided (`mode`): "none" passes `absent` for
    both; "given" the scales themselves; "per_head" a 0-d one expanded to `[num_kv_heads]` beside a
    per-head one (one stride serves both); "contiguous" copies of scale caches with strided last dims."""
    if mode == "none":
        return absent, absent
    if mode == "per_head":
        return k_scale.expand(num_kv_heads).contiguous(), v_scale.expand(num_kv_heads).contiguous()
    if mode == "contiguous":
        return k_scale.contiguous(), v_scale.contiguous()
    return k_scale, v_scale
