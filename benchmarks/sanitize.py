"""A sample of every Triton op's configurations, run once each, for compute-sanitizer:

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 benchmarks/sanitize.py

Odd lengths, block sizes that do and do not divide the kernels' tiles, length-0 sequences,
quantized caches, split-K; small shapes so that the run stays short under the sanitizer.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch_ops  # noqa: E402
from torch_ops.kv_cache import PagedKVCache, random_  # noqa: E402

FORMATS = {"bf16": (torch.bfloat16, None), "e4m3": (torch.float8_e4m3fn, None),
           "int8": (torch.int8, 32), "int4": (torch.uint8, 32)}


def paged_case(fmt, block_size, seq_lens, hq=8, hkv=2, d=128, q_per_seq=1):
    dtype, group = FORMATS[fmt]
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 3
    cache = random_(PagedKVCache.allocate(num_blocks, block_size, hkv, d, dtype, quant_group=group, device="cuda"))
    perm = torch.randperm(num_blocks)
    tables = torch.zeros(len(seq_lens), max(need + [1]), dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[at:at + n]
        at += n
    q = torch.randn(len(seq_lens) * q_per_seq, hq, d, device="cuda", dtype=torch.bfloat16)
    return q, cache, tables.cuda(), torch.tensor(seq_lens, dtype=torch.int32, device="cuda")


def run_decode():
    for fmt in FORMATS:
        for block_size, lens, qps in ((16, [1, 17, 0, 300], 1), (5, [33, 2], 2), (64, [1000, 63], 1)):
            q, cache, tables, seq_lens = paged_case(fmt, block_size, lens, q_per_seq=qps)
            torch.ops.attn.paged_decode(q, cache.k, cache.v, tables, seq_lens, window_left=40, sink_tokens=2,
                                        **cache.scale_kwargs())
    print("paged_decode: ok")


OPS = {"paged_decode": run_decode}

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ops", nargs="*", default=list(OPS))
    with torch_ops.use_backend("triton"):
        for op in parser.parse_args().ops:
            OPS[op]()
    torch.cuda.synchronize()
