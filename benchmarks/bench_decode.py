"""Paged decode attention: our Triton kernel (`torch.ops.attn.paged_decode`) against peers.

Usage (GPU machine):  python benchmarks/bench_decode.py [--quick] [--check] [--tune] [--out DIR]
  --quick         ~2-minute subset;  --batch/--ctx/--heads/--formats/--peers select a subset
  --check         verify each of our configurations against the reference once (max error)
  --tune          sweep tile configs / split knobs of our kernel on a few shapes first
  --warm-peers    only JIT-compile the FlashInfer variants used here (run it in the background)
Writes JSON (GPU, versions, date, commit, every measurement) under --out (default
benchmarks/results/) and prints a compact table last.

Notes: reasoning and expected numbers (H100 SXM 3.35 TB/s, H200 4.8 TB/s datasheet; the copy
measured here is the ceiling used for the percentages)
------------------------------------------------------------------------------------------------
* Bytes, not FLOPs. A decode step reads B * L * Hkv * D * 2 (K, V) elements once; with GQA 32/8
  and D=128 the arithmetic intensity is ~G * 2 * 2 FLOP per byte (8 FLOP/B for bf16 with G=4, the
  M=16 padding of the tensor-core tile makes it 32 executed FLOP/B): far under the ~200-300 FLOP/B
  ridge, so the floor is bytes / bandwidth. Example: B=64, L=4k, Hkv=8, bf16: 1.07 GB -> 250 us at
  4.3 TB/s; the 92 % target means <= ~270 us on an H200 (~390 us on an H100, ~3.0 TB/s).
* Bytes in flight. Little's law: ~4.3 TB/s x ~0.8-1 us of loaded latency = 3.5-4.5 MB in flight,
  i.e. ~30 KB per SM. Triton's pipeliner spends two stages on the block-table indirection, so
  num_stages=5 (the default) keeps two K+V tiles of each program in flight (seen in the TTGIR:
  3 buffers, `async_wait num=3`); at 3-4 stages only one. bf16 BLOCK_N=64, D=128: 72 KB of
  shared memory and 168 registers per 4-warp program -> 3 programs per SM -> ~190 KB in flight
  per SM. Quantized caches: one-warp programs of 16-key tiles, 9-13 KB, 8+ programs per SM, two
  16-key tiles per step in two copies of the query rows (168-238 registers).
* Launch / tail. B=1, L=1k, Hkv=8 is 4 MB: ~1 us of HBM time. The rest is fixed cost: the split
  kernel (8 KV heads x 4 splits of 256 keys = 32 programs, each 4 pipelined tiles, ~2-3 us) plus
  the merge kernel (~1-2 us incl. its launch gap in a graph). Expected ~4-7 us (target <= 10 us).
* Dequantization budget (SASS of the main loop, sm_90a, compiled on the CPU machine with Triton's
  ptxas/cuobjdump; warp-instructions per key per KV head): bf16 45.5 (4-warp programs), FP8 ~23,
  INT8 ~35, INT4 ~32 (one-warp 16-key tiles, two row copies). An SM issues 4
  warp-instructions per cycle; at 92 % of ~4.3 TB/s one key of one KV head (512 B bf16) must
  take ~34 cycles/SM, i.e. <= ~134 instructions for bf16, <= ~74 for FP8 at 1.8x, <= ~79 for
  INT8 at 1.7x and <= ~54 for INT4 at 2.5x: every format is at 31-59 % of issue. Yet under ncu
  the one-warp programs issue on ~59 % of cycles and stall on short-scoreboard and math-pipe
  waits, so instructions per key do set the pace. Quantized tiles are read
  from shared memory as 32-bit (FP8/INT8) or 16-bit (INT4) words and unpacked into 4 strided
  "lanes" (dims 4c + j), each dotted separately (bytes dequantized in the MMA operand layout
  would take one `ld.shared.b8` per value, 128 per thread per tile). FP8 uses the hardware
  e4m3x2 -> f16x2 convert; INT8/INT4 build fp16 `1024 + bits` patterns with `prmt`/`lop3` and
  remove the offset with one packed `sub.f16x2`/`fma.rn.f16x2` per two values; the group scale
  is one `HMUL2` per two values. Expected over bf16 at large batch: FP8 ~1.8-1.9x (bytes 0.5x),
  INT8 ~1.7-1.8x (0.53x incl. fp16 group-32 scales), INT4 ~2.5-3x (0.28x).
* Split-K is chosen from shapes (CUDA-graph-safe). Long single sequences split into >= 256-key
  parts; the partial states cost 2 x rows x (D+1) x 4 B per split per KV head (<2 % at >= 1k keys
  per split for G=4).
* Peers are measured in the same process on the same random inputs: FlashInfer
  BatchDecodeWithPagedKVCacheWrapper (CUDA-core and tensor-core paths; bf16 and FP8 KV), cuDNN
  and flash SDPA on a contiguous [B, Hkv, L, D] cache (B x 1 query; no paging: a lower bound
  on their paged cost), and compiled FlexAttention (decode path). Every peer is optional.
* Design choices (H200, 10-call graphs):
  - Split-K partials are merged by a kernel of their own, spread over (token, head) programs; one
    program merging them in the split kernel walks the splits one L2 round trip after another
    (B=1/1k/32:8, 16 splits: 9.7 us against 12.0 us; B=1/32k/32:8, 64 splits: 41.6 against 54.3).
  - FP8 tiles take the 4-lane split too: loaded as fp8 and converted whole by Triton (one dot)
    they are slower at every config (B=64/4k/32:8: 213 us at 128/4/5 against 194 us).
  - The softmax rescales every step: a lazy rescale (the reference max moving only when a row's
    max grows by > 2^8) gains nothing with the one-warp quantized programs and costs bf16 MHA
    B=64/4k 4%.
* Timing: CUDA graph of 20 calls, median of 15 replays, caches rotated when the KV set is under
  3x L2 (benchmarks/common.py); effective bandwidth = KV bytes read / time.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

D = 128
PAGE = 16
GRID_BATCH = [1, 4, 16, 64, 128, 256]
GRID_CTX = [512, 1024, 4096, 16384, 32768]
GRID_HEADS = [(32, 32), (32, 8), (64, 8), (32, 4)]
QUICK_BATCH = [1, 16, 64, 256]
QUICK_CTX = [1024, 4096]
QUICK_HEADS = [(32, 8), (32, 32)]
MAX_KV_BYTES = 40e9
PEERS = ["flashinfer", "flashinfer_tc", "cudnn_sdpa", "flash_sdpa", "flex"]
FORMATS = {  # name -> (cache dtype, group)
    "bf16": (torch.bfloat16, None),
    "fp8": (torch.float8_e4m3fn, None),
    "int8": (torch.int8, 32),
    "int4": (torch.uint8, 32),
}


# ------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------


def fill_(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Random, finite values of x's dtype, written in chunks (no full-size fp32 temporary)."""
    flat = x.view(-1) if x.is_contiguous() else None
    chunks = [flat[i:i + (1 << 27)] for i in range(0, flat.numel(), 1 << 27)] if flat is not None else [x]
    for c in chunks:
        if c.dtype == torch.int8:
            c.random_(-127, 128)
        elif c.dtype == torch.uint8:
            c.random_(0, 256)
        elif c.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            c.copy_((torch.randn(c.shape, device=c.device, dtype=torch.bfloat16) * 64).clamp_(-448, 448))
        else:
            c.normal_(0.0, scale)
    return x


