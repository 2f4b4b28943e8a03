"""The Triton kernel variants a serving run compiles, counted on any machine without compiling or
launching one (CPU included).

It builds `examples/serve.py`'s engine (its GPU defaults, a one-layer model of the same attention
geometry) and runs its workload with every Triton launch recorded by the key Triton compiles
under, and skipped: the kernel, its constexprs and launch options, each tensor's dtype and
16-byte alignment, each integer's width and, unless the kernel marks it `do_not_specialize`,
whether it is 1 or a multiple of 16 (`torch_ops.kernels.triton.precompile.variant_key`). Launch
decisions see a GPU of `--sms` SMs. It prints the variants that the engine's CUDA-graph decode
buckets, the rest of `Engine.warmup()` and serving each add: the variants a run on a
fresh Triton cache compiles, and serving adds none when warm-up covers it. (On an H200, torch
2.11 / Triton 3.6, a fresh cache after `serve.py` held the 20 compiled kernels this counts.)

    python benchmarks/kernel_variants.py [--sms 132] [examples/serve.py options]
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import torch_ops.kernels.triton  # noqa: E402
from torch_ops import gpu  # noqa: E402
from torch_ops.kernels.triton import precompile  # noqa: E402
from torch_ops.serving import engine as engine_module  # noqa: E402

# the kernel modules whose launch decisions ask whether they run on the interpreter
DECIDING = ("paged_decode", "kv_cache_write", "prefill_attention", "context_attention", "merge_states", "launcher")


@contextlib.contextmanager
def census(sms: int):
    """Record the block's Triton launches (`precompile.recorded`, yielded) instead of running
    them; launch decisions see a GPU (no interpreter) of `sms` SMs, while the triton backend takes
    CPU tensors as if they ran on its interpreter."""
    modules = [importlib.import_module(f"torch_ops.kernels.triton.{m}") for m in DECIDING]
    saved = [(m, "interpreting", m.interpreting) for m in modules if hasattr(m, "interpreting")]
    triton_backend = torch_ops.kernels.triton
    saved += [(gpu, "sm_count", gpu.sm_count), (triton_backend, "interpreting", triton_backend.interpreting)]
    try:
        for m in modules:
            if hasattr(m, "interpreting"):
                m.interpreting = lambda *a, **k: False
        gpu.sm_count = lambda *a, **k: sms
        triton_backend.interpreting = lambda: True
        with precompile.recorded() as launches:
            yield launches
    finally:
        for m, name, value in saved:
            setattr(m, name, value)


class _Replayed:
    """Stands in for a captured CUDA graph: `replay()` runs the captured function again."""

    def __init__(self, fn):
        self.replay = fn


def _capture(fn):
    return _Replayed(fn), fn()


def serving_variants(argv: list[str] | None = None, sms: int = 132) -> dict[str, set]:
    """The variants `examples/serve.py` (GPU defaults, `argv` its options) compiles, by phase:
    "graphs" (the decode graphs), "warmup" and "serving" (each: those the phases before lacked)."""
    import serve

    from torch_ops.serving.engine import generate
    from torch_ops.serving.model import LlamaConfig

    args = serve.arg_parser(True, "").parse_args(argv or [])
    g = serve.GPU_MODEL
    config = LlamaConfig(vocab_size=256, hidden_size=128, num_layers=1, num_heads=g.num_heads,
                         num_kv_heads=g.num_kv_heads, head_dim=g.head_dim, intermediate_size=128,
                         max_position=g.max_position)
    engine = serve.build(config, args.backend, torch.device("cpu"), torch.bfloat16, args, graphs=False)
    phases, total = {}, set()
    with census(sms) as launches:
        def new() -> set:
            seen = {launch.variant for launch in launches}
            return seen - total

        if not args.no_graphs:
            engine.buckets = tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= args.max_num_seqs)
            capture, engine_module.capture_cuda_graph = engine_module.capture_cuda_graph, _capture
            try:
                engine.capture_graphs()
            finally:
                engine_module.capture_cuda_graph = capture
        phases["graphs"] = new()
        total |= phases["graphs"]
        engine.warmup(progress=False)
        phases["warmup"] = new()
        total |= phases["warmup"]
        requests, arrivals = serve.make_requests(args, config.vocab_size)
        generate(engine, requests, arrivals)
        phases["serving"] = new()
    return phases


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    sms = 132
    if "--sms" in argv:
        i = argv.index("--sms")
        sms = int(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    phases = serving_variants(argv, sms)
    for phase, keys in phases.items():
        names = sorted(k[0] for k in keys)
        counts = {n: names.count(n) for n in dict.fromkeys(names)}
        print(f"{phase}: {len(keys)} new variants {counts}")
    print(f"total: {sum(map(len, phases.values()))} variants")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
