"""Compile the Triton launches of representative calls for sm_90 without a GPU: GPU-only
compile errors (inline PTX, layouts, shared memory) show on a CPU machine. Each argument is
specialized as a launch specializes it (16-byte alignment, integers equal to 1), so the compiled
code takes the same paths as on the GPU (vectorized, pipelined loads). Run with TRITON_INTERPRET
unset: `python -m tests.torch_ops.kernels.triton.sm90_compile`; prints one line per call and exits
non-zero if one fails."""

import sys

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource

from torch_ops import kv_cache
from torch_ops.kernels.triton import context_attention, kv_cache_write, launcher, paged_decode, paged_prefill
from torch_ops.kernels.triton import mla_decode as mla

TARGET = GPUTarget("cuda", 90, 32)
compiled: list[str] = []


def compile_launch(self: launcher.TritonLaunch, *tensors) -> None:
    """Stands in for `TritonLaunch.__call__`: compiles the launch's kernel instead of running it."""
    values = [*tensors, *self.scalars]
    signature, constants, attrs = {}, {}, {}
    for i, p in enumerate(self.fn.params):
        if p.name in self.meta or p.is_constexpr:
            signature[p.name] = "constexpr"
            constants[p.name] = self.meta.get(p.name, p.default)
            continue
        kind, attr = native_specialize_impl(CUDABackend, values[i], False, not p.do_not_specialize,
                                            not p.do_not_specialize_on_alignment)
        signature[p.name] = kind
        if kind == "constexpr":   # an integer argument equal to 1
            constants[p.name] = attr
        elif attr:
            attrs[(i,)] = CUDABackend.parse_attr(attr)
    options = {k: self.meta[k] for k in ("num_warps", "num_stages") if k in self.meta}
    kernel = triton.compile(ASTSource(self.fn, signature, constants, attrs), target=TARGET, options=options)
    compiled.append(f"{self.fn.__name__} ({kernel.metadata.shared} B shared memory)")


def _cache(fmt, blocks=64, page=16, d=128):
    group = 32 if fmt in (torch.int8, torch.uint8) else None
    cache = kv_cache.PagedKVCache.allocate(blocks, page, 8, d, fmt, quant_group=group, scale_dtype=torch.float16)
    return cache, {k: v for k, v in cache.scale_kwargs().items() if v is not None}


def decode(fmt, key_mask=False, splits=None):
    cache, kw = _cache(fmt)
    q = torch.zeros(4, 32, 128, dtype=torch.bfloat16)
    args = (q, cache.k, cache.v, torch.zeros(4, 8, dtype=torch.int32), torch.full((4,), 100, dtype=torch.int32))
    if key_mask:
        kw["key_mask"] = torch.ones(4, 128, dtype=torch.bool)
    out, lse = torch.empty_like(q), torch.empty(4, 32)
    with paged_decode.tuning(dequant_asm=True, num_splits=splits):   # the GPU's dequantizing PTX
        paged_decode.prepare(*args, out=out, lse=lse, **kw)(*args, out=out, lse=lse, **kw)


def prefill(paged, key_mask=False, fmt=torch.bfloat16, d=128, dv=128):
    q = torch.zeros(256, 32, d, dtype=torch.bfloat16)
    out, lse = torch.empty(256, 32, dv, dtype=torch.bfloat16), torch.empty(256, 32)
    cu = torch.tensor([0, 100, 256], dtype=torch.int32)
    kw = {"key_mask": torch.ones(256, 300, dtype=torch.bool)} if key_mask else {}
    if paged:
        cache, scales = _cache(fmt, d=d)
        values = cache if dv == d else _cache(fmt, d=dv)[0]
        args = (q, cache.k, values.v, torch.zeros(2, 20, dtype=torch.int32), cu, torch.tensor([150, 300], dtype=torch.int32))
        kw.update(scales)
        paged_prefill.prepare(*args, out=out, lse=lse, **kw)(*args, out=out, lse=lse, **kw)
    else:
        k, v = torch.zeros(300, 8, d, dtype=torch.bfloat16), torch.zeros(300, 8, dv, dtype=torch.bfloat16)
        args = (q, k, v, cu, torch.tensor([0, 100, 300], dtype=torch.int32))
        context_attention.prepare(*args, out=out, lse=lse, causal=True, **kw)(*args, out=out, lse=lse, **kw)