class Case:
    """One decode problem: `n_sets` rotated copies of (query, K/V caches, scales) that share one
    block table (random page permutation) and the lengths."""

    def __init__(self, batch, ctx, hq, hkv, fmt="bf16", n_sets=1, dtype=torch.bfloat16, device="cuda"):
        cache_dtype, group = FORMATS[fmt]
        self.batch, self.ctx, self.hq, self.hkv, self.fmt, self.group = batch, ctx, hq, hkv, fmt, group
        self.cache_dtype, self.dtype = cache_dtype, dtype
        self.blocks_per_seq = -(-ctx // PAGE)
        nb = batch * self.blocks_per_seq
        last = D // 2 if cache_dtype == torch.uint8 else D
        self.sets = []
        for _ in range(n_sets):
            k = fill_(torch.empty(nb, PAGE, hkv, last, dtype=cache_dtype, device=device))
            v = fill_(torch.empty(nb, PAGE, hkv, last, dtype=cache_dtype, device=device))
            if group:
                ks = fill_(torch.empty(nb, PAGE, hkv, D // group, dtype=torch.float16, device=device)).abs_().mul_(0.02).add_(1e-3)
                vs = fill_(torch.empty(nb, PAGE, hkv, D // group, dtype=torch.float16, device=device)).abs_().mul_(0.02).add_(1e-3)
            elif cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                ks = torch.tensor(1 / 64, device=device)
                vs = torch.tensor(1 / 64, device=device)
            else:
                ks = vs = None
            q = torch.randn(batch, hq, D, dtype=dtype, device=device)
            self.sets.append((q, k, v, ks, vs))
        self.block_tables = torch.randperm(nb, device=device, dtype=torch.int64).to(torch.int32).view(batch, -1)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        self.out = [torch.empty(batch, hq, D, dtype=dtype, device=device) for _ in range(n_sets)]
        self.lse = [torch.empty(batch, hq, dtype=torch.float32, device=device) for _ in range(n_sets)]

    @property
    def kv_bytes(self) -> int:
        return common.kv_bytes([self.ctx] * self.batch, self.hkv, D, self.cache_dtype, self.group)

    def ours(self, i, backend=None):
        """Set i on `backend`, or (None) through the automatic choice (`backend()` says which)."""
        import torch_ops

        q, k, v, ks, vs = self.sets[i]
        out, lse = self.out[i], self.lse[i]
        bt, sl = self.block_tables, self.seq_lens

        def fn():
            with torch_ops.use_backend(backend):
                torch.ops.attn.paged_decode.out(q, k, v, bt, sl, k_scale=ks, v_scale=vs, out=out, lse=lse)
        return fn

    def triton_launch(self):
        """The Triton kernel's prepared launch of set 0, run once (its `kernels` compiled)."""
        from torch_ops.kernels.triton import paged_decode

        q, k, v, ks, vs = self.sets[0]
        args = (q, k, v, self.block_tables, self.seq_lens)
        kw = dict(out=self.out[0], lse=self.lse[0], k_scale=ks, v_scale=vs)
        return common.run_prepared(paged_decode, *args, **kw)

    def backend(self) -> str:
        import torch_ops

        q, k, v, ks, vs = self.sets[0]
        return torch_ops.backend_for("paged_decode", q, k, v, self.block_tables, self.seq_lens, k_scale=ks, v_scale=vs)


def case_sets(batch, ctx, hq, hkv, fmt, l2_bytes, free_bytes):
    cache_dtype, group = FORMATS[fmt]
    one = common.kv_bytes([ctx] * batch, hkv, D, cache_dtype, group)
    n = common.rotation_count(one, l2_bytes, budget_bytes=int(min(8 << 30, free_bytes * 0.3)))
    return n


# ------------------------------------------------------------------------------------------------
# peers
# ------------------------------------------------------------------------------------------------


def flashinfer_fns(case: Case, tensor_cores: bool):
    import flashinfer

    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    # CUDA-core path: FlashInfer's own decode kernel ("fa2"); tensor-core path: whatever "auto"
    # resolves to (recorded in the row as <peer>_backend)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tensor_cores,
                                                            backend="auto" if tensor_cores else "fa2")
    nblk = case.blocks_per_seq
    indptr = torch.arange(case.batch + 1, dtype=torch.int32, device="cuda") * nblk
    indices = case.block_tables.flatten().contiguous()
    last = torch.full((case.batch,), case.ctx - (nblk - 1) * PAGE, dtype=torch.int32, device="cuda")
    wrapper.plan(indptr, indices, last, case.hq, case.hkv, D, PAGE, q_data_type=case.dtype,
                 kv_data_type=case.cache_dtype)
    fns = []
    for i, (q, k, v, ks, vs) in enumerate(case.sets):
        out = case.out[i]
        kw = {}
        if ks is not None:
            kw = {"k_scale": float(ks), "v_scale": float(vs)}

        def fn(q=q, k=k, v=v, out=out, kw=kw):
            wrapper.run(q, (k, v), out=out, **kw)
        fns.append(fn)
    return fns, (wrapper, ws)


def contiguous_sets(case: Case):
    """[B, Hkv, L, D] contiguous K/V for the SDPA/Flex peers (same values as the paged cache)."""
    sets = []
    for (q, k, v, _, _) in case.sets:
        idx = case.block_tables.long()
        kc = k[idx].flatten(1, 2)[:, :case.ctx].permute(0, 2, 1, 3).contiguous()
        vc = v[idx].flatten(1, 2)[:, :case.ctx].permute(0, 2, 1, 3).contiguous()
        sets.append((q.unsqueeze(2), kc, vc))
    return sets


def sdpa_fns(sets, backend_name):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    backend = getattr(SDPBackend, backend_name)
    fns = []
    for (q, k, v) in sets:
        def fn(q=q, k=k, v=v):
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1])
        fns.append(fn)
    return fns


_FLEX = None


def flex_fns(sets):
    global _FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if _FLEX is None:
        _FLEX = torch.compile(flex_attention, dynamic=False)
    fns = []
    for (q, k, v) in sets:
        def fn(q=q, k=k, v=v):
            _FLEX(q, k, v, enable_gqa=k.shape[1] != q.shape[1])
        fns.append(fn)
    return fns


def warm_peers():
    """Compile FlashInfer's decode variants used here on tiny inputs (JIT, ~1-2 min each)."""
    for fmt, hkv in (("bf16", 8), ("fp8", 8), ("bf16", 32)):
        for tc in (False, True):
            t0 = time.time()
            try:
                case = Case(2, 64, 32, hkv, fmt)
                fns, keep = flashinfer_fns(case, tc)
                fns[0]()
                torch.cuda.synchronize()
                print(f"flashinfer {fmt} 32/{hkv} tc={tc}: ready in {time.time() - t0:.0f}s", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"flashinfer {fmt} 32/{hkv} tc={tc}: unavailable: {type(e).__name__}: {str(e)[:300]}", flush=True)


# ------------------------------------------------------------------------------------------------
# measurement
# ------------------------------------------------------------------------------------------------


def check_ours(case: Case, n_check: int = 8, backend: str | None = None) -> dict:
    """Max error of our output (on `backend`, None: the automatic choice) on the first sequences
    against the float64 reference, next to the error of the same reference computed in bf16."""
    from torch_ops import reference
    from torch_ops.testing import max_error

    q, k, v, ks, vs = case.sets[0]
    case.ours(0, backend)()
    torch.cuda.synchronize()
    n = min(n_check, case.batch)
    args = (k, v, case.block_tables[:n], case.seq_lens[:n])
    kw = {"k_scale": ks, "v_scale": vs}
    truth, _ = reference.paged_decode(q[:n].float(), *args, compute_dtype=torch.float64, **kw)
    base, _ = reference.paged_decode(q[:n], *args, compute_dtype=q.dtype, **kw)
    err = max_error(case.out[0][:n], truth)
    base_err = max_error(base, truth)
    return {"max_err": err, "baseline_err": base_err, "ok": bool(err <= 2 * base_err + 1e-2)}


def kernel_report(case: Case) -> dict:
    """Split count, resources and instruction mix of the Triton decode kernel of `case`."""
    launch = case.triton_launch()
    k = launch.kernels[0].kernel
    rep = {"num_splits": launch.num_splits}
    try:
        rep["n_regs"] = k.n_regs
        rep["n_spills"] = k.n_spills
        rep["shared"] = k.metadata.shared
        rep["num_warps"] = k.metadata.num_warps
        rep["num_stages"] = k.metadata.num_stages
    except Exception:  # noqa: BLE001
        pass
    try:
        ptx = k.asm["ptx"]
        for key, pat in {"cp_async": "cp.async.", "ld_global_v4": "ld.global.v4", "ld_global": "ld.global",
                         "mma": "mma.sync", "prmt": "prmt.b32", "lop3": "lop3.b32", "cvt_f16x2_e4m3": "e4m3x2",
                         "bar_sync": "bar.sync", "wgmma": "wgmma"}.items():
            rep[key] = ptx.count(pat)
        ttgir = k.asm["ttgir"]
        rep["async_copy"] = ttgir.count("async_copy_global_to_local")
        rep["local_load"] = ttgir.count("local_load")
    except Exception as e:  # noqa: BLE001
        rep["asm_error"] = str(e)[:100]
    return rep


class Runner:
    def __init__(self, args, env):
        self.args = args
        self.env = env
        self.l2 = env.get("l2_bytes", 50 << 20) or (50 << 20)
        self.t_end = time.time() + args.budget_s
        self.rows: list[dict] = []

    def time_left(self) -> float:
        return self.t_end - time.time()

    def free_bytes(self) -> int:
        free, _ = torch.cuda.mem_get_info()
        return free

    def measure(self, batch, ctx, hq, hkv, fmt, peers, bw):
        kv = common.kv_bytes([ctx] * batch, hkv, D, *FORMATS[fmt])
        row = {"batch": batch, "ctx": ctx, "hq": hq, "hkv": hkv, "fmt": fmt, "kv_bytes": kv}
        if kv > MAX_KV_BYTES or 2.2 * kv > self.free_bytes():
            row["skipped"] = "KV too large for this device/budget"
            return row
        n_sets = case_sets(batch, ctx, hq, hkv, fmt, self.l2, self.free_bytes())
        case = Case(batch, ctx, hq, hkv, fmt, n_sets=n_sets)
        row["rotated_sets"] = n_sets
        row["backend"] = case.backend()
        if self.args.check:
            row["check"] = common.run_check(functools.partial(check_ours, case))
        t, how = common.time_us([case.ours(i) for i in range(n_sets)])
        row["ours_us"], row["ours_timing"] = t, how
        row["ours_GBps"] = kv / t / 1e3
        row["ours_pct_copy"] = 100 * row["ours_GBps"] / bw["copy_GBps"]
        row["ours_pct_read"] = 100 * row["ours_GBps"] / bw["read_GBps"]
        row["kernel"] = kernel_report(case) if row["backend"] == "triton" else {}
        contiguous = None
        for peer in peers:
            if self.time_left() < 20:
                row[peer] = "skipped: time budget"
                continue
            try:
                if peer.startswith("flashinfer"):
                    if fmt not in ("bf16", "fp8"):
                        continue
                    fns, keep = flashinfer_fns(case, tensor_cores=peer.endswith("_tc"))
                else:
                    if fmt != "bf16":
                        continue
                    if contiguous is None:
                        if 2 * kv * n_sets > self.free_bytes() * 0.8:
                            raise RuntimeError("no memory for a contiguous copy")
                        contiguous = contiguous_sets(case)
                    if peer == "cudnn_sdpa":
                        fns = sdpa_fns(contiguous, "CUDNN_ATTENTION")
                    elif peer == "flash_sdpa":
                        fns = sdpa_fns(contiguous, "FLASH_ATTENTION")
                    else:
                        if batch * hq > 8192:
                            raise RuntimeError("flex skipped at this size (compile time)")
                        fns = flex_fns(contiguous)
                tp, how = common.time_us(fns)
                if peer.startswith("flashinfer"):
                    row[f"{peer}_backend"] = getattr(keep[0], "resolved_backend", "?")
                row[f"{peer}_us"] = tp
                row[f"{peer}_timing"] = how
                row[f"vs_{peer}"] = tp / t
            except Exception as e:  # noqa: BLE001
                row[peer] = f"unavailable: {type(e).__name__}: {str(e)[:160]}"
        del case, contiguous
        torch.cuda.empty_cache()
        return row


TUNE_GRIDS = {  # (BLOCK_N, num_warps, num_stages); 5 stages = two tiles in flight per program
    "bf16": [(64, 4, 3), (64, 4, 4), (32, 4, 5), (64, 8, 5), (128, 4, 5), (128, 8, 5)],
    "fp8": [(128, 4, 3), (128, 4, 4), (64, 4, 5), (128, 8, 5), (256, 8, 5)],
    "int8": [(128, 4, 3), (64, 4, 5), (256, 8, 5)],
    "int4": [(128, 4, 3), (64, 4, 5), (128, 8, 5), (256, 8, 5), (256, 4, 5)],
}


def tune_jobs(formats) -> list[tuple]:
    jobs = []
    for fmt in formats:
        shape = (64, 4096, 32, 8)
        jobs.append((shape, fmt, "default", {}))
        jobs += [(shape, fmt, f"cfg{bn}/{w}/{st}", {"config": {"BLOCK_N": bn, "num_warps": w, "num_stages": st}})
                 for bn, w, st in TUNE_GRIDS[fmt]]
        if fmt in ("int8", "int4"):
            jobs.append((shape, fmt, "no_asm", {"dequant_asm": False}))
    for fmt in [f for f in ("bf16", "int4") if f in formats]:
        shape = (1, 1024, 32, 8)
        jobs.append((shape, fmt, "default", {}))
        jobs += [(shape, fmt, f"minsplit{m}", {"min_split_tokens": m}) for m in (64, 128, 512)]
        jobs += [(shape, fmt, f"pps{p}", {"programs_per_sm": p}) for p in (1, 4)]
    return jobs


def _compile_job(job) -> str:
    """Worker: run one variant once so that its kernels land in Triton's on-disk cache."""
    shape, fmt, name, knobs = job
    from torch_ops.kernels.triton import paged_decode as pd

    try:
        with pd.tuning(**knobs):
            case = Case(*shape, fmt)
            case.ours(0)()
            torch.cuda.synchronize()
        return f"{name}: ok"
    except Exception as e:  # noqa: BLE001
        return f"{fmt} {name}: {type(e).__name__}: {str(e)[:200]}"


def precompile(jobs, workers: int = 12) -> None:
    """Compile the variants in parallel processes (Triton compiles one kernel at a time per
    process; the timing process then finds them in the cache)."""
    import concurrent.futures as cf
    import multiprocessing as mp

    t0 = time.time()
    with cf.ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=mp.get_context("spawn")) as ex:
        results = list(ex.map(_compile_job, jobs))
    bad = [r for r in results if not r.endswith(": ok")]
    print(f"# precompiled {len(jobs)} variants in {time.time() - t0:.0f}s" + (f"; failures: {bad}" if bad else ""),
          flush=True)


def tune(runner: Runner, bw) -> list[dict]:
    """Sweep our kernel's tile configs and split knobs on a few shapes (results in the JSON)."""
    from torch_ops.kernels.triton import paged_decode as pd

    jobs = tune_jobs(runner.args.formats)
    try:
        precompile(jobs)
    except Exception as e:  # noqa: BLE001
        print(f"# precompile failed ({type(e).__name__}: {e}); compiling in process", flush=True)
    out = []
    cases = {}
    for shape, fmt, name, knobs in jobs:
        if runner.time_left() < 60:
            break
        key = (shape, fmt)
        if key not in cases:
            cases.clear()
            torch.cuda.empty_cache()
            b, ctx, hq, hkv = shape
            cases[key] = Case(b, ctx, hq, hkv, fmt, n_sets=case_sets(b, ctx, hq, hkv, fmt, runner.l2, runner.free_bytes()))
        case = cases[key]
        fns = [case.ours(i, "triton") for i in range(len(case.sets))]
        res = {"shape": list(shape), "fmt": fmt, "variant": name}
        try:
            with pd.tuning(**knobs):
                t, _ = common.time_us(fns, calls=10, replays=7)
                res.update(us=t, GBps=case.kv_bytes / t / 1e3, pct_copy=100 * case.kv_bytes / t / 1e3 / bw["copy_GBps"],
                           kernel=kernel_report(case))
        except Exception as e:  # noqa: BLE001
            res["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        out.append(res)
        k = res.get("kernel", {})
        print(f"tune {shape} {fmt:5} {name:14} " + (f"{res['us']:8.2f} us {res['pct_copy']:5.1f}% splits={k.get('num_splits')} "
              f"stages={k.get('num_stages')} regs={k.get('n_regs')} "
              f"spill={k.get('n_spills')} smem={k.get('shared')} cp.async={k.get('cp_async')} "
              f"async_copy={k.get('async_copy')} ldv4={k.get('ld_global_v4')} mma={k.get('mma')}"
              if "us" in res else res.get("error", "")), flush=True)
    cases.clear()
    torch.cuda.empty_cache()
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--check", action="store_true")
    p.add_argument("--tune", action="store_true")
    p.add_argument("--warm-peers", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--batch", type=int, nargs="*")
    p.add_argument("--ctx", type=int, nargs="*")
    p.add_argument("--heads", type=str, nargs="*", help="Hq/Hkv pairs, e.g. 32/8")
    p.add_argument("--formats", nargs="*", default=list(FORMATS), choices=list(FORMATS))
    p.add_argument("--peers", nargs="*", default=PEERS, choices=PEERS)
    p.add_argument("--budget-s", type=float, default=1e9, help="stop measuring after this many seconds")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode needs a CUDA GPU")
        return 1
    if args.warm_peers:
        warm_peers()
        return 0

    env, bw = common.machine()
    runner = Runner(args, env)
    payload = {"env": env, "bandwidth": bw, "args": vars(args), "rows": runner.rows}

    if args.tune:
        payload["tune"] = tune(runner, bw)
        common.write_partial(args.out, "bench_decode", payload)

    batches = args.batch or (QUICK_BATCH if args.quick else GRID_BATCH)
    ctxs = args.ctx or (QUICK_CTX if args.quick else GRID_CTX)
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads] if args.heads else (
        QUICK_HEADS if args.quick else GRID_HEADS)
    configs = []
    for hq, hkv in heads:
        for b in batches:
            for ctx in ctxs:
                if ctx >= 16384 and b > 16:
                    continue   # long contexts for small batches only (KV under ~40 GB)
                configs.append((b, ctx, hq, hkv))
    if args.quick and not args.ctx:
        configs.append((1, 16384, 32, 8))
    flex_budget = 1 if args.quick else 6
    for (b, ctx, hq, hkv) in configs:
        if runner.time_left() < 15:
            runner.rows.append({"batch": b, "ctx": ctx, "hq": hq, "hkv": hkv, "fmt": "bf16", "skipped": "time budget"})
            continue
        peers = [x for x in args.peers if x != "flex" or (flex_budget > 0 and ctx <= 4096)]
        if "flex" in peers:
            flex_budget -= 1
        try:
            row = runner.measure(b, ctx, hq, hkv, "bf16" if "bf16" in args.formats else args.formats[0], peers, bw)
        except Exception as e:  # noqa: BLE001
            row = {"batch": b, "ctx": ctx, "hq": hq, "hkv": hkv, "error": f"{type(e).__name__}: {e}"}
            traceback.print_exc()
        runner.rows.append(row)
        print(_short(row), flush=True)
        common.write_partial(args.out, "bench_decode", payload)

    # quantized KV section: our kernel in every format (FlashInfer FP8 as the peer)
    q_configs = [(64, 4096, 32, 8), (256, 4096, 32, 8), (16, 16384, 32, 8), (1, 1024, 32, 8)]
    if not args.quick:
        q_configs += [(128, 4096, 32, 32), (64, 4096, 64, 8), (64, 4096, 32, 4)]
    fmt_rows = []
    for (b, ctx, hq, hkv) in q_configs:
        for fmt in args.formats:
            if runner.time_left() < 15:
                break
            peers = [x for x in args.peers if x.startswith("flashinfer")] if fmt in ("bf16", "fp8") else []
            try:
                row = runner.measure(b, ctx, hq, hkv, fmt, peers, bw)
            except Exception as e:  # noqa: BLE001
                row = {"batch": b, "ctx": ctx, "hq": hq, "hkv": hkv, "fmt": fmt, "error": f"{type(e).__name__}: {e}"}
            row["section"] = "formats"
            fmt_rows.append(row)
            runner.rows.append(row)
            print(_short(row), flush=True)
            common.write_partial(args.out, "bench_decode", payload)
        base = next((r for r in fmt_rows if r.get("fmt") == "bf16" and r.get("ours_us") and
                     (r["batch"], r["ctx"], r["hq"], r["hkv"]) == (b, ctx, hq, hkv)), None)
        for r in fmt_rows:
            if base and r.get("ours_us") and (r["batch"], r["ctx"], r["hq"], r["hkv"]) == (b, ctx, hq, hkv):
                r["speedup_vs_bf16"] = base["ours_us"] / r["ours_us"]

    path = common.write_json(args.out, "bench_decode", payload)
    print(f"# wrote {path}")
    print(summary(runner.rows, bw))
    return 0


def _short(r: dict) -> str:
    if r.get("skipped") or r.get("error"):
        return f"{r.get('batch')}x{r.get('ctx')} {r.get('hq')}/{r.get('hkv')} {r.get('fmt')}: {r.get('skipped') or r.get('error')}"
    s = (f"{r['batch']:>4}x{r['ctx']:<6} {r['hq']}/{r['hkv']:<3} {r['fmt']:<5} ours {r['ours_us']:8.1f} us "
         f"{r['ours_GBps']:6.0f} GB/s {r['ours_pct_copy']:5.1f}%")
    for peer in PEERS:
        if f"{peer}_us" in r:
            s += f" | {peer} {r[peer + '_us']:.1f}"
        elif isinstance(r.get(peer), str):
            s += f" | {peer} n/a"
    if "check" in r:
        c = r["check"]
        s += f" | err {c.get('max_err', float('nan')):.1e}/{c.get('baseline_err', float('nan')):.1e}"
    return s


def summary(rows, bw) -> str:
    cols = [("batch", "B", "d"), ("ctx", "ctx", "d"), ("heads", "Hq/Hkv", "s"), ("fmt", "kv", "s"),
            ("ours_us", "ours_us", ".1f"), ("ours_pct_copy", "%copyBW", ".1f"),
            ("flashinfer_us", "FI_us", ".1f"), ("flashinfer_tc_us", "FItc_us", ".1f"),
            ("best_vs_fi", "xFIbest", ".2f"), ("cudnn_sdpa_us", "cudnn_us", ".1f"),
            ("flash_sdpa_us", "flash_us", ".1f"), ("flex_us", "flex_us", ".1f"),
            ("speedup_vs_bf16", "x_bf16", ".2f"), ("err", "err_ok", "s")]
    view = []
    for r in rows:
        if not r.get("ours_us"):
            continue
        v = dict(r)
        v["heads"] = f"{r['hq']}/{r['hkv']}"
        fi = [r[k] for k in ("flashinfer_us", "flashinfer_tc_us") if isinstance(r.get(k), float)]
        v["best_vs_fi"] = min(fi) / r["ours_us"] if fi else None
        if "check" in r:
            v["err"] = "ok" if r["check"].get("ok") else "BAD"
        view.append(v)
    head = f"copy {bw['copy_GBps']:.0f} GB/s, read {bw['read_GBps']:.0f} GB/s; xFIbest = best FlashInfer time / ours"
    return head + "\n" + common.table(view, cols)


if __name__ == "__main__":
    import torch_ops

    torch_ops.warmup()   # the CUTLASS and CUDA decode libraries, which the automatic choice uses once built
    sys.exit(main())
