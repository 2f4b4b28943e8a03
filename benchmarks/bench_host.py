"""Host time per eager call of every `torch.ops.attn` op, as a user pays it, next to its device time.

Usage (GPU machine):  python benchmarks/bench_host.py [--quick] [--iters N] [--batch B] [--ctx L] [--out PATH]
  --out     a .json file, or a folder (default benchmarks/results/) that gets bench_host_<gpu>_<stamp>.json
  --quick   100 calls a loop, 5 loops, 5 graph replays
Prints a table last; JSON: {"env", "args", "shape", "iters", "repeats", "backends", "rows": [...]}, a row per
(op, variant, backend) with host_us, wall_us, device_us, device_timing, bound, first_ms (automatic
choice and peers), chosen and replan_us (automatic choice), or "na" / "error" with the reason.

Method
* Tiny problems so that the host (op dispatch, the Python front's checks, the backend choice,
  output allocation, launches) dominates: B = 32 sequences of 256 keys, 32/8 heads, D = 128,
  16-token pages; prefill 4 sequences of 64 queries over the cache; context 256 tokens, causal.
* host_us: time.perf_counter time per call, median over `repeats` rounds of `iters` calls made
  in bursts of 16 that each start after a sync (so that a full launch queue never holds the
  host back), after warm-up; wall_us: `iters` calls back to back up to one
  torch.cuda.synchronize() at their end (about max(host, device) per call).
* device_us: the same call in a CUDA graph of 20 calls (common.time_us; device_timing says when it
  fell back to eager do_bench). bound = "host" when host_us > device_us.
* first_ms: the row's first call in this process including a sync (compile, library load, plan):
  rows run in order, so a kernel built for an earlier row is not paid again, and a second run
  loads Triton kernels from its on-disk cache instead of compiling them. replan_us (where
  torch_ops.backends has a plan cache, `clear_plans`): the next call after clearing it, kernels
  already loaded: the per-signature planning cost alone.
* Each op runs on the automatic choice (backend "auto"), the same with every call through the
  Python front ("auto/python", ATTN_REPLAY=0), and pinned on every backend but vanilla; one that
  cannot serve the call ("cannot run" ValueError) is "n/a" with its reason. replayed ("C++"): the
  share of the timed calls that the C++ front replayed (torch_ops/replay.py).
* Peers, same process and shapes: FlashInfer BatchDecodeWithPagedKVCacheWrapper (bf16, FP8) and
  BatchPrefillWithPagedKVCacheWrapper, run() timed after one plan() (first_ms = plan + first run);
  SDPA with enable_gqa on [B, Hq, 1, D] x [B, Hkv, ctx, D]. Peers return no lse; ours always do.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

import torch_ops  # noqa: E402
from torch_ops import backends, kv_cache, ops, replay  # noqa: E402

FORMATS = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "int8": torch.int8, "int4": torch.uint8}


@dataclass
class Shape:
    batch: int = 32
    ctx: int = 256
    hq: int = 32
    hkv: int = 8
    d: int = 128
    page: int = 16
    prefill_seqs: int = 4
    prefill_q: int = 64

    @property
    def blocks(self) -> int:
        return -(-self.ctx // self.page)

    @property
    def group(self) -> int:
        return min(32, self.d)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@dataclass
class Config:
    iters: int = 200
    repeats: int = 5
    warmup: int = 10
    replays: int = 15
    sync: Callable[[], None] = _sync
    device_time: Callable = common.time_us   # (fns, replays=) -> (µs per call, method)


# --- inputs: each builder returns (args, kwargs) of one call ------------------------------------


def _randn(device, *shape, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(shape, dtype=dtype, device=device)


def paged(sh: Shape, fmt: str, device):
    """A random cache of `fmt`, a random block table, full lengths; scales as op kwargs."""
    group = sh.group if fmt in ("int8", "int4") else None
    cache = kv_cache.PagedKVCache.allocate(sh.batch * sh.blocks, sh.page, sh.hkv, sh.d, FORMATS[fmt],
                                           quant_group=group, scale_dtype=torch.float16, device=device)
    kv_cache.random_(cache)
    tables = torch.randperm(sh.batch * sh.blocks, device=device).to(torch.int32).view(sh.batch, sh.blocks)
    lens = torch.full((sh.batch,), sh.ctx, dtype=torch.int32, device=device)
    scales = {k: v for k, v in cache.scale_kwargs().items() if v is not None}
    return cache, tables, lens, scales


def paged_decode(variant, sh, device):
    cache, tables, lens, kw = paged(sh, variant if variant in FORMATS else "bf16", device)
    if variant == "bf16 out_scale":
        kw["out_scale"] = torch.tensor(0.05, device=device)
    elif variant == "options: window+softcap":
        kw.update(window_left=sh.ctx // 2, softcap=30.0)
    elif variant == "options: alibi":
        kw["alibi_slopes"] = ops.alibi_slopes(sh.hq).to(device)
    return (_randn(device, sh.batch, sh.hq, sh.d), cache.k, cache.v, tables, lens), kw


def paged_prefill(variant, sh, device):
    cache, tables, lens, kw = paged(sh, "bf16", device)
    n, q = min(sh.prefill_seqs, sh.batch), min(sh.prefill_q, sh.ctx)
    cu = torch.arange(n + 1, dtype=torch.int32, device=device) * q
    return (_randn(device, n * q, sh.hq, sh.d), cache.k, cache.v, tables[:n], cu, lens[:n]), {"causal": True}


def context_attention(variant, sh, device):
    cu = torch.tensor([0, sh.ctx], dtype=torch.int32, device=device)
    q, k, v = (_randn(device, sh.ctx, h, sh.d) for h in (sh.hq, sh.hkv, sh.hkv))
    return (q, k, v, cu, cu), {"causal": True}


def kv_cache_write(variant, sh, device):
    """One decode step's write: one token per sequence at its last position."""
    cache, tables, lens, kw = paged(sh, "fp8" if variant == "fp8" else "bf16", device)
    pos = sh.ctx - 1
    slots = tables[:, pos // sh.page] * sh.page + pos % sh.page
    if variant == "bf16 + rope":
        inv_freq = 10000.0 ** (-torch.arange(0, sh.d, 2, dtype=torch.float32, device=device) / sh.d)
        angles = torch.arange(sh.ctx, dtype=torch.float32, device=device)[:, None] * inv_freq
        kw.update(query=_randn(device, sh.batch, sh.hq, sh.d), cos_sin_cache=torch.cat([angles.cos(), angles.sin()], -1),
                  positions=torch.full((sh.batch,), pos, dtype=torch.int32, device=device))
    key, value = _randn(device, sh.batch, sh.hkv, sh.d), _randn(device, sh.batch, sh.hkv, sh.d)
    return (key, value, cache.k, cache.v, slots.contiguous()), kw


def merge_states(variant, sh, device):
    def state():
        return _randn(device, sh.batch, sh.hq, sh.d), torch.randn(sh.batch, sh.hq, device=device)
    return (*state(), *state()), {}


def cache_attention(variant, sh, device):
    """PPL decode step, layout 0, one layer: one new token per sequence. "fp16 decode offset": an
    fp16 cache in offset mode; "int8 decode paged": an INT8 cache (groups of 8, fp16 scales) in
    page-table mode, `sh.page`-row pages in order."""
    b, idx = sh.batch, dict(dtype=torch.int32, device=device)
    seq = torch.arange(b + 1, **idx)
    shape = (b * sh.ctx, 1, 2, sh.hkv, sh.d)
    q, k, v = (_randn(device, b, h, sh.d, dtype=torch.float16) for h in (sh.hq, sh.hkv, sh.hkv))
    kw = dict(num_heads=sh.hq, head_dim=sh.d, num_kv_heads=sh.hkv, is_causal=True)
    if variant == "int8 decode paged":
        cache = torch.randint(-127, 128, shape, dtype=torch.int8, device=device)
        scale = torch.rand(*shape[:-1], sh.d // 8, dtype=torch.float16, device=device) / 64
        pages = torch.arange(b * sh.blocks, **idx).view(b, sh.blocks) * sh.page
        kw.update(quant_bit=8, quant_group=8, cache_mode=1, page_size=sh.page)
    else:
        cache = torch.randn(shape, dtype=torch.float16, device=device)
        scale, pages = None, seq[:-1] * sh.ctx
    args = (q, k, v, seq, seq * sh.ctx, pages, torch.full((b,), sh.ctx - 1, **idx),
            torch.tensor([b], **idx), 1, sh.ctx, cache, scale, None)
    return args, kw


VARIANTS = {
    "paged_decode": ["bf16", "fp8", "int8", "int4", "bf16 out_scale", "options: window+softcap", "options: alibi"],
    "paged_prefill": ["bf16 causal"],
    "context_attention": ["bf16 causal"],
    "kv_cache_write": ["bf16", "fp8", "bf16 + rope"],
    "merge_states": ["bf16"],
    "cache_attention": ["fp16 decode offset", "int8 decode paged"],
}
BUILDERS = {op: globals()[op] for op in VARIANTS}


# --- calls: make() builds inputs and returns plan(); plan() does one-time work, returns the call ---


def ours(op: str, variant: str, sh: Shape, device="cuda"):
    def make():
        args, kwargs = BUILDERS[op](variant, sh, device)
        return lambda: functools.partial(getattr(torch.ops.attn, op), *args, **kwargs)
    return make


def _fi_pages(sh: Shape, tables: torch.Tensor):
    n = tables.shape[0]
    indptr = torch.arange(n + 1, dtype=torch.int32, device=tables.device) * sh.blocks
    last = torch.full((n,), sh.ctx - (sh.blocks - 1) * sh.page, dtype=torch.int32, device=tables.device)
    return indptr, tables.flatten().contiguous(), last


def flashinfer_decode(variant, sh):
    def make():
        import flashinfer

        (q, k, v, tables, _), kw = paged_decode(variant, sh, "cuda")
        scales = {n: float(kw[n]) for n in ("k_scale", "v_scale") if n in kw}
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(common.flashinfer_workspace(), "NHD")

        def plan():
            w.plan(*_fi_pages(sh, tables), sh.hq, sh.hkv, sh.d, sh.page, q_data_type=q.dtype, kv_data_type=k.dtype)
            return lambda: w.run(q, (k, v), **scales)
        return plan
    return make


def flashinfer_prefill(variant, sh):
    def make():
        import flashinfer

        (q, k, v, tables, cu, _), _ = paged_prefill(variant, sh, "cuda")
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(common.flashinfer_workspace(), "NHD")

        def plan():
            w.plan(cu, *_fi_pages(sh, tables), sh.hq, sh.hkv, sh.d, sh.page, causal=True, q_data_type=q.dtype)
            return lambda: w.run(q, (k, v))
        return plan
    return make


def sdpa_decode(variant, sh):
    def make():
        q = _randn("cuda", sh.batch, sh.hq, 1, sh.d)
        k, v = _randn("cuda", sh.batch, sh.hkv, sh.ctx, sh.d), _randn("cuda", sh.batch, sh.hkv, sh.ctx, sh.d)
        return lambda: lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    return make


PEERS = {
    ("paged_decode", "bf16"): [("flashinfer", flashinfer_decode), ("sdpa", sdpa_decode)],
    ("paged_decode", "fp8"): [("flashinfer", flashinfer_decode)],
    ("paged_prefill", "bf16 causal"): [("flashinfer", flashinfer_prefill)],
}


# --- measurement -------------------------------------------------------------------------------


BURST = 16   # calls between syncs while timing the host: the GPU's launch queue never fills


def host_time_us(fn, iters: int, repeats: int, sync=_sync) -> tuple[float, float]:
    """Median µs per call over `repeats` rounds of `iters` calls: (the calls alone, timed in bursts
    of `BURST` that each start on an idle GPU; the calls back to back up to one sync)."""
    host, wall = [], []
    for _ in range(repeats):
        spent = 0.0
        for start in range(0, iters, BURST):
            sync()
            t0 = time.perf_counter()
            for _ in range(min(BURST, iters - start)):
                fn()
            spent += time.perf_counter() - t0
        host.append(spent * 1e6 / iters)
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        wall.append((time.perf_counter() - t0) * 1e6 / iters)
    return statistics.median(host), statistics.median(wall)


def _chosen(op: str, call: functools.partial) -> str:
    try:
        return torch_ops.backend_for(op, *call.args, **call.keywords)
    except Exception as e:  # noqa: BLE001 - the row keeps its times
        return f"unknown ({type(e).__name__}: {str(e)[:100]})"


PYTHON_FRONT = "auto/python"   # the automatic choice with every call through the Python front


@contextlib.contextmanager
def _front(pin: str | None):
    """Run with `pin` requested; PYTHON_FRONT turns the C++ front's replays off (ATTN_REPLAY=0)."""
    if pin != PYTHON_FRONT:
        with torch_ops.use_backend(pin):
            yield
        return
    os.environ["ATTN_REPLAY"] = "0"
    backends.clear_plans()
    try:
        yield
    finally:
        del os.environ["ATTN_REPLAY"]
        backends.clear_plans()


def measure(base: dict, make, cfg: Config, pin: str | None = None) -> dict:
    """One row: first call, host loop, device time, on backend `pin` (None: automatic choice).
    Never raises: a backend that cannot serve the call gives "na", any other failure "error"."""
    row = dict(base)
    try:
        with _front(pin):
            plan = make()
            cfg.sync()
            t0 = time.perf_counter()
            fn = plan()
            fn()
            cfg.sync()
            if pin is None:
                row["first_ms"] = (time.perf_counter() - t0) * 1e3
                if isinstance(fn, functools.partial):
                    row["chosen"] = _chosen(base["op"], fn)
            clear_plans = getattr(backends, "clear_plans", None)
            if pin is None and clear_plans is not None:
                clear_plans()
                t0 = time.perf_counter()
                fn()
                cfg.sync()
                row["replan_us"] = (time.perf_counter() - t0) * 1e6
            for _ in range(cfg.warmup):
                fn()
            before = replay.counters()["replayed"]
            row["host_us"], row["wall_us"] = host_time_us(fn, cfg.iters, cfg.repeats, cfg.sync)
            row["replayed"] = (replay.counters()["replayed"] - before) / (2 * cfg.iters * cfg.repeats)   # host_time_us makes 2 x iters calls per repeat
            row["device_us"], row["device_timing"] = cfg.device_time([fn], replays=cfg.replays)
            row["bound"] = "host" if row["host_us"] > row["device_us"] else "device"
    except ValueError as e:
        if pin is not None and "cannot run" in str(e):
            row["na"] = str(e)
        else:
            row["error"] = f"ValueError: {str(e)[:300]}"
    except ImportError as e:
        row["na"] = f"not installed: {str(e)[:200]}"
    except Exception as e:  # noqa: BLE001 - one failing row never loses the others
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


def plan_rows(sh: Shape, pinned: list[str]):
    """(base row, make, pin) for every op x variant x backend, then the variant's peers."""
    for op, variants in VARIANTS.items():
        for variant in variants:
            for pin in [None, PYTHON_FRONT, *pinned]:
                yield {"op": op, "variant": variant, "backend": pin or "auto"}, ours(op, variant, sh), pin
            for peer, factory in PEERS.get((op, variant), []):
                yield {"op": op, "variant": variant, "backend": peer}, factory(variant, sh), None


COLUMNS = [("op", "op", "s"), ("variant", "variant", "s"), ("backend", "backend", "s"), ("host_us", "host us", ".1f"),
           ("wall_us", "wall us", ".1f"), ("device_us", "device us", ".1f"), ("bound", "bound", "s"),
           ("first_ms", "first ms", ".1f"), ("replan_us", "replan us", ".0f"), ("replayed", "C++", ".2f"),
           ("note", "note", "s")]


def format_table(rows: list[dict]) -> str:
    """Fixed-width table: strings left-aligned, numbers right-aligned; note = chosen backend, n/a or error."""
    cells = []
    for r in rows:
        note = (f"n/a: {r['na']}" if "na" in r else f"error: {r['error']}" if "error" in r
                else f"-> {r['chosen']}" if "chosen" in r else "")
        r = {**r, "note": note[:70]}
        cells.append([("-" if r.get(k) is None else r[k] if f == "s" else format(r[k], f)) for k, _, f in COLUMNS])
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (_, h, _) in enumerate(COLUMNS)]

    def line(values):
        return "  ".join(v.ljust(w) if f == "s" else v.rjust(w)
                         for v, w, (_, _, f) in zip(values, widths, COLUMNS)).rstrip()
    return "\n".join([line([h for _, h, _ in COLUMNS])] + [line(c) for c in cells])


def profile(names: list[str], sh: Shape, calls: int = 2000) -> int:
    """Print the functions that take the host time of each named row's calls (Python and C calls)."""
    import cProfile
    import pstats

    for name in names:
        op, variant, *pin = name.split(":")
        call = ours(op, variant, sh)()()
        with torch_ops.use_backend(pin[0] if pin else None):
            for _ in range(20):
                call()
            _sync()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(calls):
                call()
            prof.disable()
            _sync()
        print(f"# {name}: {calls} calls")
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"),
                   help="a .json file, or a folder for bench_host_<gpu>_<stamp>.json")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--iters", type=int, help="calls per timed loop (default 200, --quick 100)")
    p.add_argument("--batch", type=int, default=Shape.batch)
    p.add_argument("--ctx", type=int, default=Shape.ctx)
    p.add_argument("--profile", nargs="*", metavar="OP:VARIANT[:BACKEND]",
                   help="instead of the table: cProfile 2000 calls of each row named (e.g. paged_decode:bf16:cuda)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_host needs a CUDA GPU")
        return 1
    warmup_s = torch_ops.warmup()
    if args.profile is not None:
        return profile(args.profile, Shape(batch=args.batch, ctx=args.ctx))   # the libraries the automatic choice uses once built
    sh = Shape(batch=args.batch, ctx=args.ctx)
    cfg = Config(iters=args.iters or (100 if args.quick else 200), repeats=5,
                 replays=5 if args.quick else 15)
    pinned = [n for n in backends.backend_names() if n != "vanilla"]
    env = common.environment()
    print(f"# {env.get('gpu')}  torch {env['torch']}  triton {env['triton']}  flashinfer {env['flashinfer']}", flush=True)
    rows: list[dict] = []
    payload = {"env": env, "args": vars(args), "shape": asdict(sh), "iters": cfg.iters, "burst": BURST, "repeats": cfg.repeats,
               "backends": pinned, "warmup_s": warmup_s, "rows": rows}
    out = Path(args.out)
    out_dir = out.parent if out.suffix == ".json" else out
    for base, make, pin in plan_rows(sh, pinned):
        rows.append(measure(base, make, cfg, pin))
        print(format_table(rows[-1:]).splitlines()[-1], flush=True)
        common.write_partial(out_dir, "bench_host", payload)
    if out.suffix == ".json":
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(payload, indent=1, default=str))
        path = out
    else:
        path = common.write_json(out, "bench_host", payload)
    print(f"# wrote {path}\n" + format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
