"""Shared benchmark helpers: timing (CUDA graphs of many calls, or triton's do_bench), device
ceilings, environment description and JSON output.

Timing rule: warm up, then replay a CUDA graph that holds `calls` back-to-back calls
(each on its own input set when a rotation is given, so repeated reads do not come from L2) and
take the median over replays, divided by `calls`. This measures GPU time including the launch
gaps a serving loop's graph has, and excludes Python dispatch.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import statistics
import subprocess
from pathlib import Path
from typing import Callable

import torch


# nominal limits per GPU (matched in its name): HBM TB/s, dense bf16 and FP8 tensor-core TFLOP/s
NOMINAL_LIMITS = {"H200": (4.8, 989, 1979), "H100": (3.35, 989, 1979)}


def nominal_limits(gpu: str) -> tuple[float, int, int]:
    """(HBM TB/s, dense bf16 TFLOP/s, dense FP8 TFLOP/s) of the GPU named `gpu` (an H200's if unknown)."""
    return next((v for k, v in NOMINAL_LIMITS.items() if k in gpu), NOMINAL_LIMITS["H200"])


def cuda_graph_time_us(fns: list[Callable[[], None]], *, calls: int = 20, replays: int = 15,
                       warmup: int = 2) -> float:
    """Median µs per call of `fns` (cycled: call i runs fns[i % len(fns)]) replayed in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            for f in fns:
                f()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)


def do_bench_us(fn: Callable[[], None]) -> float:
    """triton.testing.do_bench median in µs (eager launches: includes host launch cost)."""
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def time_us(fns: list[Callable[[], None]], **kw) -> tuple[float, str]:
    """CUDA-graph time, falling back to do_bench (first input set) if capture fails."""
    try:
        return cuda_graph_time_us(fns, **kw), "cuda_graph"
    except Exception as e:  # noqa: BLE001 - a peer that cannot be captured is timed eagerly
        torch.cuda.synchronize()
        return do_bench_us(fns[0]), f"do_bench ({type(e).__name__}: {str(e)[:80]})"


def time_long_us(fn: Callable[[], None]) -> tuple[float, str]:
    """Median µs per call (`time_us`) of a long call, with about 40 ms of work per graph replay."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        fn()
    end.record()
    end.synchronize()
    one = start.elapsed_time(end) * 1e3 / 3
    calls = int(max(1, min(20, 40_000 // max(one, 1.0))))
    return time_us([fn], calls=calls, replays=10 if one < 5000 else 5)


def machine() -> tuple[dict, dict]:
    """(`environment()`, `device_bandwidth()`), printed as a benchmark's first lines."""
    env = environment()
    print(f"# {env.get('gpu')}  torch {env['torch']}  triton {env['triton']}  flashinfer {env['flashinfer']}",
          flush=True)
    bw = device_bandwidth()
    print(f"# copy {bw['copy_GBps']:.0f} GB/s (read+write), read-only {bw['read_GBps']:.0f} GB/s", flush=True)
    return env, bw


def run_prepared(kernel_module, *args, **kwargs):
    """`kernel_module.prepare(*args, **kwargs)`, run once on those arguments (its kernels compiled):
    the launch whose `kernels` a benchmark reports."""
    launch = kernel_module.prepare(*args, **kwargs)
    launch(*args, **kwargs)
    return launch


def rotation_count(bytes_per_set: int, l2_bytes: int, budget_bytes: int = 8 << 30) -> int:
    """Input sets to rotate so that consecutive calls never hit in L2 (at least 3x L2 in total)."""
    if bytes_per_set >= 3 * l2_bytes:
        return 1
    n = -(-3 * l2_bytes // max(1, bytes_per_set))
    return int(max(1, min(n, 16, budget_bytes // max(1, bytes_per_set))))


def device_bandwidth() -> dict:
    """Measured ceilings: a large device-to-device copy ((read + write) bytes / time) and a
    read-only reduction (bytes read / time), in GB/s."""
    n = 1 << 30  # 2 GiB of bf16 per tensor
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    t_copy = cuda_graph_time_us([lambda: b.copy_(a)], calls=5, replays=10)
    out = torch.empty((), dtype=torch.float32, device="cuda")
    t_read = cuda_graph_time_us([lambda: torch.sum(a, dim=0, dtype=torch.float32, out=out)], calls=5, replays=10)
    bytes_ = a.numel() * a.element_size()
    res = {"copy_GBps": 2 * bytes_ / t_copy / 1e3, "read_GBps": bytes_ / t_read / 1e3,
           "copy_bytes": 2 * bytes_}
    del a, b
    torch.cuda.empty_cache()
    return res


def git_commit() -> str:
    """The commit that ran: `ATTN_GIT_COMMIT` (for a copy of the tree without git history), else
    `git rev-parse HEAD`, marked "+changes" when tracked files differ from it."""
    if os.environ.get("ATTN_GIT_COMMIT"):
        return os.environ["ATTN_GIT_COMMIT"]
    try:
        root = Path(__file__).resolve().parent.parent

        def git(*args):
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)

        head = git("rev-parse", "HEAD").stdout.strip() or "unknown"
        return head + ("+changes" if git("diff", "--quiet", "HEAD").returncode == 1 else "")
    except Exception:  # noqa: BLE001
        return "unknown"


def environment() -> dict:
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        env["triton"] = f"unavailable: {e}"
    try:
        import flashinfer

        env["flashinfer"] = getattr(flashinfer, "__version__", "unknown")
    except Exception as e:  # noqa: BLE001
        env["flashinfer"] = f"unavailable: {type(e).__name__}: {str(e)[:100]}"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, sm_count=p.multi_processor_count,
                   l2_bytes=getattr(p, "L2_cache_size", 0), gpu_memory_bytes=p.total_memory)
    return env


def write_json(out_dir: str | os.PathLike, name: str, payload: dict) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gpu = payload.get("env", {}).get("gpu", "cpu").replace(" ", "_")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = out / f"{name}_{gpu}_{stamp}.json"
    path.write_text(json.dumps(payload, indent=1, default=str))
    return path


def kv_bytes(seq_lens: list[int], num_kv_heads: int, head_dim: int, cache_dtype: torch.dtype,
             group: int | None = None, scale_bytes: int = 2) -> int:
    """Bytes a decode step must read from the KV cache: K and V of every key of every sequence
    (packed INT4: half a byte per element), plus INT8/INT4 group scales."""
    tokens = sum(seq_lens)
    if cache_dtype == torch.uint8:
        per_elem = 0.5
    else:
        per_elem = torch.empty((), dtype=cache_dtype).element_size()
    data = tokens * num_kv_heads * head_dim * per_elem * 2
    scales = tokens * num_kv_heads * (head_dim // group) * scale_bytes * 2 if group else 0
    return int(data + scales)


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Fixed-width text table; `columns` = (key, header, format)."""
    head = "  ".join(f"{h:>{max(len(h), 8)}}" for _, h, _ in columns)
    lines = [head]
    for r in rows:
        cells = []
        for key, h, fmt in columns:
            v = r.get(key)
            w = max(len(h), 8)
            cells.append(f"{'-' if v is None else format(v, fmt) if not isinstance(v, str) else v:>{w}}")
        lines.append("  ".join(cells))
    return "\n".join(lines)


def write_partial(out_dir, name: str, payload: dict) -> None:
    """Rewrite `<name>_partial.json` with everything measured so far (survives a killed run)."""
    try:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / f"{name}_partial.json").write_text(json.dumps(payload, indent=1, default=str))
    except OSError:
        pass


def run_check(check: Callable[[], dict]) -> dict:
    """The result of an accuracy check, or the error it raised (a benchmark row records either)."""
    try:
        return check()
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}


@functools.lru_cache(maxsize=None)
def flashinfer_workspace() -> torch.Tensor:
    """One 512 MB FlashInfer workspace, allocated once. Wrappers keep their plan in it: plan and
    run one wrapper at a time."""
    return torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
