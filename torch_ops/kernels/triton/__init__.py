"""Triton kernels served through the `triton` backend.

Each op has a module exposing `unsupported(*args, **kwargs) -> list[str]` (reasons it cannot run
a call; empty if it can) and `run(*args, **kwargs)` with the op's arguments (attention ops also
get their `out`/`lse` buffers to fill); most also have `prepare(*args, **kwargs) -> launch`, the
work that depends only on the call's signature, after which `launch(*args, **kwargs)` runs a
call of that signature (`launcher.TritonLaunch`). Ops that share a kernel family keep thin op modules over
one family file (`prefill_attention.py`). Modules are imported on first use, so
`import torch_ops` does not import Triton.
"""

from __future__ import annotations

import importlib
import os

KERNEL_MODULES = {
    "paged_decode": "torch_ops.kernels.triton.paged_decode",
    "paged_prefill": "torch_ops.kernels.triton.paged_prefill",
    "context_attention": "torch_ops.kernels.triton.context_attention",
    "kv_cache_write": "torch_ops.kernels.triton.kv_cache_write",
    "merge_states": "torch_ops.kernels.triton.merge_states",
    "cache_attention": "torch_ops.kernels.triton.cache_attention",
}


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def interpreting() -> bool:
    """Triton's CPU interpreter is on (TRITON_INTERPRET=1): kernels run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class TritonBackend:
    name = "triton"
    auto_devices = ("cuda",)

    def reasons(self, op, args, kwargs):
        if op not in KERNEL_MODULES:
            return [f"no Triton kernel for attn::{op} yet"]
        device = args[0].device.type
        if device != "cuda" and not (device == "cpu" and interpreting()):
            return [f"Triton kernels need CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), got {device}"]
        return self._module(op).unsupported(*args, **kwargs)

    def run(self, op, args, kwargs):
        return self._module(op).run(*args, **kwargs)

    def prepare(self, op, args, kwargs):
        module = self._module(op)
        return module.prepare(*args, **kwargs) if hasattr(module, "prepare") else None

    @staticmethod
    def _module(op):
        return importlib.import_module(KERNEL_MODULES[op])
