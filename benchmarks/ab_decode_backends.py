"""The Triton and the CUDA `paged_decode` kernels side by side, in one process, on the same inputs.

The evidence behind `torch_ops/kernels/cuda/decode_sm90.py`'s `auto_declines`:
for each (batch, context, heads, cache format) it times both backends on bench_decode's cases
(16-token pages in a random permutation, input sets rotated past L2, CUDA-graph replays), checks the
CUDA kernel against float64, and prints which backend the automatic choice takes.

    python benchmarks/ab_decode_backends.py --batch 1 4 16 64 --ctx 1024 4096 16384 \
        --heads 32/8 32/32 --formats bf16 fp8 int8 int4 --head-dim 128 --out benchmarks/results
    python benchmarks/ab_decode_backends.py --batch 16 32 64 128 256 --ctx 128 256 512 1024 \
        --heads 32/8 --one-split      # short tables: the Triton kernel in one split too
"""

from __future__ import annotations

import argparse
import time

import torch

import bench_decode as bd
import common
from torch_ops.kernels.triton import paged_decode


def compare(case: bd.Case, one_split: bool = False) -> dict:
    """Both backends' median µs on `case`, and the CUDA kernel's error against float64; with
    `one_split`, also the Triton kernel held to one split (no split-K, no merge launch)."""
    row = {"auto": case.backend()}
    row["triton_us"] = common.time_us([case.ours(i, "triton") for i in range(len(case.sets))])[0]
    if one_split:
        with paged_decode.tuning(num_splits=1):
            row["triton_1split_us"] = common.time_us([case.ours(i, "triton") for i in range(len(case.sets))])[0]
    try:
        check = bd.check_ours(case, backend="cuda")
        row["err"], row["base_err"] = check["max_err"], check["baseline_err"]
        row["cuda_us"] = common.time_us([case.ours(i, "cuda") for i in range(len(case.sets))])[0]
    except (RuntimeError, ValueError) as e:  # the CUDA kernel does not serve this case
        row["cuda_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--ctx", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--heads", nargs="+", default=["32/8", "32/32"], help="Hq/Hkv pairs")
    p.add_argument("--formats", nargs="+", default=list(bd.FORMATS), choices=list(bd.FORMATS))
    p.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    p.add_argument("--max-bf16-kv-bytes", type=float, default=4.5e9, help="skip shapes whose bf16 cache is larger")
    p.add_argument("--budget-s", type=float, default=300)
    p.add_argument("--one-split", action="store_true", help="also time the Triton kernel in one split")
    p.add_argument("--out", default=None, help="folder for the JSON (none: print only)")
    args = p.parse_args()
    bd.D = args.head_dim   # bench_decode's cases read the module's head dim
    env = common.environment()
    l2 = env.get("l2_bytes") or (50 << 20)
    t_end = time.time() + args.budget_s
    rows = []
    print(f"{'B':>4} {'ctx':>6} {'heads':>6} {'fmt':>5} {'auto':>6} {'triton':>8} {'cuda':>8} {'t/c':>5} "
          f"{'cudaGB/s':>8} {'err/base':>15}", flush=True)
    for hq, hkv in (tuple(map(int, h.split("/"))) for h in args.heads):
        for batch in args.batch:
            for ctx in args.ctx:
                for fmt in args.formats:
                    if time.time() > t_end:
                        break
                    if common.kv_bytes([ctx] * batch, hkv, bd.D, torch.bfloat16, None) > args.max_bf16_kv_bytes:
                        continue
                    kv = common.kv_bytes([ctx] * batch, hkv, bd.D, *bd.FORMATS[fmt])
                    n_sets = bd.case_sets(batch, ctx, hq, hkv, fmt, l2, torch.cuda.mem_get_info()[0])
                    case = bd.Case(batch, ctx, hq, hkv, fmt, n_sets=n_sets)
                    row = {"batch": batch, "ctx": ctx, "hq": hq, "hkv": hkv, "fmt": fmt, "head_dim": bd.D,
                           "kv_bytes": kv, **compare(case, args.one_split)}
                    rows.append(row)
                    c = row.get("cuda_us")
                    tail = (f"{c:8.1f} {row['triton_us'] / c:5.2f} {kv / c / 1e3:8.0f} {row['err']:.1e}/{row['base_err']:.1e}"
                            if c else row["cuda_error"])
                    print(f"{batch:>4} {ctx:>6} {hq:>3}/{hkv:<3} {fmt:>5} {row['auto']:>6} {row['triton_us']:8.1f} {tail}",
                          flush=True)
                    del case
                    torch.cuda.empty_cache()
    if args.out:
        print(common.write_json(args.out, "ab_decode_backends", {"env": env, "args": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
