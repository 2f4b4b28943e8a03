"""KV-cache writes: our Triton `attn::kv_cache_write` against plain PyTorch indexing, FlashInfer
(optional) and a device-to-device copy of the same bytes.

Usage (GPU machine):  python benchmarks/bench_kv_cache_write.py [--quick] [--check] [--tune] [--out DIR]
  --tokens/--formats/--modes  select a subset (defaults: T 1 64 256 4096 16384; bf16 fp8 int8
                              int4; modes kv rope_k rope_qk)
  --check   compare each configuration once with the reference (bitwise, or max code difference)
  --tune    sweep the kernel's tile_elems (all formats) / num_warps (`kv_cache_write.tuning`) on a few shapes first
Writes JSON (GPU, versions, date, commit, every measurement) under --out (default
benchmarks/results/) and prints a compact table last.

Notes
* Problem: Hkv=8, D=128, block 16, NHD cache; key/value (and query) are bf16 views of one fused
  QKV output `[T, (32 + 2 * 8) * 128]`. Modes: `kv` (no RoPE), `rope_k` (NeoX RoPE on the key),
  `rope_qk` (RoPE on key and query, Hq=32; the rotated query is returned). FP8 is e4m3 with a
  per-tensor scale, INT8/INT4 use groups of 32 with fp16 scale caches.
* Slots: T <= 256 is a decode batch (one token per sequence, at a random length < 256, on random
  blocks); larger T is prefill (sequences of 1024 tokens from position 0 on random blocks, so
  offsets are consecutive within a block).
* Bytes moved: what must cross DRAM once: key/value (and query) read, cache rows and group
  scales (and the rotated query) written, slot_mapping/positions and one cos/sin row per token
  read (those rows often come from L2; they are < 2 % of the bytes with the query, 6 % without).
* Ceilings: `copy` is `dst.copy_(src)` of (read + written) / 2 bytes, the same traffic as ours,
  timed the same way: `%copy` is our bytes/s over that copy's (at small T both are latency
  bound). `%peak` is over common.device_bandwidth()'s large copy (the measured copy bandwidth).
  The target is >= 85 % of the copy with fused RoPE at large T.
* Peers: `torch` = eager PyTorch (reference.apply_rope, quant.quantize, index_copy_ into byte
  views), timed in the same CUDA-graph harness; `flashinfer` (bf16, modes kv and rope_qk) =
  append_paged_kv_cache, after apply_rope_with_cos_sin_cache_inplace for rope_qk, on contiguous
  copies of k/v/q. Every peer is optional: a failure is recorded in its row.
* Timing: CUDA graph of 20 calls, median of 15 replays (benchmarks/common.py); inputs and cache
  regions rotated when one set is under 3x L2.
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

HKV, HQ, D, PAGE = 8, 32, 128, 16
PREFILL_LEN = 1024
DECODE_MAX_LEN = 256
MAX_POSITION = 4096
TOKENS = [1, 64, 256, 4096, 16384]
QUICK_TOKENS = [1, 4096, 16384]
MODES = ["kv", "rope_k", "rope_qk"]
FORMATS = {  # name -> (cache dtype, quant group)
    "bf16": (torch.bfloat16, None),
    "fp8": (torch.float8_e4m3fn, None),
    "int8": (torch.int8, 32),
    "int4": (torch.uint8, 32),
}
TUNE_SHAPES = [(16384, "bf16", "rope_qk"), (16384, "int8", "kv"), (16384, "fp8", "rope_k")]
TUNE_GRID = [(2048, 4), (4096, 4), (8192, 4), (8192, 8), (16384, 8)]   # (tile_elems, num_warps)


# ------------------------------------------------------------------------------------------------
# problem
# ------------------------------------------------------------------------------------------------


def bytes_moved(t: int, fmt: str, mode: str) -> tuple[int, int]:
    """(bytes read, bytes written) that a kernel must move for T tokens."""
    cache_dtype, group = FORMATS[fmt]
    stored = D // 2 if cache_dtype == torch.uint8 else D * torch.empty((), dtype=cache_dtype).element_size()
    read = 2 * t * HKV * D * 2 + t * 4
    write = 2 * t * HKV * stored + (2 * t * HKV * (D // group) * 2 if group else 0)
    if mode != "kv":
        read += t * 4 + t * D * 4                 # positions, one cos/sin row per token
    if mode == "rope_qk":
        read += t * HQ * D * 2
        write += t * HQ * D * 2
    return read, write


def token_layout(t: int, first_block: int, blocks: int, gen: torch.Generator):
    """Slots and positions of T new tokens (decode batch or prefill, see the notes) on blocks
    `first_block ...` (a random permutation of `blocks` of them), and FlashInfer's page table."""
    if t <= DECODE_MAX_LEN:
        old = torch.randint(0, DECODE_MAX_LEN, (t,), generator=gen)
        new_lens, appended = old + 1, torch.ones(t, dtype=torch.long)
    else:
        appended = torch.full((-(-t // PREFILL_LEN),), PREFILL_LEN)
        appended[-1] = t - PREFILL_LEN * (appended.numel() - 1)
        new_lens = appended.clone()
    pages = -(-new_lens // PAGE)
    ids = first_block + torch.randperm(blocks, generator=gen)[: int(pages.sum())]
    page_ptr = torch.cat([torch.zeros(1, dtype=torch.long), pages.cumsum(0)])
    slots, positions = [], []
    for b in range(new_lens.numel()):
        pos = torch.arange(int(new_lens[b] - appended[b]), int(new_lens[b]))
        table = ids[page_ptr[b]:page_ptr[b + 1]]
        slots.append(table[pos // PAGE] * PAGE + pos % PAGE)
        positions.append(pos)
    flashinfer_meta = {
        "append_indptr": torch.cat([torch.zeros(1, dtype=torch.long), appended.cumsum(0)]).int(),
        "seq_lens": new_lens.int(), "kv_indptr": page_ptr.int(), "kv_indices": ids.int(),
        "kv_last_page_len": (new_lens - (pages - 1) * PAGE).int(),
    }
    return torch.cat(slots).int(), torch.cat(positions).int(), flashinfer_meta


def blocks_needed(t: int) -> int:
    if t <= DECODE_MAX_LEN:
        return t * (DECODE_MAX_LEN // PAGE + 1)
    return -(-t // PREFILL_LEN) * (PREFILL_LEN // PAGE)


class Case:
    """`n_sets` rotated input sets (fused QKV, slots, positions) of one configuration, writing
    into disjoint block ranges of one cache."""

    def __init__(self, t, fmt, mode, n_sets=1, device="cuda"):
        from torch_ops import kv_cache, reference

        self.t, self.fmt, self.mode = t, fmt, mode
        cache_dtype, group = FORMATS[fmt]
        per_set = blocks_needed(t)
        fp8_scale = torch.tensor(0.05) if cache_dtype == torch.float8_e4m3fn else None
        self.cache = kv_cache.PagedKVCache.allocate(n_sets * per_set, PAGE, HKV, D, cache_dtype, quant_group=group,
                                                    scale_dtype=torch.float16, fp8_scale=fp8_scale, device=device)
        self.cos_sin = reference.rope_cos_sin_cache(MAX_POSITION, D).to(device)
        gen = torch.Generator().manual_seed(t)
        self.sets = []
        for i in range(n_sets):
            slots, positions, meta = token_layout(t, i * per_set, per_set, gen)
            qkv = torch.randn(t, (HQ + 2 * HKV) * D, dtype=torch.bfloat16, device=device)
            self.sets.append({"qkv": qkv, "slots": slots.to(device), "positions": positions.to(device),
                              "fi": {k: v.to(device) for k, v in meta.items()}})

    def views(self, i):
        heads = self.sets[i]["qkv"].view(self.t, HQ + 2 * HKV, D)
        return heads[:, :HQ], heads[:, HQ:HQ + HKV], heads[:, HQ + HKV:]

    def kwargs(self, i) -> dict:
        kw = {} if self.cache.k_scale is None else self.cache.scale_kwargs()
        if self.mode != "kv":
            kw.update(positions=self.sets[i]["positions"], cos_sin_cache=self.cos_sin, rope_neox=True)
        if self.mode == "rope_qk":
            kw["query"] = self.views(i)[0]
        return kw

    def ours(self, i):
        import torch_ops

        _, key, value = self.views(i)
        slots, kw, c = self.sets[i]["slots"], self.kwargs(i), self.cache

        def fn():
            with torch_ops.use_backend("triton"):
                torch.ops.attn.kv_cache_write(key, value, c.k, c.v, slots, **kw)
        return fn

    def torch_eager(self, i):
        """Plain PyTorch: RoPE, quantization, then index_copy_ into byte views of the caches."""
        from torch_ops import quant, reference

        query, key, value = self.views(i)
        slots = self.sets[i]["slots"].long()
        positions = self.sets[i]["positions"]
        c, (cache_dtype, group) = self.cache, FORMATS[self.fmt]
        flat = lambda x: x.view(torch.uint8).view(x.shape[0] * x.shape[1], x.shape[2], -1)

        def fn():
            k = key
            if self.mode != "kv":
                k = reference.apply_rope(key, positions, self.cos_sin, True)
                if group is None and cache_dtype != torch.float8_e4m3fn:
                    k = k.to(key.dtype)
            if self.mode == "rope_qk":
                reference.apply_rope(query, positions, self.cos_sin, True).to(query.dtype)
            for x, cache, scale in ((k, c.k, c.k_scale), (value, c.v, c.v_scale)):
                stored, group_scales = quant.quantize(x, scale, cache_dtype, group or 0, torch.float16)
                flat(cache).index_copy_(0, slots, stored.view(torch.uint8))
                if group_scales is not None:
                    flat(scale).index_copy_(0, slots, group_scales.view(torch.uint8))
        return fn

    def flashinfer(self, i):
        import flashinfer

        query, key, value = (x.contiguous() for x in self.views(i))
        meta, positions = self.sets[i]["fi"], self.sets[i]["positions"].long()
        batch_indices, fi_positions = flashinfer.get_batch_indices_positions(
            meta["append_indptr"], meta["seq_lens"], self.t)
        q2, k2 = query.view(self.t, HQ * D), key.view(self.t, HKV * D)
        c = self.cache

        def fn():
            if self.mode == "rope_qk":
                flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(positions, q2, k2, D, self.cos_sin, is_neox=True)
            flashinfer.page.append_paged_kv_cache(key, value, batch_indices, fi_positions, (c.k, c.v),
                                                  meta["kv_indices"], meta["kv_indptr"], meta["kv_last_page_len"],
                                                  kv_layout="NHD")
        return fn


def check_ours(case: Case) -> dict:
    """Our call on set 0 against the reference on a clone of the cache (written rows only)."""
    import torch_ops
    from torch_ops import kv_cache, quant, reference

    c = case.cache
    clone = lambda x: None if x is None else x.clone()
    ref = kv_cache.PagedKVCache(clone(c.k), clone(c.v), clone(c.k_scale), clone(c.v_scale))
    _, key, value = case.views(0)
    kw = case.kwargs(0)
    ref_rq = reference.kv_cache_write(key, value, ref.k, ref.v, case.sets[0]["slots"],
                                      **dict(kw, **({} if ref.k_scale is None else ref.scale_kwargs())))
    with torch_ops.use_backend("triton"):
        rq = torch.ops.attn.kv_cache_write(key, value, c.k, c.v, case.sets[0]["slots"], **kw)
    slots = case.sets[0]["slots"].long()
    rows = (slots // PAGE, slots % PAGE)
    res = {}
    for name, ours, theirs in (("k", c.k, ref.k), ("v", c.v, ref.v), ("k_scale", c.k_scale, ref.k_scale)):
        if ours is None or ours.dim() == 0:
            continue
        a, b = ours[rows], theirs[rows]
        res[f"{name}_bitwise"] = bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))
        if name != "k_scale" and c.format is not quant.KVFormat.PLAIN:
            unpack = (lambda x: quant.unpack_int4(x).int()) if c.format is quant.KVFormat.INT4 else (
                lambda x: x.view(torch.uint8).int() if c.format is quant.KVFormat.FP8 else x.int())
            res[f"{name}_max_code_diff"] = int((unpack(a) - unpack(b)).abs().max())
    if rq.numel():
        res["query_bitwise"] = bool(torch.equal(rq, ref_rq))
        res["query_max_err"] = float((rq.float() - ref_rq.float()).abs().max())
    return res


# ------------------------------------------------------------------------------------------------
# measurement
# ------------------------------------------------------------------------------------------------


class Runner:
    def __init__(self, args, env, bw):
        self.args, self.env, self.bw = args, env, bw
        self.l2 = env.get("l2_bytes", 50 << 20) or (50 << 20)
        self.rows: list[dict] = []

    def n_sets(self, t, fmt, mode) -> int:
        read, write = bytes_moved(t, fmt, mode)
        free, _ = torch.cuda.mem_get_info()
        return common.rotation_count(read + write, self.l2, budget_bytes=int(min(4 << 30, free * 0.2)))

    def copy_same(self, nbytes: int, n_sets: int) -> float:
        half = max(1, nbytes // 2)
        new = lambda: torch.empty(half, dtype=torch.uint8, device="cuda")
        bufs = [(new(), new()) for _ in range(n_sets)]
        t, _ = common.time_us([lambda s=s, d=d: d.copy_(s) for s, d in bufs])
        return t

    def measure(self, t, fmt, mode) -> dict:
        read, write = bytes_moved(t, fmt, mode)
        row = {"tokens": t, "fmt": fmt, "mode": mode, "bytes_read": read, "bytes_written": write}
        n = self.n_sets(t, fmt, mode)
        case = Case(t, fmt, mode, n_sets=n)
        row["rotated_sets"] = n
        if self.args.check:
            row["check"] = common.run_check(functools.partial(check_ours, case))
        total = read + write
        us, how = common.time_us([case.ours(i) for i in range(n)])
        row.update(ours_us=us, ours_timing=how, ours_GBps=total / us / 1e3)
        try:
            row["copy_us"] = self.copy_same(total, n)
            row["pct_copy"] = 100 * row["copy_us"] / us
        except Exception as e:  # noqa: BLE001
            row["copy"] = f"unavailable: {type(e).__name__}: {str(e)[:160]}"
        row["pct_peak"] = 100 * row["ours_GBps"] / self.bw["copy_GBps"]
        peers = [p for p in self.args.peers if p != "flashinfer" or (fmt == "bf16" and mode != "rope_k")]
        for peer in peers:
            try:
                make = case.torch_eager if peer == "torch" else case.flashinfer
                tp, how = common.time_us([make(i) for i in range(n)])
                row.update({f"{peer}_us": tp, f"{peer}_timing": how, f"vs_{peer}": tp / us})
            except Exception as e:  # noqa: BLE001
                row[peer] = f"unavailable: {type(e).__name__}: {str(e)[:160]}"
        del case
        torch.cuda.empty_cache()
        return row


def tune(runner: Runner) -> list[dict]:
    """Time our kernel over tile sizes x warps (`kv_cache_write.tuning`) on a few large shapes (results in the JSON)."""
    from torch_ops.kernels.triton import kv_cache_write as kcw

    out = []
    for t, fmt, mode in TUNE_SHAPES:
        if fmt not in runner.args.formats:
            continue
        n = runner.n_sets(t, fmt, mode)
        case = Case(t, fmt, mode, n_sets=n)
        read, write = bytes_moved(t, fmt, mode)
        copy_us = runner.copy_same(read + write, n)
        for tile_elems, warps in TUNE_GRID:
            res = {"tokens": t, "fmt": fmt, "mode": mode, "TILE_ELEMS": tile_elems, "NUM_WARPS": warps}
            try:
                with kcw.tuning(tile_elems=dict.fromkeys(kcw.tuning.current.tile_elems, tile_elems), num_warps=warps):
                    us, _ = common.time_us([case.ours(i) for i in range(n)], calls=10, replays=7)
                res.update(us=us, pct_copy=100 * copy_us / us)
            except Exception as e:  # noqa: BLE001
                res["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            out.append(res)
            timing = f"{res['us']:8.1f} us {res['pct_copy']:5.1f}% of copy" if "us" in res else res["error"]
            print(f"tune T={t} {fmt:4} {mode:7} tile={tile_elems:5} warps={warps} {timing}", flush=True)
        del case
        torch.cuda.empty_cache()
    return out


def _short(r: dict) -> str:
    head = f"T={r['tokens']:<6} {r['fmt']:<4} {r['mode']:<7}"
    if "ours_us" not in r:
        return f"{head} {r.get('error', '?')}"
    s = f"{head} ours {r['ours_us']:8.1f} us {r['ours_GBps']:6.0f} GB/s {r.get('pct_copy', float('nan')):5.1f}% copy"
    for peer in ("torch", "flashinfer"):
        if f"{peer}_us" in r:
            s += f" | {peer} {r[peer + '_us']:.1f} us"
        elif isinstance(r.get(peer), str):
            s += f" | {peer} n/a"
    if "check" in r:
        s += f" | check {r['check']}"
    return s


def summary(rows, bw) -> str:
    cols = [("tokens", "T", "d"), ("fmt", "kv", "s"), ("mode", "mode", "s"), ("ours_us", "ours_us", ".1f"),
            ("ours_GBps", "GB/s", ".0f"), ("pct_copy", "%copy", ".1f"), ("pct_peak", "%peak", ".1f"),
            ("torch_us", "torch_us", ".1f"), ("vs_torch", "x_torch", ".2f"),
            ("flashinfer_us", "fi_us", ".1f"), ("vs_flashinfer", "x_fi", ".2f")]
    return (f"# kv_cache_write: Hkv={HKV} Hq={HQ} D={D} block {PAGE}; peak copy {bw['copy_GBps']:.0f} GB/s; "
            f"%copy = vs a copy of the same bytes, x_peer = peer time / ours\n" + common.table(rows, cols))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--check", action="store_true")
    p.add_argument("--tune", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--tokens", type=int, nargs="*")
    p.add_argument("--formats", nargs="*", default=list(FORMATS), choices=list(FORMATS))
    p.add_argument("--modes", nargs="*", default=MODES, choices=MODES)
    p.add_argument("--peers", nargs="*", default=["torch", "flashinfer"], choices=["torch", "flashinfer"])
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kv_cache_write needs a CUDA GPU")
        return 1

    env, bw = common.machine()
    runner = Runner(args, env, bw)
    payload = {"env": env, "bandwidth": bw, "args": vars(args), "rows": runner.rows}
    if args.tune:
        payload["tune"] = tune(runner)

    tokens = args.tokens or (QUICK_TOKENS if args.quick else TOKENS)
    modes = [m for m in args.modes if not args.quick or m != "rope_k"]
    t0 = time.time()
    for t in tokens:
        for fmt in args.formats:
            for mode in modes:
                try:
                    row = runner.measure(t, fmt, mode)
                except Exception as e:  # noqa: BLE001
                    row = {"tokens": t, "fmt": fmt, "mode": mode, "error": f"{type(e).__name__}: {e}"}
                    traceback.print_exc()
                runner.rows.append(row)
                print(_short(row), flush=True)
    payload["elapsed_s"] = time.time() - t0
    path = common.write_json(args.out, "bench_kv_cache_write", payload)
    print(f"# wrote {path}")
    print(summary(runner.rows, bw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
