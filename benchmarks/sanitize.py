"""A sample of every Triton op's configurations (and of the CUTLASS kernels: `cutlass`, and the
CUDA decode kernel: `cuda`), run once each, for compute-sanitizer:

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 benchmarks/sanitize.py

Odd lengths, block sizes that do and do not divide the kernels' tiles, length-0 sequences,
quantized caches, split-K; small shapes so that the run stays short under the sanitizer.
"""

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch_ops  # noqa: E402
from torch_ops.kernels.triton import paged_decode as pd  # noqa: E402
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
        for block_size, lens, qps in ((16, [1, 17, 0, 300], 1), (5, [33, 2], 2), (64, [1000, 63], 1), (16, [40, 7], 8)):
            q, cache, tables, seq_lens = paged_case(fmt, block_size, lens, q_per_seq=qps)
            torch.ops.attn.paged_decode(q, cache.k, cache.v, tables, seq_lens, window_left=40, sink_tokens=2,
                                        **cache.scale_kwargs())
        # two long splits: replicated rows in the quantized formats
        q, cache, tables, seq_lens = paged_case(fmt, 16, [2001, 1500, 5, 0])
        with pd.tuning(num_splits=2):
            torch.ops.attn.paged_decode(q, cache.k, cache.v, tables, seq_lens, **cache.scale_kwargs())
    print("paged_decode: ok")


def run_prefill():
    for fmt in ("bf16", "e4m3"):
        for block_size, q_lens, lens in ((16, [1, 40, 0, 7], [300, 40, 5, 7]), (5, [13, 1], [13, 29])):
            _, cache, tables, seq_lens = paged_case(fmt, block_size, lens)
            q = torch.randn(sum(q_lens), 8, 128, device="cuda", dtype=torch.bfloat16)
            cu = torch.tensor([0] + q_lens, device="cuda").cumsum(0).to(torch.int32)
            torch.ops.attn.paged_prefill(q, cache.k, cache.v, tables, cu, seq_lens, window_left=20, sink_tokens=1,
                                         **cache.scale_kwargs())
    q_lens, k_lens = [1, 70, 0, 33], [5, 70, 3, 20]
    cu_q = torch.tensor([0] + q_lens, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + k_lens, device="cuda").cumsum(0).to(torch.int32)
    for d in (64, 128, 256):
        q = torch.randn(sum(q_lens), 8, d, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(sum(k_lens), 2, d, device="cuda", dtype=torch.float16) for _ in range(2))
        torch.ops.attn.context_attention(q, k, v, cu_q, cu_k, causal=True)
    print("paged_prefill, context_attention: ok")


