"""What each backend serves, asked of the backends' own checks (`unsupported`, `problem_reasons`).

Each property is varied alone from a default call (bf16, head dim 128, 32 query / 8 KV heads,
16-token pages, one query per sequence, no options) on small CPU tensors; a backend serves a
value if its checks give no reason against it. Device requirements (Triton: CUDA; CUTLASS and
the CUDA decode kernel: Hopper, their library built) are left out: `torch_ops.explain` reports
them for a real call. `vanilla` (the reference) serves every call the op's validation accepts.

    python -m torch_ops.support           # print the tables
    python -m torch_ops.support --write docs/guide.md   # replace the tables between the markers
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Callable

import torch

from . import kv_cache, ops
from .kernels.cuda import decode_sm90, fmha_sm90

HQ, HKV, D, PAGE = 32, 8, 128, 16
BEGIN, END = "<!-- support matrix: begin (python -m torch_ops.support --write docs/guide.md) -->", "<!-- support matrix: end -->"
CACHES = {"fp16/bf16": None, "FP8 e4m3": torch.float8_e4m3fn, "FP8 e5m2": torch.float8_e5m2,
          "INT8 (groups of 8)": (torch.int8, 8), "INT8 (groups of 32)": (torch.int8, 32),
          "INT4 (groups of 8)": (torch.uint8, 8), "INT4 (groups of 32)": (torch.uint8, 32)}
OPTIONS = {"ALiBi": dict(alibi_slopes=torch.rand(HQ)), "sliding window": dict(window_left=64),
           "sink tokens": dict(window_left=64, sink_tokens=4), "learned sinks": dict(sinks=torch.randn(HQ)),
           "soft-cap": dict(softcap=30.0), "FP8 output": dict(out_scale=torch.tensor(0.1))}


def _cache(cache, d: int, page: int, query_dtype=torch.bfloat16):
    """A cache of `cache` (a dtype, `(dtype, quant group)`, or None: the query's dtype)."""
    dtype, group = cache if isinstance(cache, tuple) else (cache or query_dtype, None)
    cache = kv_cache.PagedKVCache.allocate(4, page, HKV, d, dtype, quant_group=group, scale_dtype=torch.float16,
                                           device="cpu")
    return cache.k, cache.v, {k: v for k, v in cache.scale_kwargs().items() if v is not None}


def _decode(dtype=torch.bfloat16, cache=None, d=D, page=PAGE, qps=1, dv=None, **options):
    k, v, scales = _cache(cache, d, page, dtype)
    if dv is not None:   # an MLA latent cache: values are the keys' first dv dims
        v = k[..., :dv]
    q = torch.zeros(2 * qps, HQ, d, dtype=dtype)
    return (q, k, v, torch.zeros(2, 4, dtype=torch.int32), torch.full((2,), page, dtype=torch.int32)), {**scales, **options}


def _prefill(dtype=torch.bfloat16, cache=None, d=D, page=PAGE, **options):
    k, v, scales = _cache(cache, d, page, dtype)
    q = torch.zeros(64, HQ, d, dtype=dtype)
    cu = torch.tensor([0, 32, 64], dtype=torch.int32)
    return (q, k, v, torch.zeros(2, 4, dtype=torch.int32), cu, torch.full((2,), 64, dtype=torch.int32)), \
        {"causal": True, **scales, **options}


def _context(dtype=torch.bfloat16, d=D, **options):
    q, k, v = (torch.zeros(64, h, d).to(dtype) for h in (HQ, HKV, HKV))
    cu = torch.tensor([0, 64], dtype=torch.int32)
    if dtype == torch.float8_e4m3fn:
        options = {**{f"{x}_scale": torch.tensor(1.0) for x in "qkv"}, **options}
    return (q, k, v, cu, cu), {"causal": True, **options}


def _kv_write(dtype=torch.bfloat16, cache=None, d=D, page=PAGE, rope=False, dv=None):
    k, v, scales = _cache(cache, d + (dv or 0), page, dtype)
    key = torch.zeros(4, HKV, d, dtype=dtype)
    value = torch.zeros(4, HKV, dv or d, dtype=dtype)
    if dv is not None:   # an MLA latent cache: the compressed part (values), then the RoPE part (keys)
        k, v = k[..., dv:], k[..., :dv]
    kwargs = dict(scales)
    if rope:
        kwargs.update(positions=torch.zeros(4, dtype=torch.int32), cos_sin_cache=torch.zeros(16, d))
    return (key, value, k, v, torch.arange(4, dtype=torch.int32)), kwargs


def _triton(op: str) -> Callable:
    from .kernels.triton import KERNEL_MODULES

    return importlib.import_module(KERNEL_MODULES[op]).unsupported


# op -> (call builder, {backend: device-independent checks}, {property: {value: builder kwargs}})
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
_HEAD_DIMS = (64, 80, 96, 128, 192, 256, 512)
_PAGES = (1, 8, 16, 32, 64, 128)
_AXES = {
    "paged_decode": (_decode, {"triton": "triton", "cuda": decode_sm90.problem_reasons}, {
        "query dtype": {k: {"dtype": v} for k, v in _DTYPES.items()},
        "KV cache": {k: {"cache": v} for k, v in CACHES.items()},
        "head dim": {d: {"d": d} for d in _HEAD_DIMS},
        "block size": {p: {"page": p} for p in _PAGES},
        "queries per sequence": {n: {"qps": n} for n in (1, 2, 4, 8)},
        "D / D_v (values of their own head dim)": {"576 / 512 (MLA)": {"d": 576, "dv": 512},
                                                   "192 / 128": {"d": 192, "dv": 128}},
        "options": {**OPTIONS, "key mask": dict(key_mask=torch.ones(2, 64, dtype=torch.bool))},
    }),
    "paged_prefill": (_prefill, {"triton": "triton", "cutlass": lambda *a, **k: fmha_sm90.paged_problem_reasons(*a[:4], **k)}, {
        "query dtype": {k: {"dtype": v} for k, v in _DTYPES.items()},
        "KV cache": {k: {"cache": v} for k, v in CACHES.items()},
        "head dim": {d: {"d": d} for d in _HEAD_DIMS},
        "block size": {p: {"page": p} for p in _PAGES},
        "options": {**OPTIONS, "key mask": dict(key_mask=torch.ones(64, 64, dtype=torch.bool))},
    }),
    "context_attention": (_context, {"triton": "triton", "cutlass": lambda *a, **k: fmha_sm90.problem_reasons(*a[:3], **k)}, {
        "query dtype": {**{k: {"dtype": v} for k, v in _DTYPES.items()}, "FP8 e4m3": {"dtype": torch.float8_e4m3fn}},
        "head dim": {d: {"d": d} for d in _HEAD_DIMS},
        "options": {**OPTIONS, "key mask": dict(key_mask=torch.ones(64, 64, dtype=torch.bool))},
    }),
    "kv_cache_write": (_kv_write, {"triton": "triton"}, {
        "key dtype": {k: {"dtype": v} for k, v in _DTYPES.items()},
        "KV cache": {k: {"cache": v} for k, v in CACHES.items()},
        "head dim": {d: {"d": d} for d in _HEAD_DIMS},
        "block size": {p: {"page": p} for p in _PAGES},
        "fused RoPE": {"yes": {"rope": True}},
        "D / D_v (values of their own head dim)": {"64 / 512 (MLA latent)": {"d": 64, "dv": 512, "rope": True}},
    }),
}


def served(op: str) -> dict[str, dict[str, list]]:
    """`{property: {backend: [values it serves]}}` for `op` (values the op's validation rejects
    are left out: no backend serves them)."""
    build, backends, axes = _AXES[op]
    checkers = {name: _triton(op) if check == "triton" else check for name, check in backends.items()}
    table: dict[str, dict[str, list]] = {}
    for prop, values in axes.items():
        table[prop] = {"vanilla": [], **{name: [] for name in checkers}}
        for value, change in values.items():
            try:
                args, kwargs = build(**change)
                args, kwargs = ops.with_schema_defaults(op, lambda *a, **k: (tuple(a), k))(*args, **kwargs)
                ops.SPECS[op].check(*args, **kwargs)
            except (ValueError, TypeError):
                continue
            table[prop]["vanilla"].append(value)
            for name, check in checkers.items():
                if not check(*args, **kwargs):
                    table[prop][name].append(value)
    return table


def markdown() -> str:
    """One table per op: a row per property, a column per backend listing the values it serves."""
    lines = []
    for op in _AXES:
        table = served(op)
        names = list(next(iter(table.values())))
        lines += [f"**`attn::{op}`**", "", "| | " + " | ".join(f"`{n}`" for n in names) + " |",
                  "|---" * (len(names) + 1) + "|"]
        for prop, by_backend in table.items():
            lines.append(f"| {prop} | " + " | ".join(", ".join(map(str, by_backend[n])) or "-" for n in names) + " |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def write(path: Path) -> None:
    """Replace the text between the support-matrix markers of `path` with `markdown()`."""
    text = path.read_text()
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    path.write_text(f"{head}{BEGIN}\n{markdown()}{END}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", type=Path, help="a markdown file with the support-matrix markers")
    args = parser.parse_args()
    if args.write:
        write(args.write)
    else:
        print(markdown())


if __name__ == "__main__":
    main()