def mla_decode(fmt, qps=1, splits=None, key_mask=False, config=None):
    """DeepSeek-V3's absorbed decode: 128 query heads over one latent KV head of 576 dims, values its
    first 512 (`config`: tiles forced, e.g. those `mla_decode.config` picks on an sm_90 device)."""
    k = torch.zeros(256, 64, 1, 576, dtype=fmt)
    kw = {"k_scale": torch.tensor(1.0), "v_scale": torch.tensor(1.0)} if fmt != torch.bfloat16 else {}
    if key_mask:
        kw["key_mask"] = torch.ones(4 * qps, 4096, dtype=torch.bool)
    q = torch.zeros(4 * qps, 128, 576, dtype=torch.bfloat16)
    args = (q, k, k[..., :512], torch.zeros(4, 64, dtype=torch.int32), torch.full((4,), 4096, dtype=torch.int32))
    out, lse = torch.empty(4 * qps, 128, 512, dtype=torch.bfloat16), torch.empty(4 * qps, 128)
    with paged_decode.tuning(num_splits=splits, config=config):
        paged_decode.prepare(*args, out=out, lse=lse, **kw)(*args, out=out, lse=lse, **kw)


def cache_write(fmt):
    cache, kw = _cache(fmt)
    key, slots = torch.zeros(32, 8, 128, dtype=torch.bfloat16), torch.arange(32, dtype=torch.int32)
    kv_cache_write.prepare(key, key, cache.k, cache.v, slots, **kw)(key, key, cache.k, cache.v, slots, **kw)


def latent_write(fmt):
    """An MLA latent cache: the RoPE part (rotated, with the queries') and the compressed part of each row."""
    latent = torch.zeros(256, 64, 1, 576, dtype=fmt)
    kw = {"k_scale": torch.tensor(1.0), "v_scale": torch.tensor(1.0)} if fmt != torch.bfloat16 else {}
    kw.update(positions=torch.zeros(64, dtype=torch.int32), cos_sin_cache=torch.zeros(4096, 64), rope_neox=False,
              query=torch.zeros(64, 128, 576, dtype=torch.bfloat16)[..., 512:])
    args = (torch.zeros(64, 1, 64, dtype=torch.bfloat16), torch.zeros(64, 1, 512, dtype=torch.bfloat16),
            latent[..., 512:], latent[..., :512], torch.arange(64, dtype=torch.int32))
    kv_cache_write.prepare(*args, **kw)(*args, **kw)


CALLS = {
    "paged_decode bf16, key_mask, split-K": lambda: decode(torch.bfloat16, key_mask=True, splits=2),
    "paged_decode FP8, key_mask": lambda: decode(torch.float8_e4m3fn, key_mask=True),
    "paged_decode INT4, split-K": lambda: decode(torch.uint8, splits=2),
    "context_attention, key_mask": lambda: prefill(False, key_mask=True),
    "paged_prefill INT8, key_mask": lambda: prefill(True, key_mask=True, fmt=torch.int8),
    "context_attention D 192, D_v 128": lambda: prefill(False, d=192, dv=128),
    "paged_prefill D 192, D_v 128": lambda: prefill(True, d=192, dv=128),
    "kv_cache_write INT8": lambda: cache_write(torch.int8),
    "paged_decode MLA bf16, split-K": lambda: mla_decode(torch.bfloat16, splits=4),
    "paged_decode MLA FP8, 4 tokens": lambda: mla_decode(torch.float8_e4m3fn, qps=4),
    "paged_decode MLA bf16, key_mask": lambda: mla_decode(torch.bfloat16, key_mask=True),
    "paged_decode MLA bf16, sm_90 tiles": lambda: mla_decode(torch.bfloat16, config=mla.config(128, False, sm90=True)),
    "kv_cache_write MLA latent FP8, RoPE": lambda: latent_write(torch.float8_e4m3fn),
}


def main() -> int:
    launcher.TritonLaunch.__call__ = compile_launch
    failed = 0
    for name, call in CALLS.items():
        compiled.clear()
        try:
            call()
            print(f"ok {name}: {', '.join(compiled)}", flush=True)
        except Exception as e:  # noqa: BLE001 - report every call
            failed += 1
            print(f"FAILED {name}: {type(e).__name__}: {str(e)[:2000]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
