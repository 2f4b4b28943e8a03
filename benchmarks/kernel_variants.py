"""The Triton kernel variants a serving run compiles, counted on any machine without compiling or
launching one (CPU included).

It builds `examples/serve.py`'s engine (its GPU defaults, a one-layer model of the same attention
geometry) and runs its workload with every Triton launch recorded by the key Triton compiles
under, and skipped: the kernel, its constexprs and launch options, each tensor's dtype and
16-byte alignment, each integer's width and, unless the kernel marks it `do_not_specialize`,
whether it is 1 or a multiple of 16. Launch decisions see a GPU of `--sms` SMs. It prints the
variants that the engine's construction (its CUDA-graph decode buckets), `Engine.warmup()` and
serving each add: a run on a fresh Triton cache compiles the sum, and serving adds none when
warm-up covers it.

    python benchmarks/kernel_variants.py [--sms 132] [examples/serve.py options]
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
from pathlib import Path

import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

import torch_ops.kernels  # noqa: E402
from torch_ops import gpu  # noqa: E402
from torch_ops.kernels import launcher  # noqa: E402
from torch_ops.serving import engine as engine_module  # noqa: E402

# the kernel modules whose launch decisions ask whether they run on the interpreter or how many SMs
DECIDING = ("paged_decode", "kv_cache_write", "prefill_attention", "context_attention", "merge_states", "launcher")


def _integer(value: int, specialize: bool) -> tuple:
    width = "i32" if -2**31 <= value < 2**31 else "i64" if value < 2**63 else "u64"
    return (width, value == 1, value % 16 == 0) if specialize else (width,)


def _params(fn) -> list[tuple[str, bool, bool, object]]:
    """(name, constexpr, do_not_specialize, default) of each parameter of a Triton kernel, compiled
    (`JITFunction`) or interpreted (TRITON_INTERPRET=1)."""
    if hasattr(fn, "params"):
        return [(p.name, p.is_constexpr, p.do_not_specialize, p.default) for p in fn.params]
    plain = set(fn.kwargs.get("do_not_specialize") or ())
    return [(name, "constexpr" in str(p.annotation), name in plain, None if p.default is p.empty else p.default)
            for name, p in inspect.signature(fn.fn).parameters.items()]


def variant_key(fn, args: tuple, meta: dict) -> tuple:
    """What Triton compiles `fn(*args, **meta)` under (see the module docstring)."""
    params = _params(fn)
    values = dict(zip((name for name, *_ in params), args))
    values.update(meta)
    spec = []
    for name, constexpr, plain, default in params:
        v = values.get(name, default)
        if constexpr:
            spec.append(v)
        elif isinstance(v, torch.Tensor):
            spec.append((v.dtype, v.data_ptr() % 16 == 0))
        elif isinstance(v, bool) or v is None:
            spec.append(v)
        elif isinstance(v, int):
            spec.append(_integer(v, not plain))
        else:
            spec.append(type(v).__name__)
    names = {name for name, *_ in params}
    options = tuple(sorted((k, v) for k, v in meta.items() if k not in names))
    return fn.__name__, tuple(spec), options


@contextlib.contextmanager
def census(sms: int):
    """Record every Triton launch's `variant_key` into the yielded set instead of launching it;
    launch decisions see a GPU (no interpreter) of `sms` SMs, while the triton backend takes CPU
    tensors as if they ran on its interpreter."""
    seen: set[tuple] = set()
    modules = [importlib.import_module(f"torch_ops.kernels.{m}") for m in DECIDING]
    saved = [(m, "interpreting", m.interpreting) for m in modules if hasattr(m, "interpreting")]
    saved += [(torch_ops.kernels, "interpreting", torch_ops.kernels.interpreting), (gpu, "sm_count", gpu.sm_count)]
    call, runs = launcher.TritonLaunch.__call__, (JITFunction.run, InterpretedFunction.run)

    def record(self, *tensors):
        seen.add(variant_key(self.fn, (*tensors, *self.scalars), self.meta))

    def record_jit(self, *args, grid, warmup, **kwargs):
        seen.add(variant_key(self, args, kwargs))

    try:
        for m, name, _ in saved:
            setattr(m, name, (lambda *a, **k: False) if name == "interpreting" else (lambda *a, **k: sms))
        torch_ops.kernels.interpreting = lambda: True
        launcher.TritonLaunch.__call__ = record
        JITFunction.run = InterpretedFunction.run = record_jit
        yield seen
    finally:
        launcher.TritonLaunch.__call__ = call
        JITFunction.run, InterpretedFunction.run = runs
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
    "graphs" (construction), "warmup" and "serving" (each: those the phases before lacked)."""
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
    with census(sms) as seen:
        if not args.no_graphs:
            engine.buckets = tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= args.max_num_seqs)
            capture, engine_module.capture_cuda_graph = engine_module.capture_cuda_graph, _capture
            try:
                engine._capture_graphs()
            finally:
                engine_module.capture_cuda_graph = capture
        phases["graphs"], total = set(seen), set(seen)
        engine.warmup(progress=False)
        phases["warmup"], total = seen - total, set(seen)
        requests, arrivals = serve.make_requests(args, config.vocab_size)
        generate(engine, requests, arrivals)
        phases["serving"] = seen - total
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