def run_kv_cache_write():
    for fmt in FORMATS:
        for block_size, t, rot in ((16, 37, 64), (5, 3, 64), (1, 9, 64), (16, 37, 128)):   # rot = D: split_halves
            dtype, group = FORMATS[fmt]
            cache = random_(PagedKVCache.allocate(16, block_size, 2, 128, dtype, quant_group=group, device="cuda"))
            key, value = (torch.randn(t, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            slots = torch.randperm(16 * block_size, device="cuda")[:t].to(torch.int32)
            slots[0] = -1
            positions = torch.randint(0, 64, (t,), device="cuda", dtype=torch.int32)
            cos_sin = torch.randn(64, rot, device="cuda")
            query = torch.randn(t, 8, 128, device="cuda", dtype=torch.bfloat16)
            torch.ops.attn.kv_cache_write(key, value, cache.k, cache.v, slots, **cache.scale_kwargs(), query=query,
                                          positions=positions, cos_sin_cache=cos_sin)
    print("kv_cache_write: ok")


def run_merge_states():
    for t, h, d in ((7, 5, 80), (1, 32, 128)):
        out_a, out_b = (torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        lse_a, lse_b = (torch.randn(t, h, device="cuda") for _ in range(2))
        torch.ops.attn.merge_states(out_a, lse_a, out_b, lse_b)
    print("merge_states: ok")


def run_cutlass():
    """The CUTLASS context kernels (csrc/) and the FP8 V transpose that feeds them: ragged
    batches whose sequences start off the 16-key grid, more queries than keys, an empty one;
    then the paged kernels over the same lengths in four block sizes, alone and as the long part
    of the `mixed` backend (the Triton kernel takes the short sequences)."""
    from torch_ops import quant
    from torch_ops.kernels.cuda import fmha_sm90

    q_lens, k_lens = [1, 200, 0, 77, 130], [9, 333, 4, 20, 130]
    cu_q = torch.tensor([0] + q_lens, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + k_lens, device="cuda").cumsum(0).to(torch.int32)
    kernels = ((torch.float8_e4m3fn, 128), (torch.float8_e4m3fn, 256), (torch.bfloat16, 128))
    with torch_ops.use_backend("cutlass"):
        for grid, (dtype, d) in itertools.product((False, None), kernels):
            fmha_sm90.PERSISTENT = grid   # None: the automatic choice (persistent here at D = 128)
            torch_ops.clear_plans()
            q = torch.randn(sum(q_lens), 8, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(sum(k_lens), 2, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            scales = {}
            if dtype != torch.bfloat16:
                (q, qs), (k, ks), (v, vs) = (quant.quantize_fp8_amax(x) for x in (q, k, v))
                scales = {"q_scale": qs, "k_scale": ks, "v_scale": vs}
            for causal in (False, True):
                torch.ops.attn.context_attention(q, k, v, cu_q, cu_k, causal=causal, **scales)
    fmha_sm90.PERSISTENT = None
    torch_ops.clear_plans()
    print("context_attention (cutlass, plain and automatic grids): ok")
    # caches of their own (boxes of 8/16/16/128 tokens), K and V as halves of one tensor (32-token boxes
    # over one line of tokens), blocks padded by a token (16-token boxes of paged16, 8-token ones apart;
    # at D = 64 a line of single tokens), K alone padded (at D = 64 no line: blocks by block); 4 query
    # heads per KV head (the cluster kernels) and 1
    layouts = [(backend, block_size, "own", 128, 2) for backend in ("cutlass", "mixed") for block_size in (8, 16, 48, 256)]
    layouts += [("cutlass", 32, "halves", 128, 2), ("cutlass", 32, "padded", 128, 2), ("cutlass", 8, "padded", 128, 2),
                ("cutlass", 16, "own", 64, 2), ("cutlass", 16, "padded", 64, 2), ("cutlass", 16, "k_padded", 64, 2),
                ("cutlass", 16, "own", 128, 8), ("cutlass", 32, "halves", 128, 8), ("cutlass", 8, "padded", 128, 8),
                ("cutlass", 16, "k_padded", 64, 8)]
    # D = 64 chunks of 512+ queries on the cluster kernels: the automatic persistent grid
    layouts = [(*layout, q_lens, k_lens) for layout in layouts]
    layouts += [("cutlass", block_size, "own", 64, 2, [600, 0, 1500, 513], [900, 7, 1500, 2000]) for block_size in (8, 16)]
    for backend, block_size, layout, d, hkv, q_lens, k_lens in layouts:
        cu_q = torch.tensor([0] + q_lens, device="cuda").cumsum(0).to(torch.int32)
        with torch_ops.use_backend(backend):
            blocks = [-(-n // block_size) for n in k_lens]
            rows = block_size + (layout in ("padded", "k_padded"))
            kv = torch.randn(sum(blocks) + 1, 2, rows, hkv, d, device="cuda", dtype=torch.bfloat16)
            if layout == "own":
                kv = kv.transpose(0, 1).contiguous().transpose(0, 1)
            k_cache, v_cache = kv[:, 0, :block_size], kv[:, 1, :block_size]
            if layout == "k_padded":
                v_cache = v_cache.contiguous()
            tables = torch.randint(0, sum(blocks) + 1, (len(k_lens), max(blocks)), device="cuda", dtype=torch.int32)
            seq_lens = torch.tensor(k_lens, device="cuda", dtype=torch.int32)
            q = torch.randn(sum(q_lens), 8, d, device="cuda", dtype=torch.bfloat16)
            for causal in (False, True):
                torch.ops.attn.paged_prefill(q, k_cache, v_cache, tables, cu_q, seq_lens, causal=causal)
    print("paged_prefill (cutlass, mixed): ok")


def run_cuda_decode():
    """The CUDA decode kernel (csrc/decode_sm90.cu): odd and empty lengths, 1..8 query tokens,
    D = 64 and 128, fp16 and bf16, each cluster size from 1 to 16 (its merge in distributed
    shared memory); FP8, INT8 and INT4 caches (their scale tiles) at cluster sizes 1, 4, 16, INT8
    and INT4 also on the build for two CTAs per SM."""
    from torch_ops.kernels.cuda import decode_sm90

    real, real_per_sm = decode_sm90.cluster_size, decode_sm90.ctas_per_sm
    with torch_ops.use_backend("cuda"):
        for size, d, (hq, hkv, qps), dtype in itertools.product(
                (1, 2, 3, 4, 8, 16), (64, 128), ((8, 2, 1), (32, 32, 1), (8, 1, 2), (16, 2, 2)),
                (torch.bfloat16, torch.float16)):
            decode_sm90.cluster_size = lambda *a, size=size: size
            q, cache, tables, seq_lens = paged_case("bf16", 16, [1, 17, 0, 300, 1000], hq=hq, hkv=hkv, d=d,
                                                    q_per_seq=qps)
            torch.ops.attn.paged_decode(q.to(dtype), cache.k.to(dtype), cache.v.to(dtype), tables, seq_lens)
        for size, d, fmt, per_sm in itertools.product((1, 4, 16), (64, 128), ("e4m3", "int8", "int4"), (1, 2)):
            if per_sm == 2 and (d != 128 or fmt == "e4m3"):
                continue
            decode_sm90.cluster_size = lambda *a, size=size: size
            decode_sm90.ctas_per_sm = lambda *a, per_sm=per_sm: per_sm
            q, cache, tables, seq_lens = paged_case(fmt, 32, [1, 17, 0, 300, 1000], d=d, q_per_seq=2)
            torch.ops.attn.paged_decode(q, cache.k, cache.v, tables, seq_lens, **cache.scale_kwargs())
    decode_sm90.cluster_size, decode_sm90.ctas_per_sm = real, real_per_sm
    print("paged_decode (cuda): ok")


OPS = {"paged_decode": run_decode, "paged_prefill": run_prefill, "kv_cache_write": run_kv_cache_write,
       "merge_states": run_merge_states, "cutlass": run_cutlass, "cuda": run_cuda_decode}

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ops", nargs="*", default=list(OPS))
    with torch_ops.use_backend("triton"):
        for op in parser.parse_args().ops:
            OPS[op]()
    torch.cuda.synchronize()
