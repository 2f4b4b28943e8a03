"""Inductor passes that rewrite model attention onto `torch.ops.attn.*`.

    import fx_passes
    fx_passes.enable()                      # or: with fx_passes.enabled(PassConfig(...)):
    compiled = torch.compile(model)         # rewrites on its first call, under torch.no_grad()

Importing changes no global config. `enable()` installs one `PassManager` in
`torch._inductor.config.pre_grad_custom_pass`, running whatever pass was installed there before
(first, on the graph as Dynamo made it); `disable()` puts back exactly the previous value.

Why the pre-grad hook: it sees Dynamo's torch-level graph, where `F.scaled_dot_product_attention`
is one node with the user's arguments. In the joint and post-grad ATen graphs SDPA is already
lowered to a device-, dtype- and version-specific op (flash for CPU, cuDNN, efficient, or the math
decomposition), and Inductor's `fuse_attention` has rewritten matmul-softmax-matmul spellings.
It is also the only hook before AOTAutograd traces the graph, so a replacement can be a plain
Python function over fake tensors with symbolic sizes. Caching stays correct: on torch 2.11 the
pass runs before the AOTAutograd and FX-graph cache keys are computed from the graph; from 2.13 a
pass with a `uuid()` runs after the cache lookup and its uuid is part of the key.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import torch._inductor.config as inductor_config

from .manager import PASSES, PassConfig, PassManager

HOOK = "pre_grad_custom_pass"


@dataclasses.dataclass(frozen=True)
class _Installed:
    manager: PassManager
    previous: Any  # what the hook held before enable()


_installed: _Installed | None = None


def enable(config: PassConfig | None = None) -> PassManager:
    """Install the pass manager (or reconfigure the installed one); returns it."""
    global _installed
    current = getattr(inductor_config, HOOK)
    if _installed is not None:
        _check_hook_unchanged()
        previous = _installed.previous
    else:
        previous = current
    manager = PassManager(config, user_passes=_as_passes(previous))
    setattr(inductor_config, HOOK, manager)
    _installed = _Installed(manager, previous)
    return manager


def disable() -> None:
    """Put back what the hook held before `enable()`; a no-op if not enabled."""
    global _installed
    if _installed is None:
        return
    _check_hook_unchanged()
    setattr(inductor_config, HOOK, _installed.previous)
    _installed = None


@contextlib.contextmanager
def enabled(config: PassConfig | None = None) -> Iterator[PassManager]:
    """`enable(config)` for the duration of a block, then back to the state before it."""
    global _installed
    outer, hook_before = _installed, getattr(inductor_config, HOOK)
    manager = enable(config)
    try:
        yield manager
    finally:
        _check_hook_unchanged()
        setattr(inductor_config, HOOK, hook_before)
        _installed = outer


def _check_hook_unchanged() -> None:
    if getattr(inductor_config, HOOK) is not _installed.manager:
        raise RuntimeError(f"torch._inductor.config.{HOOK} was changed after fx_passes.enable(); "
                           "not overwriting it (restore it before calling disable())")


def _as_passes(hook_value: Any) -> tuple:
    if hook_value is None:
        return ()
    return tuple(hook_value) if isinstance(hook_value, (list, tuple)) else (hook_value,)


__all__ = ["HOOK", "PASSES", "PassConfig", "PassManager", "disable", "enable", "enabled"]
