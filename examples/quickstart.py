"""Quickstart: a paged KV cache, a prefill, cache writes and decode steps through torch.ops.attn.*.

Runs on CPU (reference backend) or on a GPU (Triton kernels where they exist). Each cache write
is checked against the reference's write (the same stored values), each attention step against
the float64 reference on the same cache; a table of errors is printed last.

    python examples/quickstart.py [--kv-dtype bf16|e4m3|int8|int4] [--steps 4]
"""

import argparse
import dataclasses

import torch

import torch_ops
from torch_ops import reference
from torch_ops.kv_cache import BlockAllocator, BlockTables, PagedKVCache, random_
from torch_ops.metadata import MetadataBuilder
from torch_ops.testing import max_error

SCALED_FIELDS = ("k", "v", "k_scale", "v_scale")   # what a cache write changes
KV_DTYPES = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn, "int8": torch.int8, "int4": torch.uint8}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    num_q_heads, num_kv_heads, head_dim, block_size, num_blocks = 8, 2, 64, 16, 64
    prompts = [37, 5, 80]  # tokens per sequence
    dtype = torch.bfloat16

    kv_dtype = KV_DTYPES[args.kv_dtype]
    cache = PagedKVCache.allocate(num_blocks, block_size, num_kv_heads, head_dim, kv_dtype, device=device,
                                  quant_group=32 if kv_dtype in (torch.int8, torch.uint8) else None)
    random_(cache)  # stale contents; every slot we read is written below first
    if kv_dtype == torch.float8_e4m3fn:
        cache.k_scale.fill_(0.02)
        cache.v_scale.fill_(0.02)
    tables = BlockTables(BlockAllocator(num_blocks), block_size)
    builder = MetadataBuilder(max_num_seqs=8, max_num_tokens=256, max_blocks_per_seq=16,
                              block_size=block_size, device=device)
    rows = []

    def step(name, query_lens):
        seq_ids = range(len(prompts))
        meta = builder.build([tables.seq_len(i) for i in seq_ids], query_lens,
                             [tables.block_table(i) for i in seq_ids])
        t = meta.num_tokens
        q = torch.randn(t, num_q_heads, head_dim, device=device, dtype=dtype)
        k = torch.randn(t, num_kv_heads, head_dim, device=device, dtype=dtype)
        v = torch.randn(t, num_kv_heads, head_dim, device=device, dtype=dtype)
        expected = dataclasses.replace(cache, **{name: getattr(cache, name).clone() for name in SCALED_FIELDS
                                                 if getattr(cache, name) is not None})
        reference.kv_cache_write(k, v, expected.k, expected.v, meta.slot_mapping, **expected.scale_kwargs())
        torch.ops.attn.kv_cache_write(k, v, cache.k, cache.v, meta.slot_mapping, **cache.scale_kwargs())
        write_backend = torch_ops.backend_for("kv_cache_write", k, v, cache.k, cache.v, meta.slot_mapping,
                                              **cache.scale_kwargs())
        rows.append(("write", "kv_cache_write", write_backend, t, max(meta.seq_lens.tolist()),
                     max(max_error(ours, ref) for ours, ref in zip(cache.dequantized(), expected.dequantized()))))
        attn_args = (q, cache.k, cache.v, meta.block_tables)
        if name == "decode":
            op, args_ = "paged_decode", attn_args + (meta.seq_lens,)
        else:
            op, args_ = "paged_prefill", attn_args + (meta.cu_seqlens_q, meta.seq_lens)
        out, _ = getattr(torch.ops.attn, op)(*args_, **cache.scale_kwargs())
        truth, _ = getattr(reference, op)(*args_, **cache.scale_kwargs(), compute_dtype=torch.float64)
        backend = torch_ops.backend_for(op, *args_, **cache.scale_kwargs())
        rows.append((name, op, backend, t, max(meta.seq_lens.tolist()), max_error(out, truth)))

    for i, n in enumerate(prompts):
        tables.add(i, n)
    step("prefill", prompts)
    for _ in range(args.steps):
        for i in range(len(prompts)):
            tables.append(i)
        step("decode", [1] * len(prompts))

    print(f"device {device}, KV cache {args.kv_dtype}, {num_q_heads} query / {num_kv_heads} KV heads, "
          f"head dim {head_dim}, block size {block_size}")
    print(f"{'step':8} {'op':14} {'backend':8} {'tokens':>6} {'max len':>7} {'max |err|':>10}")
    for name, op, backend, t, longest, err in rows:
        print(f"{name:8} {op:14} {backend:8} {t:6d} {longest:7d} {err:10.2e}")
    worst = max(r[-1] for r in rows)
    assert worst < 5e-2, f"max error {worst} is too large"


if __name__ == "__main__":
    main()
