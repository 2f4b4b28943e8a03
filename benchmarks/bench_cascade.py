"""Decode steps over shared prefixes: cascade (`torch_ops.cascade.shared_prefix_attention`) against
`paged_decode` over the full block tables (ours and FlashInfer's), on the GPU.

B sequences in G groups; each group shares a P-token prefix, each sequence owns `own` more tokens.
A full-table decode reads `B (P + own)` tokens of KV, the cascade `G P + B own`.

    python benchmarks/bench_cascade.py [--out benchmarks/results] [--no-flashinfer]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import torch_ops  # noqa: E402,F401
from torch_ops import kv_cache, reference  # noqa: E402
from torch_ops.cascade import shared_prefix_attention  # noqa: E402
from torch_ops.testing import max_error  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    groups: int
    prefix: int
    own: int


CASES = [Case(64, 1, 4096, 128), Case(64, 4, 4096, 512), Case(128, 8, 8192, 256), Case(32, 1, 16384, 1024)]


def build(case: Case):
    """Cache, query, cascade arguments and the equivalent full block tables."""
    per_group = case.batch // case.groups
    p_blocks, o_blocks = case.prefix // BS, -(-case.own // BS)
    num_blocks = case.groups * p_blocks + case.batch * o_blocks + 1
    cache = kv_cache.random_(kv_cache.PagedKVCache.allocate(num_blocks, BS, HKV, D, torch.bfloat16, device="cuda"))
    ids = torch.randperm(num_blocks - 1, device="cuda", dtype=torch.int32)
    shared = ids[:case.groups * p_blocks].view(case.groups, p_blocks)
    own = ids[case.groups * p_blocks:case.groups * p_blocks + case.batch * o_blocks].view(case.batch, o_blocks)
    full = torch.cat([shared.repeat_interleave(per_group, 0), own], dim=1).contiguous()
    i32 = dict(dtype=torch.int32, device="cuda")
    own_lens = torch.full((case.batch,), case.own, **i32)
    args = dict(shared_block_tables=shared, shared_lens=torch.full((case.groups,), case.prefix, **i32),
                cu_group_tokens=torch.arange(case.groups + 1, **i32) * per_group,
                block_tables=own, seq_lens=own_lens)
    q = torch.randn(case.batch, HQ, D, dtype=torch.bfloat16, device="cuda")
    return cache, q, args, full, own_lens + case.prefix


def flashinfer_fn(cache, q, full, full_lens):
    import flashinfer

    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    blocks = -(-full_lens // BS)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int32, device="cuda"), blocks.cumsum(0).int()])
    indices = torch.cat([full[b, :int(n)] for b, n in enumerate(blocks.tolist())])
    last = (full_lens - 1) % BS + 1
    wrapper.plan(indptr, indices, last.int(), HQ, HKV, D, BS, q_data_type=torch.bfloat16)
    return lambda: wrapper.run(q, (cache.k, cache.v))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--no-flashinfer", action="store_true")
    opts = ap.parse_args()
    env = common.environment()
    token_bytes = 2 * HKV * D * 2
    rows = []
    for case in CASES:
        cache, q, args, full, full_lens = build(case)
        row = dataclasses.asdict(case)
        cascade = lambda: shared_prefix_attention(q, cache.k, cache.v, **args)  # noqa: E731
        plain = lambda: torch.ops.attn.paged_decode(q, cache.k, cache.v, full, full_lens)  # noqa: E731
        truth = reference.paged_decode(q, cache.k, cache.v, full, full_lens)[0]
        row["cascade_err"] = max_error(cascade()[0], truth)
        row["full_err"] = max_error(plain()[0], truth)
        row["full_us"], _ = common.time_us([plain])
        row["cascade_us"], _ = common.time_us([cascade])
        row["full_bytes"] = case.batch * (case.prefix + case.own) * token_bytes
        row["cascade_bytes"] = (case.groups * case.prefix + case.batch * case.own) * token_bytes
        row["cascade_GBps"] = row["cascade_bytes"] / row["cascade_us"] / 1e3
        if not opts.no_flashinfer:
            try:
                fi = flashinfer_fn(cache, q, full, full_lens)
                row["flashinfer_us"], _ = common.time_us([fi])
            except Exception as e:  # noqa: BLE001
                row["flashinfer_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        row["speedup_vs_full"] = row["full_us"] / row["cascade_us"]
        if isinstance(row.get("flashinfer_us"), float):
            row["speedup_vs_flashinfer"] = row["flashinfer_us"] / row["cascade_us"]
        rows.append(row)
        print(row, flush=True)
        del cache
        torch.cuda.empty_cache()
    path = common.write_json(opts.out, "cascade", {"env": env, "heads": [HQ, HKV], "head_dim": D,
                                                    "block_size": BS, "rows": rows})
    print(common.table(rows, [("batch", "B", "d"), ("groups", "G", "d"), ("prefix", "prefix", "d"),
                              ("own", "own", "d"), ("full_us", "full_us", ".1f"),
                              ("flashinfer_us", "FI_us", ".1f"), ("cascade_us", "cascade_us", ".1f"),
                              ("speedup_vs_full", "x_full", ".2f"), ("cascade_GBps", "GB/s", ".0f"),
                              ("cascade_err", "err", ".1e")]))
    print(f"wrote {path}")


if __name__ == "__main__":
    import torch_ops

    torch_ops.warmup()   # the CUTLASS and CUDA decode libraries, which the automatic choice uses once built
    main()
