"""paged_decode tile configs and split counts across decode shapes (GPU), the evidence behind
`torch_ops.kernels.triton.paged_decode.config()` and `split_count()`.

    python benchmarks/sweep_decode_config.py              # the default set ("first"): B 1-128, D 64 and 128
    python benchmarks/sweep_decode_config.py --set mid    # mid-size batches, both layouts, more configs
    python benchmarks/sweep_decode_config.py --set small  # B <= 16: split counts up to 16
    python benchmarks/sweep_decode_config.py --set quant  # FP8/INT8/INT4 caches (D = 128, 16-token pages)
    python benchmarks/sweep_decode_config.py --set warps  # programs of 1-2 warps, every format
    python benchmarks/sweep_decode_config.py --set onewarp  # one-warp quantized configs
    python benchmarks/sweep_decode_config.py --set onewarp16  # their pipeline depth, programs per SM
    python benchmarks/sweep_decode_config.py --set onewarp_plain  # 16-key one/two-warp plain configs
    python benchmarks/sweep_decode_config.py --set replicas  # one-warp programs with 1, 2, 4 row copies
    python benchmarks/sweep_decode_config.py --set deep  # mid batches: one split, deeper pipelines
    python benchmarks/sweep_decode_config.py --set deep_small  # B x Hkv = 32-64: one split of large programs
    python benchmarks/sweep_decode_config.py --set deep64  # head dim 64 near the SM count: one split of 8 warps
    python benchmarks/sweep_decode_config.py --set long   # B = 1-4, 16k-32k keys: split counts past Tuning.max_splits

Prints one row per shape (B, Hq, Hkv, context, D, layout; every sequence at full context) with µs
per call (CUDA-graph replays, rotating input sets) for each (BLOCK_N, warps, stages) config and
split count ("auto": the heuristic's, shown after the slash; knobs: `paged_decode.tuning`). Layouts: "p16", 16-token pages
on a random permutation; "one", one page per sequence read as `[B, Hkv, S, D].transpose(1, 2)`
(the static cache `fx_passes.decode_to_paged` hands over). Then each config's compiled
registers and shared memory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from torch_ops.kernels.triton import paged_decode as pd  # noqa: E402

SETS = {
    "first": dict(
        configs={"n32": (32, 4, 5), "n64": (64, 4, 5), "n128": (128, 4, 5), "n64w8": (64, 8, 4)},
        splits=(None, 1), layouts=("p16",),
        shapes=[(1, 32, 32, 1024, 128), (1, 32, 8, 16384, 128), (8, 32, 8, 4096, 128), (32, 32, 8, 2048, 128),
                (64, 32, 8, 4096, 128), (128, 32, 8, 2048, 128), (128, 32, 32, 1024, 128), (1, 32, 8, 4096, 64),
                (8, 32, 8, 4096, 64), (32, 32, 8, 2048, 64), (64, 32, 8, 4096, 64), (128, 32, 8, 2048, 64)]),
    "mid": dict(
        configs={"n32": (32, 4, 5), "n64": (64, 4, 5), "n64s4": (64, 4, 4), "n128": (128, 4, 5),
                 "n128s3": (128, 4, 3), "n128w8": (128, 8, 4)},
        splits=(None, 1, 2, 4), layouts=("p16", "one"),
        shapes=[(16, 32, 8, 2048, 64), (32, 32, 8, 2048, 64), (64, 32, 8, 2048, 64), (32, 32, 8, 4096, 64),
                (16, 32, 8, 4096, 128), (32, 32, 8, 2048, 128), (64, 32, 8, 1024, 128), (16, 32, 32, 1024, 128),
                (64, 32, 32, 512, 128)]),
    "small": dict(
        configs={"n32": (32, 4, 5), "n64": (64, 4, 5), "n64s3": (64, 4, 3), "n128": (128, 4, 5)},
        splits=(None, 1, 2, 4, 8, 16), layouts=("p16",),
        shapes=[(1, 32, 32, 1024, 128), (16, 32, 8, 1024, 128), (16, 32, 8, 2048, 128), (8, 32, 8, 1024, 128),
                (16, 32, 8, 1024, 64), (1, 32, 32, 1024, 64)]),
    "quant": dict(
        configs={"n32": (32, 4, 5), "n64": (64, 4, 5), "n64s4": (64, 4, 4), "n128s3": (128, 4, 3),
                 "n128": (128, 4, 5)},
        splits=(None, 1, 2), layouts=("fp8", "int8", "int4"),
        shapes=[(1, 32, 8, 1024, 128), (16, 32, 8, 1024, 128), (16, 32, 8, 16384, 128), (64, 32, 8, 4096, 128),
                (256, 32, 8, 4096, 128), (128, 32, 32, 4096, 128)]),
    # programs of 1-2 warps; optional 4th and 5th entries: resident programs per SM for the split
    # heuristic (from the config's registers and shared memory compiled for sm_90a), the
    # formats it is for ("plain" or "quant") and the row copies (`replicas`)
    "warps": dict(
        configs={"n32": (32, 4, 5, None, "plain"), "n64": (64, 4, 5, None, "plain"), "n128": (128, 4, 5, None, "quant"),
                 "n16w2": (16, 2, 5, 10, "plain"), "n32w2": (32, 2, 5, 6, "plain"),
                 "n32w2q": (32, 2, 5, 8, "quant"), "n64w2q": (64, 2, 5, 5, "quant"),
                 "n64w2s4q": (64, 2, 4, 6, "quant"), "n32w1q": (32, 1, 5, 8, "quant")},
        splits=(None, 1, 2, 4), layouts=("p16", "fp8", "int8", "int4"),
        shapes=[(1, 32, 32, 1024, 128), (1, 32, 8, 1024, 128), (16, 32, 8, 1024, 128), (16, 32, 8, 4096, 128),
                (32, 32, 8, 2048, 128), (64, 32, 8, 4096, 128), (256, 32, 8, 4096, 128)]),
    "onewarp": dict(   # one-warp programs for quantized caches: tile keys, stages, programs per SM
        configs={"n32w1": (32, 1, 5, 8), "n32w1s4": (32, 1, 4, 8), "n16w1": (16, 1, 5, 8), "n16w1p16": (16, 1, 5, 16),
                 "n32w1s6": (32, 1, 6, 8)},
        splits=(None, 1), layouts=("fp8", "int8", "int4"),
        shapes=[(1, 32, 8, 1024, 128), (16, 32, 8, 1024, 128), (16, 32, 8, 16384, 128), (64, 32, 8, 4096, 128),
                (256, 32, 8, 4096, 128), (128, 32, 32, 4096, 128), (64, 32, 8, 4096, 64)]),
    "onewarp16": dict(   # the 16-key one-warp quantized config: pipeline depth, programs per SM
        configs={"n16w1": (16, 1, 5, 8), "n16w1s3": (16, 1, 3, 8), "n16w1s8": (16, 1, 8, 8),
                 "n16w1p12": (16, 1, 5, 12), "n16w1s8p12": (16, 1, 8, 12)},
        splits=(None,), layouts=("fp8", "int8", "int4"),
        shapes=[(1, 32, 8, 1024, 128), (16, 32, 8, 1024, 128), (16, 32, 8, 16384, 128), (64, 32, 8, 4096, 128),
                (256, 32, 8, 4096, 128), (128, 32, 32, 4096, 128)]),
    "onewarp_plain": dict(   # one- and two-warp programs of 16-key tiles for plain caches
        configs={"n32": (32, 4, 5), "n64": (64, 4, 5), "n16w1": (16, 1, 5, 8), "n16w1p11": (16, 1, 5, 11),
                 "n16w1s4": (16, 1, 4, 12), "n16w2s4": (16, 2, 4, 8)},
        splits=(None, 1, 2), layouts=("p16",),
        shapes=[(1, 32, 32, 1024, 128), (1, 32, 8, 1024, 128), (1, 32, 8, 16384, 128), (16, 32, 8, 1024, 128),
                (16, 32, 8, 4096, 128), (32, 32, 8, 2048, 128), (64, 32, 8, 4096, 128), (256, 32, 8, 4096, 128),
                (16, 32, 32, 4096, 128), (32, 32, 8, 2048, 64), (64, 32, 8, 4096, 64)]),
    "replicas": dict(   # one-warp 16-key programs scoring 1, 2 or 4 tiles per step in copies of the rows (and
                        # two-warp 32-key programs, one tile per step)
        configs={"r1s5": (16, 1, 5, 8, None, 1), "r2s5": (16, 1, 5, 8, None, 2), "r2s3": (16, 1, 3, 8, None, 2),
                 "r4s3": (16, 1, 3, 8, None, 4), "r4s5": (16, 1, 5, 8, None, 4), "r4s3p4": (16, 1, 3, 4, None, 4),
                 "n32w2s4": (32, 2, 4, 8, None, 1)},
        splits=(None,), layouts=("p16", "fp8", "int8", "int4"),
        shapes=[(1, 32, 32, 1024, 128), (1, 32, 32, 16384, 128), (4, 32, 8, 4096, 128), (1, 32, 8, 1024, 128),
                (16, 32, 8, 1024, 128), (16, 32, 8, 16384, 128), (64, 32, 8, 4096, 128), (256, 32, 8, 4096, 128),
                (128, 32, 32, 4096, 128), (64, 32, 4, 4096, 128)]),
    "deep": dict(   # mid batches (B x Hkv near the SM count): one split with deeper pipelines
        configs={"n64": (64, 4, 5), "n64s6": (64, 4, 6), "n64s7": (64, 4, 7), "n64s8": (64, 4, 8),
                 "n64w8s7": (64, 8, 7), "n128s4": (128, 4, 4), "n32s8": (32, 4, 8)},
        splits=(None, 1, 2), layouts=("p16",),
        shapes=[(4, 32, 32, 512, 128), (16, 32, 8, 512, 128), (16, 32, 8, 1024, 128), (16, 32, 8, 2048, 128),
                (8, 32, 8, 1024, 128), (32, 32, 8, 1024, 128), (64, 32, 8, 512, 128), (128, 32, 8, 512, 128),
                (16, 32, 32, 1024, 128), (4, 32, 32, 1024, 128), (16, 32, 4, 512, 128)]),
    "deep_small": dict(   # fewer programs (B x Hkv = 32-64, one-warp programs by default): one split of large programs?
        configs={"n16w1": (16, 1, 5, 8, None, 1), "n64": (64, 4, 5), "n64w8s7": (64, 8, 7), "n32w8s7": (32, 8, 7)},
        splits=(None, 1, 2, 4), layouts=("p16",),
        shapes=[(4, 32, 8, 512, 128), (8, 32, 8, 512, 128), (4, 32, 16, 512, 128), (16, 32, 4, 512, 128),
                (2, 32, 32, 512, 128), (1, 32, 32, 512, 128), (4, 32, 8, 256, 128), (4, 32, 8, 1024, 128),
                (8, 32, 8, 1024, 128)]),
    "deep64": dict(   # head dim 64, B x Hkv near the SM count: one split of 8-warp programs?
        configs={"n128": (128, 4, 5), "n128w8s7": (128, 8, 7), "n128w8s5": (128, 8, 5), "n64w8s7": (64, 8, 7)},
        splits=(None, 1, 2), layouts=("p16", "one"),
        shapes=[(4, 32, 32, 512, 64), (16, 32, 8, 512, 64), (16, 64, 8, 512, 64), (16, 32, 8, 256, 64),
                (16, 32, 8, 1024, 64), (4, 32, 32, 1024, 64)]),
    "long": dict(   # few programs over long tables (B = 1 ctx 32k at 32/4: 2.6 TB/s): more, smaller splits?
        configs={"n32": (32, 4, 5), "n64": (64, 4, 5), "n32w8": (32, 8, 5), "n64w8": (64, 8, 4), "n32s3": (32, 4, 3)},
        splits=(None, 32, 96, 128, 192, 256), layouts=("p16",),
        shapes=[(1, 32, 4, 32768, 128), (1, 32, 8, 32768, 128), (1, 64, 8, 32768, 128), (1, 32, 32, 32768, 128),
                (1, 32, 4, 16384, 128), (2, 32, 4, 32768, 128), (4, 32, 4, 16384, 128), (1, 32, 8, 8192, 128)]),
}
BLOCK_SIZE = 16


def input_calls(b, hq, hkv, ctx, d, layout, dev):
    """`(calls, launch)`: Triton paged_decode calls on enough random sets to cycle through ~3x 60
    MB of KV (every sequence at `ctx` keys; a quantized layout is a `bench_decode.FORMATS` name),
    and `launch()`, the prepared launch of the first set, run once (its split count and kernels)."""
    count = max(1, min(4, int(3 * 60e6 // (2 * b * ctx * hkv * d * 2)) + 1))
    if layout not in ("p16", "one"):
        from bench_decode import Case
        case = Case(b, ctx, hq, hkv, layout, n_sets=count, device=dev)
        return [case.ours(i, "triton") for i in range(count)], case.triton_launch
    seq_lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    sets = []
    for _ in range(count):
        q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)
        if layout == "one":
            k, v = (torch.randn(b, hkv, ctx, d, device=dev, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
            table = torch.arange(b, device=dev, dtype=torch.int32)[:, None]
        else:
            nb = b * (ctx // BLOCK_SIZE)
            k, v = (torch.randn(nb, BLOCK_SIZE, hkv, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
            table = torch.randperm(nb, device=dev, dtype=torch.int32).view(b, -1)
        sets.append((q, k, v, table, seq_lens))

    def launch():
        out, lse = torch.empty_like(sets[0][0]), torch.empty(b, hq, device=dev)
        return common.run_prepared(pd, *sets[0], out=out, lse=lse)

    return [lambda s=s: torch.ops.attn.paged_decode(*s) for s in sets], launch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--set", default="first", choices=sorted(SETS))
    sweep = SETS[p.parse_args().set]
    dev = torch.device("cuda")
    names = [f"{c}:{s or 'auto'}" for c in sweep["configs"] for s in sweep["splits"]]
    print("shape (B, Hq, Hkv, ctx, D) layout | " + " ".join(f"{n:>10}" for n in names), flush=True)
    resources = {}
    for b, hq, hkv, ctx, d in sweep["shapes"]:
        for layout in sweep["layouts"]:
            calls, launch = input_calls(b, hq, hkv, ctx, d, layout, dev)
            cells = []
            for name, (block_n, warps, stages, *extra) in sweep["configs"].items():
                per_sm, only, replicas = (extra + [None, None, 1])[:3]
                for splits in sweep["splits"]:
                    plain = layout in ("p16", "one")
                    too_big = block_n == 128 and d == 128 and stages == 5 and plain
                    if too_big or only == ("quant" if plain else "plain"):
                        cells.append(f"{'-':>10}")   # too big, or a config for the other formats
                        continue
                    knobs = pd.tuning(config={"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages,
                                              "replicas": replicas}, programs_per_sm=per_sm, num_splits=splits)
                    try:
                        with knobs:
                            t, _ = common.time_us(calls, calls=8, replays=10)
                            prepared = launch()
                        cell = f"{t:.1f}" + (f"/{prepared.num_splits}" if splits is None else "")
                        k = prepared.kernels[0].kernel
                        resources[(name, d, layout)] = (k.n_regs, k.metadata.shared)
                    except Exception as e:  # noqa: BLE001 - a config that does not fit is shown, not fatal
                        cell = type(e).__name__[:9]
                    cells.append(f"{cell:>10}")
            mb = 2 * b * hkv * ctx * d * {"int4": 0.5, "int8": 1, "fp8": 1}.get(layout, 2) / 1e6
            print(f"{(b, hq, hkv, ctx, d)} {layout} {mb:.0f}MB | " + " ".join(cells), flush=True)
    for (name, d, layout), (regs, smem) in sorted(resources.items()):
        print(f"config {name} D={d} {layout}: {regs} registers/thread, {smem / 1024:.0f} KB shared memory")


if __name__ == "__main__":
    main()
