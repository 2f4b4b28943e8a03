"""PPL cache attention: our Triton `attn::cache_attention` against `kv_cache_write` + `paged_decode` /
`paged_prefill` on the equivalent paged problem (target: within 10 %).

Usage (GPU machine):  python benchmarks/bench_cache_attention.py [--quick] [--check] [--out DIR]
  --quick      ~2-minute subset (B in {1, 64}, ctx 4k, offset and page-table modes)
  --check      compare our output once per case with the float64 reference (max error, error ratio)
  --kinds / --quant-bits / --modes / --layouts / --budget-s  select a subset
Writes JSON (GPU, versions, date, commit, every measurement) under --out (default
benchmarks/results/) and prints a compact table last.

Notes
* Problem: Llama-style GQA, Hq = 32, Hkv = 8, D = 128, fp16 queries (PPL's type), one layer of a
  2-layer PPL cache (`layer_idx = 1`) in `cache_layout` 0 (PPL's default, `(MaxT, L, 2, H, Dh)`)
  unless `--layouts` says more; INT8/INT4 with `quant_group` 8 (PPL's default) and fp16 scales.
  Offset mode: each sequence owns a region of its length in random order; page-table mode:
  128-row pages (PPL's default) on a random page permutation.
* Kinds: `decode` (B sequences of `ctx` past tokens plus one new token); `prefill` (4 chunks of
  `S` new tokens over `P` cached tokens); `mixed` (64 decodes at 2k and 2 prefill chunks of 512
  over 1k, decodes first as PPL orders them).
* Baseline, the equivalent problem on the same kernels: an NHD paged cache with the same format
  and the same block size as ours reads (128 rows in both modes here), block tables and slot
  mapping prepared beforehand (as `MetadataBuilder` does once per step for all layers), then
  `kv_cache_write` and `paged_decode` (decode), `paged_prefill` (prefill, mixed), and for mixed
  batches also `paged_decode` on the decodes + `paged_prefill` on the prefills (its best split,
  which needs the decode count on the host). `ratio` = ours / best baseline; the target is
  <= 1.10. `meta_us` is our metadata kernel alone (slots, kv lengths, block table per call),
  the part of our time the baseline does not pay.
* Bytes: KV bytes read (`common.kv_bytes`) over time, for the decode rows.
* Timing: benchmarks/common.py (CUDA graph of back-to-back calls, median of replays); input sets
  rotated when one set is under 3x L2, so that reads do not come from L2.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

import torch_ops  # noqa: E402
from torch_ops import kv_cache, reference  # noqa: E402
from torch_ops.kernels.triton import cache_attention as ca  # noqa: E402
from torch_ops.testing import assert_error_ratio, max_error  # noqa: E402

HQ, HKV, D, GROUP, PAGE, NUM_LAYER = 32, 8, 128, 8, 128, 2
LAYOUT_ORDER = {0: (0, 1, 2, 3, 4), 1: (1, 0, 2, 3, 4), 2: (1, 2, 0, 3, 4), 3: (1, 2, 3, 0, 4)}  # from (T, L, 2, H, Dh)
CACHE_DTYPES = {0: torch.float16, 8: torch.int8, 4: torch.uint8}
KINDS = ["decode", "prefill", "mixed"]
DECODE_GRID = [(b, ctx) for b in (1, 16, 64, 256) for ctx in (1024, 4096, 16384) if b * ctx <= 64 * 16384]
QUICK_DECODE_GRID = [(1, 4096), (64, 4096)]
PREFILL_GRID = [(512, 0), (2048, 0), (1024, 3072)]      # (new tokens S, cached prefix P) x 4 chunks
MIXED = dict(decodes=64, decode_ctx=2048, prefills=2, chunk=512, prefix=1024)


def lengths(kind: str, params) -> tuple[list[int], list[int]]:
    """(seqlens, start_pos) of a case."""
    if kind == "decode":
        b, ctx = params
        return [1] * b, [ctx] * b
    if kind == "prefill":
        s, p = params
        return [s] * 4, [p] * 4
    m = MIXED
    return [1] * m["decodes"] + [m["chunk"]] * m["prefills"], [m["decode_ctx"]] * m["decodes"] + [m["prefix"]] * m["prefills"]


class Case:
    """One problem in both forms: PPL (`ppl_args`, `ppl_kwargs`) and the NHD paged baseline."""

    def __init__(self, seqlens, start_pos, quant_bit, cache_mode, layout, dev, rng):
        kvlens = [s + p for s, p in zip(seqlens, start_pos)]
        self.seqlens, self.kvlens, self.quant_bit = seqlens, kvlens, quant_bit
        b, t = len(seqlens), sum(seqlens)
        idx = dict(dtype=torch.int32, device=dev)
        pages = [-(-n // PAGE) for n in kvlens]
        if cache_mode == 0:
            order = list(range(b))
            rng.shuffle(order)
            starts, row = [0] * b, 0
            for i in order:
                starts[i], row = row, row + kvlens[i]
            cachestarts, max_t = torch.tensor(starts, **idx), row
        else:
            ids = torch.randperm(sum(pages)).tolist()
            table = torch.zeros(b, max(pages), dtype=torch.int32)
            for i, n in enumerate(pages):
                table[i, :n] = torch.tensor([ids.pop() * PAGE for _ in range(n)], dtype=torch.int32)
            cachestarts, max_t = table.to(dev), sum(pages) * PAGE
        dtype = CACHE_DTYPES[quant_bit]
        last = D // 2 if quant_bit == 4 else D
        shape = [(max_t, NUM_LAYER, 2, HKV, last)[i] for i in LAYOUT_ORDER[layout]]
        sshape = [(max_t, NUM_LAYER, 2, HKV, D // GROUP)[i] for i in LAYOUT_ORDER[layout]]
        cache = torch.empty(shape, dtype=dtype, device=dev)
        scale = torch.rand(sshape, dtype=torch.float16, device=dev) * 0.02 + 0.001 if quant_bit else None
        if quant_bit:
            cache.view(torch.uint8).random_(0, 256)
        else:
            cache.normal_()
        q = torch.randn(t, HQ, D, dtype=torch.float16, device=dev)
        k, v = torch.randn(t, HKV, D, dtype=torch.float16, device=dev), torch.randn(t, HKV, D, dtype=torch.float16, device=dev)
        decodes = sum(1 for s in seqlens if s == 1)
        self.ppl_args = (q, k, v, torch.tensor([0] + seqlens, **idx).cumsum(0, dtype=torch.int32),
                         torch.tensor([0] + kvlens, **idx).cumsum(0, dtype=torch.int32), cachestarts,
                         torch.tensor(start_pos, **idx), torch.tensor([decodes], **idx), max(seqlens), max(kvlens),
                         cache, scale, None)
        self.ppl_kwargs = dict(num_heads=HQ, head_dim=D, is_causal=True, num_kv_heads=HKV, num_layer=NUM_LAYER,
                               layer_idx=1, quant_bit=quant_bit, quant_group=GROUP, cache_mode=cache_mode,
                               cache_layout=layout, page_size=PAGE)

        # the baseline: an NHD cache of 128-token blocks, metadata prepared beforehand
        self.paged = kv_cache.PagedKVCache.allocate(sum(pages), PAGE, HKV, D, dtype, quant_group=GROUP if quant_bit else None,
                                                    scale_dtype=torch.float16, device=dev)
        kv_cache.random_(self.paged)
        ids = torch.randperm(sum(pages)).tolist()
        bt = torch.zeros(b, max(pages), dtype=torch.int32)
        slots = []
        for i, n in enumerate(pages):
            bt[i, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
            pos = torch.arange(start_pos[i], kvlens[i])
            slots.append(bt[i, pos // PAGE].long() * PAGE + pos % PAGE)
        self.block_tables, self.slots = bt.to(dev), torch.cat(slots).to(dev)
        self.seq_lens, self.cu_q, self.decodes = self.ppl_args[4].diff().int(), self.ppl_args[3], decodes

    def ours(self):
        torch.ops.attn.cache_attention(*self.ppl_args, **self.ppl_kwargs)

    def metadata(self):
        a, kw = self.ppl_args, self.ppl_kwargs
        max_t = a[10].shape[LAYOUT_ORDER[kw["cache_layout"]].index(0)]
        metadata = ca.metadata_launch(a[0].shape[0], a[5], max_kvlen=a[9], bs=ca._block_size(max_t, kw["cache_mode"], PAGE),
                                      cache_mode=kw["cache_mode"], page_size=PAGE, max_rows=max_t)
        metadata(a[3], a[4], a[5], a[6])

    def _write(self):
        q, k, v = self.ppl_args[:3]
        torch.ops.attn.kv_cache_write(k, v, self.paged.k, self.paged.v, self.slots, **self.paged.scale_kwargs())
        return q

    def write_decode(self):
        q = self._write()
        torch.ops.attn.paged_decode(q, self.paged.k, self.paged.v, self.block_tables, self.seq_lens,
                                    **self.paged.scale_kwargs())

    def write_prefill(self):
        q = self._write()
        torch.ops.attn.paged_prefill(q, self.paged.k, self.paged.v, self.block_tables, self.cu_q, self.seq_lens,
                                     **self.paged.scale_kwargs())

    def write_split(self):
        """Decodes through paged_decode, the rest through paged_prefill (the decode count on the host)."""
        q, n = self._write(), self.decodes
        scales = self.paged.scale_kwargs()
        torch.ops.attn.paged_decode(q[:n], self.paged.k, self.paged.v, self.block_tables[:n], self.seq_lens[:n], **scales)
        torch.ops.attn.paged_prefill(q[n:], self.paged.k, self.paged.v, self.block_tables[n:], self.cu_q[n:] - n,
                                     self.seq_lens[n:], **scales)

    def check(self) -> dict:
        """Our output against the float64 reference (the baseline: the reference in fp16)."""
        def fresh(query=None):
            a = list(self.ppl_args)
            a[10] = a[10].clone()
            a[11] = None if a[11] is None else a[11].clone()
            a[0] = a[0] if query is None else query
            return a
        with torch_ops.use_backend("triton"):
            out = torch.ops.attn.cache_attention(*fresh(), **self.ppl_kwargs)
        truth = reference.cache_attention(*fresh(self.ppl_args[0].double()), **self.ppl_kwargs, compute_dtype=torch.float64)
        base = reference.cache_attention(*fresh(), **self.ppl_kwargs, compute_dtype=torch.float16)
        res = {"max_err": max_error(out, truth), "fp16_reference_err": max_error(base, truth)}
        try:
            assert_error_ratio(out, truth, base)
            res["ok"] = True
        except AssertionError as e:
            res["ok"], res["why"] = False, str(e)
        return res


def measure(args, kind, params, quant_bit, cache_mode, layout, rng) -> dict:
    seqlens, start_pos = lengths(kind, params)
    dev = torch.device("cuda")
    first = Case(seqlens, start_pos, quant_bit, cache_mode, layout, dev, rng)
    kv = common.kv_bytes(first.kvlens, HKV, D, CACHE_DTYPES[quant_bit], GROUP if quant_bit else None)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    cases = [first] + [Case(seqlens, start_pos, quant_bit, cache_mode, layout, dev, rng)
                       for _ in range(common.rotation_count(2 * kv, l2) - 1)]
    row = {"kind": kind, "params": list(params), "quant_bit": quant_bit, "cache_mode": cache_mode,
           "layout": layout, "B": len(seqlens), "tokens": sum(seqlens), "kv_bytes": kv, "input_sets": len(cases)}
    with torch_ops.use_backend("triton"):
        row["ours_us"], row["ours_timing"] = common.time_us([c.ours for c in cases])
        row["meta_us"], _ = common.time_us([c.metadata for c in cases])
        baselines = {"decode": ["write_decode"], "prefill": ["write_prefill"],
                     "mixed": ["write_prefill", "write_split"]}[kind]
        for name in baselines:
            row[f"{name}_us"], row[f"{name}_timing"] = common.time_us([getattr(c, name) for c in cases])
    best = min(row[f"{n}_us"] for n in baselines)
    row["ratio"] = row["ours_us"] / best
    if kind == "decode":
        row["ours_GBps"] = kv / row["ours_us"] / 1e3
    if args.check:
        row["check"] = common.run_check(first.check)
    return row


def summary(rows: list[dict]) -> str:
    view = [dict(r, case=f"{r['kind']} {r['params']}", mode=("offset", "paged")[r["cache_mode"]],
                 ok=str(r["check"].get("ok", r["check"].get("error"))) if "check" in r else "-")
            for r in rows if "ours_us" in r]
    cols = [("case", "case".ljust(18), "s"), ("quant_bit", "bits", "d"), ("mode", "mode", "s"),
            ("layout", "layout", "d"), ("ours_us", "ours_us", ".1f"), ("meta_us", "meta_us", ".1f"),
            ("write_decode_us", "w+dec_us", ".1f"), ("write_prefill_us", "w+pre_us", ".1f"),
            ("write_split_us", "w+split_us", ".1f"), ("ratio", "ours/best", ".3f"),
            ("ours_GBps", "ours_GB/s", ".0f"), ("ok", "check", "s")]
    return common.table(view, cols)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--check", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--kinds", nargs="*", default=KINDS, choices=KINDS)
    p.add_argument("--quant-bits", type=int, nargs="*", default=[0, 8, 4], choices=[0, 8, 4])
    p.add_argument("--modes", type=int, nargs="*", default=[0, 1], choices=[0, 1])
    p.add_argument("--layouts", type=int, nargs="*", default=[0], choices=[0, 1, 2, 3])
    p.add_argument("--budget-s", type=float, default=540, help="stop measuring after this many seconds")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cache_attention needs a CUDA GPU")
        return 1
    if args.quick:
        args.budget_s = min(args.budget_s, 150)
    env = common.environment()
    print(f"# {env.get('gpu')}  torch {env['torch']}  triton {env['triton']}", flush=True)
    rows: list[dict] = []
    payload = {"env": env, "args": vars(args), "rows": rows}
    grids = {"decode": QUICK_DECODE_GRID if args.quick else DECODE_GRID,
             "prefill": PREFILL_GRID[:1] if args.quick else PREFILL_GRID, "mixed": [()]}
    jobs = [(kind, params, qb, mode, layout) for kind in args.kinds for params in grids[kind]
            for qb in args.quant_bits for mode in args.modes for layout in args.layouts]
    rng = random.Random(0)
    t_end = time.time() + args.budget_s
    for kind, params, qb, mode, layout in jobs:
        if time.time() > t_end - 10:
            rows.append({"kind": kind, "params": list(params), "quant_bit": qb, "cache_mode": mode, "skipped": "time budget"})
            continue
        try:
            row = measure(args, kind, params, qb, mode, layout, rng)
        except Exception as e:  # noqa: BLE001
            row = {"kind": kind, "params": list(params), "quant_bit": qb, "cache_mode": mode, "layout": layout,
                   "error": f"{type(e).__name__}: {str(e)[:300]}"}
            traceback.print_exc()
        rows.append(row)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        common.write_partial(args.out, "bench_cache_attention", payload)
        torch.cuda.empty_cache()
    path = common.write_json(args.out, "bench_cache_attention", payload)
    print(f"# wrote {path}")
    print(summary(rows))
    return 0


if __name__ == "__main__":
    import torch_ops

    torch_ops.warmup()   # the CUTLASS and CUDA decode libraries, which the automatic choice uses once built
    sys.exit(main())
