"""Small random inputs for every op, in several variants (GQA, MQA, quantized caches, empty
sequences), shared by the opcheck, compile and bad-input tests. Each builder returns
`(args, kwargs)` for `torch.ops.attn.<op>`."""

from __future__ import annotations

import torch

from torch_ops import quant, reference


def paged_cache(num_blocks, block_size, hkv, d, fmt="bf16", *, per_head=False, group=8, device="cpu", dv=None):
    """Random `(k_cache, v_cache, {k_scale, v_scale})` in format `fmt`:
    "fp16"/"bf16"/"fp32", "e4m3"/"e5m2", "int8" or "int4"; values of head dim `dv` (default `d`)."""
    dense = [torch.randn(num_blocks, block_size, hkv, dim, device=device) for dim in (d, dv or d)]
    plain = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    if fmt in plain:
        return dense[0].to(plain[fmt]), dense[1].to(plain[fmt]), {}
    if fmt in ("e4m3", "e5m2"):
        dtype = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
        scales = [torch.rand(hkv if per_head else (), device=device) * 0.05 + 0.01 for _ in range(2)]
        caches = [quant.quantize_fp8(x, s, dtype) for x, s in zip(dense, scales)]
        return caches[0], caches[1], {"k_scale": scales[0], "v_scale": scales[1]}
    bits = {"int8": 8, "int4": 4}[fmt]
    (kq, ks), (vq, vs) = (quant.quantize_groupwise(x, bits, group) for x in dense)
    return kq, vq, {"k_scale": ks, "v_scale": vs}


