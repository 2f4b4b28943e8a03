"""The pass manager: which passes run, in which order, and the FX-graph-cache key that covers them.

Order (`PASSES`):

1. `decode_to_paged`: a decode step's SDPA (one query over a `[B, H, S, D]` cache) onto
   `attn::paged_decode`, reading the cache in place.
2. `sdpa_to_attn`: attention (SDPA, matmul-softmax-matmul) onto `attn::context_attention`.
3. `rope_fusion`: RoPE of q and k into that op, or into `attn::kv_cache_write` before a paged
   attention (reads the attention nodes the first pass made).
4. `fp8_output`: static FP8 quantization of an attention's output into its `out_scale`.
5. `qkv_fusion`: the q, k, v projections of one input into one GEMM and a split (only under
   `torch._inductor.config.freezing`, which folds the weight concatenation at compile time).

A pass is a module with `apply(graph: torch.fx.Graph) -> int` that rewrites Dynamo's torch-level
graph in place and returns its number of rewrites; it logs why it declined a candidate on a child
of the `fx_passes` logger and counts it in `counters["attn"]["<pass>_declined"]`.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable

import torch.fx as fx
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from . import decode_to_paged, fp8_output, qkv_fusion, rope_fusion, sdpa_to_attn


@dataclasses.dataclass(frozen=True)
class PassConfig:
    """One switch per pass, named after its module."""

    decode_to_paged: bool = True
    sdpa_to_attn: bool = True
    rope_fusion: bool = True
    fp8_output: bool = True
    qkv_fusion: bool = True


PASSES: dict[str, Callable[[fx.Graph], int]] = {
    "decode_to_paged": decode_to_paged.apply,
    "sdpa_to_attn": sdpa_to_attn.apply,
    "rope_fusion": rope_fusion.apply,
    "fp8_output": fp8_output.apply,
    "qkv_fusion": qkv_fusion.apply,
}

_SOURCES = tuple(sorted(str(p) for p in Path(__file__).parent.glob("*.py")))


class PassManager(CustomGraphPass):
    """Runs `user_passes` (what the hook held before; they see the graph as Dynamo made it),
    then the passes `config` enables, counting matches in
    `torch._dynamo.utils.counters["attn"]["<pass>_matched"]` and the microseconds each pass
    took in `counters["attn"]["<pass>_us"]` (compile-time overhead, summed over graphs)."""

    def __init__(self, config: PassConfig | None = None, user_passes: tuple[Callable, ...] = ()):
        self.config = config or PassConfig()
        self.user_passes = tuple(user_passes)

    def __call__(self, graph: fx.Graph) -> None:
        for user_pass in self.user_passes:
            user_pass(graph)
        for name, apply in PASSES.items():
            if getattr(self.config, name):
                start = time.perf_counter()
                counters["attn"][f"{name}_matched"] += apply(graph)
                counters["attn"][f"{name}_us"] += round((time.perf_counter() - start) * 1e6)

    def uuid(self) -> Any:
        """A hash of this package's sources, the config and the user passes' uuids; None (no
        caching, as Inductor does for them) if a user pass has no uuid."""
        user = [p.uuid() if isinstance(p, CustomGraphPass) else None for p in self.user_passes]
        if None in user:
            return None
        return get_hash_for_files(_SOURCES, extra=repr((self.config, user))).hex()
