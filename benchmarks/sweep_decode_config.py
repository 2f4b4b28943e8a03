"""paged_decode tile configs across decode shapes (GPU), the evidence behind
`torch_ops.kernels.paged_decode.config()`.

    python benchmarks/sweep_decode_config.py

Prints one row per shape (B, Hq, Hkv, context, D; 16-token pages on a random permutation, every
sequence at full context) with µs per call (CUDA-graph replays, rotating input sets) for each
(BLOCK_N, warps, stages) config, with the automatic split count (after the slash) and with one
split. The committed output: benchmarks/results/decode_config_sweep_*.log.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from torch_ops.kernels import paged_decode as pd  # noqa: E402

CONFIGS = {"n32": (32, 4, 5), "n64": (64, 4, 5), "n128": (128, 4, 5), "n64w8": (64, 8, 4)}
SHAPES = [(1, 32, 32, 1024, 128), (1, 32, 8, 16384, 128), (8, 32, 8, 4096, 128), (32, 32, 8, 2048, 128),
          (64, 32, 8, 4096, 128), (128, 32, 8, 2048, 128), (128, 32, 32, 1024, 128), (1, 32, 8, 4096, 64),
          (8, 32, 8, 4096, 64), (32, 32, 8, 2048, 64), (64, 32, 8, 4096, 64), (128, 32, 8, 2048, 64)]
BLOCK_SIZE = 16


def input_sets(b, hq, hkv, ctx, d, dev):
    """Enough random (q, k_cache, v_cache, block_tables) sets to cycle through ~3x 60 MB of KV."""
    nb = b * (ctx // BLOCK_SIZE)
    count = max(1, min(4, int(3 * 60e6 // (2 * nb * BLOCK_SIZE * hkv * d * 2)) + 1))
    sets = []
    for _ in range(count):
        k = torch.randn(nb, BLOCK_SIZE, hkv, d, device=dev, dtype=torch.bfloat16)
        sets.append((torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16), k, torch.randn_like(k),
                     torch.randperm(nb, device=dev, dtype=torch.int32).view(b, -1)))
    return sets


def main() -> None:
    dev = torch.device("cuda")
    print("shape (B, Hq, Hkv, ctx, D) | " + " | ".join(f"{c}:auto {c}:1" for c in CONFIGS))
    for b, hq, hkv, ctx, d in SHAPES:
        sets = input_sets(b, hq, hkv, ctx, d, dev)
        seq_lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
        cells = []
        for block_n, warps, stages in CONFIGS.values():
            for splits in (None, 1):
                if block_n == 128 and d == 128:
                    cells.append("      -")
                    continue
                pd.CONFIG_OVERRIDE = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
                pd.FORCE_NUM_SPLITS = splits
                calls = [lambda s=s: torch.ops.attn.paged_decode(*s[:4], seq_lens) for s in sets]
                t, _ = common.time_us(calls, calls=8, replays=10)
                cells.append(f"{t:7.1f}" + (f"/{pd.LAST_NUM_SPLITS}" if splits is None else "  "))
        print(f"{(b, hq, hkv, ctx, d)} {2 * b * hkv * ctx * d * 2 / 1e6:.0f}MB | " + " ".join(cells), flush=True)
    pd.CONFIG_OVERRIDE = pd.FORCE_NUM_SPLITS = None


if __name__ == "__main__":
    main()