def block_tables_for(seq_lens, block_size, num_blocks, max_blocks=None):
    """A random permutation of blocks handed out to sequences; int32 `[B, max_blocks]`."""
    needed = [-(-n // block_size) for n in seq_lens]
    max_blocks = max_blocks or max(needed + [1])
    perm = torch.randperm(num_blocks)
    table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    at = 0
    for b, n in enumerate(needed):
        table[b, :n] = perm[at:at + n]
        at += n
    assert at <= num_blocks, "not enough blocks for these sequences"
    return table


def paged_decode(variant="gqa"):
    hq, hkv, d, bs, nb = {"gqa": (4, 2, 16, 4, 16), "mqa": (4, 1, 32, 8, 8), "mha": (2, 2, 16, 2, 32),
                          "mla": (4, 1, 48, 4, 16)}.get(variant, (4, 2, 16, 4, 16))
    fmt = {"fp8": "e4m3", "int8": "int8", "int4": "int4", "mla": "e4m3"}.get(variant, "bf16")
    seq_lens = [5, 0, 9] if variant != "mqa" else [17, 3]
    q_per_seq = 2 if variant in ("int8", "mla") else 1
    k, v, scales = paged_cache(nb, bs, hkv, d, fmt, per_head=variant == "fp8")
    if variant == "mla":   # a latent cache: values are the keys' first 32 dims, one scale for both
        v, scales = k[..., :32], {"k_scale": scales["k_scale"], "v_scale": scales["k_scale"]}
    query = torch.randn(len(seq_lens) * q_per_seq, hq, d, dtype=torch.bfloat16)
    args = (query, k, v, block_tables_for(seq_lens, bs, nb), torch.tensor(seq_lens, dtype=torch.int32))
    kwargs = dict(scales)
    if variant == "features":
        kwargs.update(alibi_slopes=torch.rand(hq), window_left=3, sink_tokens=1, sinks=torch.randn(hq), softcap=10.0)
    if variant == "fp8":
        kwargs.update(out_scale=torch.tensor(0.05))
    return args, kwargs


def paged_prefill(variant="mixed"):
    hq, hkv, d, bs, nb = 4, 2, 16, 4, 32
    fmt = {"int4": "int4", "fp8": "e5m2"}.get(variant, "fp16")
    q_lens, seq_lens = [1, 6, 0, 3], [9, 6, 4, 11]
    k, v, scales = paged_cache(nb, bs, hkv, d, fmt, dv=d // 2 if variant == "mla" else None)
    query = torch.randn(sum(q_lens), hq, d, dtype=torch.float16)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    args = (query, k, v, block_tables_for(seq_lens, bs, nb), cu, torch.tensor(seq_lens, dtype=torch.int32))
    kwargs = dict(scales, causal=variant != "noncausal")
    return args, kwargs


def context_attention(variant="causal"):
    hq, hkv, d = (4, 1, 16) if variant == "mqa" else (4, 2, 16)
    q_lens, k_lens = [3, 7, 0], ([3, 7, 0] if variant != "cross" else [5, 2, 4])
    cu_q = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + k_lens).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), hq, d)
    k, v = torch.randn(sum(k_lens), hkv, d), torch.randn(sum(k_lens), hkv, d // 2 if variant == "mla" else d)
    kwargs = dict(causal=variant != "cross")
    if variant == "fp8":
        scales = [torch.rand(()) * 0.1 + 0.05 for _ in range(3)]
        q, k, v = (quant.quantize_fp8(x, s, torch.float8_e4m3fn) for x, s in zip((q, k, v), scales))
        kwargs.update(q_scale=scales[0], k_scale=scales[1], v_scale=scales[2])
    else:
        q, k, v = q.half(), k.half(), v.half()
    return (q, k, v, cu_q, cu_k), kwargs


def kv_cache_write(variant="bf16"):
    hq, hkv, d, bs, nb, t = 4, 2, 16, 4, 8, 5
    if variant == "latent":   # an MLA latent cache: RoPE part (8 dims, rotated) then compressed part (16) per row
        latent, scales = paged_cache(nb, bs, 1, 24, "e4m3")[0], torch.tensor(0.05)
        key, value = torch.randn(t, 1, 8, dtype=torch.bfloat16), torch.randn(t, 1, 16, dtype=torch.bfloat16)
        angles = torch.arange(32).unsqueeze(1) * torch.rand(4)
        kwargs = dict(k_scale=scales, v_scale=scales, positions=torch.randint(0, 32, (t,), dtype=torch.int32),
                      cos_sin_cache=torch.cat([angles.cos(), angles.sin()], dim=-1),
                      query=torch.randn(t, hq, 8, dtype=torch.bfloat16), rope_neox=False)
        return (key, value, latent[..., 16:], latent[..., :16], torch.randperm(nb * bs)[:t].to(torch.int32)), kwargs
    k_cache, v_cache, scales = paged_cache(nb, bs, hkv, d, {"fp8": "e4m3", "rope": "bf16"}.get(variant, variant))
    key, value = torch.randn(t, hkv, d, dtype=torch.bfloat16), torch.randn(t, hkv, d, dtype=torch.bfloat16)
    if variant == "fp32":
        key, value = key.float(), value.float()
    slots = torch.randperm(nb * bs)[:t].to(torch.int32)
    slots[1] = -1
    kwargs = dict(scales)
    if variant in ("int4", "rope"):
        max_pos, rot = 32, 8
        angles = torch.arange(max_pos).unsqueeze(1) * torch.rand(rot // 2)
        kwargs.update(positions=torch.randint(0, max_pos, (t,), dtype=torch.int32),
                      cos_sin_cache=torch.cat([angles.cos(), angles.sin()], dim=-1),
                      query=torch.randn(t, hq, d, dtype=key.dtype), rope_neox=variant == "rope")
    return (key, value, k_cache, v_cache, slots), kwargs


def merge_states(variant="plain"):
    t, h, d = 5, 3, 8
    lse_a, lse_b = torch.randn(t, h), torch.randn(t, h)
    lse_a[0] = float("-inf")
    lse_b[0] = float("-inf")
    return (torch.randn(t, h, d), lse_a, torch.randn(t, h, d), lse_b), {}


def cache_attention(variant="offset"):
    num_heads, hkv, dh, num_layer, layer_idx, group = 4, 2, 16, 2, 1, 8
    seqlens, start_pos = [1, 4, 3], [5, 0, 2]
    quant_bit = {"int8": 8, "int4": 4}.get(variant, 0)
    mode = 1 if variant in ("paged", "int8") else 0
    layout = {"offset": 0, "paged": 1, "int8": 3, "int4": 2}.get(variant, 0)
    page_size = 4
    kvlens = [p + s for p, s in zip(start_pos, seqlens)]
    seqstarts = torch.tensor([0] + seqlens).cumsum(0)
    kvstarts = torch.tensor([0] + kvlens).cumsum(0)
    if mode == 0:
        cachestarts = torch.tensor([0, 16, 32])
        max_t = 48
    else:
        max_pages = 4
        cachestarts = torch.randperm(3 * max_pages).view(3, max_pages) * page_size
        max_t = 3 * max_pages * page_size
    dims = {0: (max_t, num_layer, 2, hkv, dh), 1: (num_layer, max_t, 2, hkv, dh),
            2: (num_layer, 2, max_t, hkv, dh), 3: (num_layer, 2, hkv, max_t, dh)}[layout]
    stored = list(dims)
    if quant_bit == 4:
        stored[-1] = dh // 2
    if quant_bit:
        cache = torch.randint(-100, 100, stored, dtype=torch.int8)
        scale_shape = list(dims)
        scale_shape[-1] = dh // group
        scale = torch.rand(scale_shape, dtype=torch.float16) * 0.02
    else:
        cache, scale = torch.randn(stored, dtype=torch.float16), None
    t = sum(seqlens)
    q = torch.randn(t, num_heads, dh, dtype=torch.float16)
    k, v = torch.randn(t, hkv, dh, dtype=torch.float16), torch.randn(t, hkv, dh, dtype=torch.float16)
    mask = torch.randn(t, sum(kvlens) + 3, dtype=torch.float16) if variant == "int4" else None
    args = (q, k, v, seqstarts, kvstarts, cachestarts, torch.tensor(start_pos), torch.tensor([1]),
            max(seqlens), max(kvlens), cache, scale, mask)
    kwargs = dict(num_heads=num_heads, head_dim=dh, is_causal=True, is_alibi=variant == "paged", num_kv_heads=hkv,
                  num_layer=num_layer, layer_idx=layer_idx, quant_bit=quant_bit, quant_group=group,
                  cache_mode=mode, cache_layout=layout, page_size=page_size)
    return args, kwargs


VARIANTS = {
    "paged_decode": ["gqa", "mqa", "mha", "features", "fp8", "int8", "int4", "mla"],   # mla: D 48 = 32 + 16
    "paged_prefill": ["mixed", "noncausal", "int4", "fp8", "mla"],   # mla: value head dim D / 2
    "context_attention": ["causal", "mqa", "cross", "fp8", "mla"],
    "kv_cache_write": ["bf16", "fp32", "fp8", "int8", "int4", "rope", "latent"],
    "merge_states": ["plain"],
    "cache_attention": ["offset", "paged", "int8", "int4"],
}


def sample(op: str, variant: str):
    return globals()[op](variant)


# the attention options that the kernels' feature tests run one at a time and all together:
# name -> (query heads, device) -> keyword arguments
FEATURES = {
    "alibi": lambda hq, dev: {"alibi_slopes": reference.alibi_slopes(hq).to(dev)},
    "window": lambda hq, dev: {"window_left": 100},
    "window_sinks": lambda hq, dev: {"window_left": 37, "sink_tokens": 20},
    "learned_sinks": lambda hq, dev: {"sinks": torch.randn(hq, device=dev) * 2},
    "softcap": lambda hq, dev: {"softcap": 8.0},
    "out_scale": lambda hq, dev: {"out_scale": torch.tensor(0.02, device=dev)},
    "scale": lambda hq, dev: {"scale": 0.3, "q_scaling": 2.0},
    "all": lambda hq, dev: {"alibi_slopes": reference.alibi_slopes(hq).to(dev), "window_left": 64,
                            "sink_tokens": 5, "sinks": torch.randn(hq, device=dev), "softcap": 10.0,
                            "out_scale": torch.tensor(0.03, device=dev)},
}
