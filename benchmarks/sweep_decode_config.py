"""paged_decode tile configs across decode shapes (GPU): µs per call (CUDA graphs) for each
config, with the automatic split count (shown after the slash) and with one split. Prints a table;
its output is kept in benchmarks/results/decode_config_sweep_*.log and chose `config()`."""
import sys, torch
sys.path.insert(0, "benchmarks")
import common
from torch_ops.kernels import paged_decode as pd
dev = torch.device("cuda")
CFGS = {"n32": (32, 4, 5), "n64": (64, 4, 5), "n128": (128, 4, 5), "n64w8": (64, 8, 4)}
SHAPES = [(1, 32, 32, 1024, 128), (1, 32, 8, 16384, 128), (8, 32, 8, 4096, 128), (32, 32, 8, 2048, 128),
          (64, 32, 8, 4096, 128), (128, 32, 8, 2048, 128), (128, 32, 32, 1024, 128),
          (1, 32, 8, 4096, 64), (8, 32, 8, 4096, 64), (32, 32, 8, 2048, 64), (64, 32, 8, 4096, 64), (128, 32, 8, 2048, 64)]
print("shape(B,Hq,Hkv,S,D) | " + " | ".join(f"{c}:auto {c}:1" for c in CFGS))
for B, HQ, HKV, S, D in SHAPES:
    bs = 16
    nb = B * (S // bs)
    sets = []
    nsets = max(1, min(4, int(3 * 60e6 // (2 * nb * bs * HKV * D * 2)) + 1))
    for _ in range(nsets):
        k = torch.randn(nb, bs, HKV, D, device=dev, dtype=torch.bfloat16)
        sets.append((torch.randn(B, HQ, D, device=dev, dtype=torch.bfloat16), k, torch.randn_like(k),
                     torch.randperm(nb, device=dev, dtype=torch.int32).view(B, -1)))
    sl = torch.full((B,), S, dtype=torch.int32, device=dev)
    kvb = 2 * B * HKV * S * D * 2
    cells = []
    for name, (bn, w, st) in CFGS.items():
        for splits in (None, 1):
            if (bn == 128 and D == 128):
                cells.append("      -"); continue
            pd.CONFIG_OVERRIDE = {"BLOCK_N": bn, "num_warps": w, "num_stages": st}
            pd.FORCE_NUM_SPLITS = splits
            try:
                t, _ = common.time_us([lambda s=s: torch.ops.attn.paged_decode(s[0], s[1], s[2], s[3], sl) for s in sets],
                                      calls=8, replays=10)
                cells.append(f"{t:7.1f}" + (f"/{pd.LAST_NUM_SPLITS}" if splits is None else "  "))
            except Exception as e:
                cells.append(f"  fail({type(e).__name__[:6]})")
    print(f"{(B, HQ, HKV, S, D)} {kvb/1e6:.0f}MB | " + " ".join(cells), flush=True)
    del sets
