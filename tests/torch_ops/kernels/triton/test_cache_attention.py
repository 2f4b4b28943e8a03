"""The Triton `attn::cache_attention` (PPL MultiHeadCacheAttention on kv_cache_write + paged_decode /
paged_prefill) against the reference (docs/ops.md).

Each call runs on copies of one random multi-layer PPL cache: the Triton path (`use_backend("triton")`,
every `torch.empty`/`empty_like` allocation poisoned, so an unwritten output or metadata entry shows),
the float64 reference (truth) and the reference in the query dtype (baseline). The caches after the
calls must be bitwise equal; the output must pass `assert_error_ratio`. Cache rows of a sequence sit
at random, unaligned places: offset regions in random order with gaps, pages in random order, and
page-table entries past a sequence's pages point far outside the cache (reading one would fault).

On CPU the kernels run in Triton's interpreter on tiny shapes (every mode x layout once, each quant
setting in both modes, and the features); the full matrix at real sizes and CUDA graphs are `gpu`.
"""

from __future__ import annotations

import random

import pytest
import torch

import torch_ops
from torch_ops import backends, quant, reference
from torch_ops.kernels.triton import cache_attention as ca
from torch_ops.testing import assert_error_ratio, assert_replays_match_eager, poison_

F64 = torch.float64
LAYOUT_DIMS = {0: "T L KV H", 1: "L T KV H", 2: "L KV T H", 3: "L KV H T"}  # Dh last (docs/ops.md)
FAR_PAGE = 2**30   # page-table entries past a sequence's pages


def make_problem(device, *, seqlens, start_pos, hq=4, hkv=2, d=16, cache_mode=0, cache_layout=0, quant_bit=0,
                 page_size=4, page_shift=0, is_causal=True, is_alibi=False, decoding_batches=None,
                 dtype=torch.float16, scale_dtype=torch.float16, int4_dtype=torch.int8, group=8, num_layer=3,
                 layer_idx=1, max_kvlen=None, index_dtype=torch.int32):
    """(args, kwargs) of one cache_attention call. Offset mode: each sequence gets a region of its
    kv length plus a random gap, in random order. Page mode: random pages, their starts shifted by
    `page_shift` rows (unaligned pages)."""
    rng = random.Random(torch.randint(0, 2**31, ()).item())
    kvlens = [s + p for s, p in zip(seqlens, start_pos)]
    b_count = len(seqlens)
    if cache_mode == 0:
        sizes = [n + rng.randint(0, 5) for n in kvlens]
        order = list(range(b_count))
        rng.shuffle(order)
        starts, row = [0] * b_count, rng.randint(0, 3)
        for b in order:
            starts[b], row = row, row + sizes[b]
        cachestarts, max_t = torch.tensor(starts), row + 1
    else:
        need = [-(-n // page_size) for n in kvlens]
        num_pages = sum(need) + 2
        ids = torch.randperm(num_pages).tolist()
        cachestarts = torch.full((b_count, max(need + [1]) + 1), FAR_PAGE)
        for b, n in enumerate(need):
            cachestarts[b, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.long) * page_size + page_shift
        max_t = num_pages * page_size + page_shift

    x = torch.randn(max_t, num_layer, 2, hkv, d)
    order = [["T", "L", "KV", "H", "Dh"].index(n) for n in LAYOUT_DIMS[cache_layout].split() + ["Dh"]]
    scale = None
    if quant_bit:
        cache, scale = quant.quantize_groupwise(x, quant_bit, group, scale_dtype)
        cache = cache.view(int4_dtype) if quant_bit == 4 else cache
        scale = scale.permute(order).contiguous().to(device)
    else:
        cache = x.to(dtype)
    cache = cache.permute(order).contiguous().to(device)

    t = sum(seqlens)
    idx = dict(dtype=index_dtype, device=device)
    args = (torch.randn(t, hq, d, dtype=dtype, device=device),
            torch.randn(t, hkv, d, dtype=dtype, device=device), torch.randn(t, hkv, d, dtype=dtype, device=device),
            torch.tensor([0] + seqlens, **idx).cumsum(0, dtype=index_dtype),
            torch.tensor([0] + kvlens, **idx).cumsum(0, dtype=index_dtype),
            cachestarts.to(**idx), torch.tensor(start_pos, **idx),
            torch.tensor([_leading_decodes(seqlens) if decoding_batches is None else decoding_batches], **idx),
            max(seqlens + [0]), max_kvlen or max(kvlens + [0]), cache, scale, None)
    kwargs = dict(num_heads=hq, head_dim=d, is_causal=is_causal, is_alibi=is_alibi,
                  num_kv_heads=0 if hq == hkv else hkv, num_layer=num_layer, layer_idx=layer_idx,
                  quant_bit=quant_bit, quant_group=group, cache_mode=cache_mode, cache_layout=cache_layout,
                  page_size=page_size)
    return args, kwargs


def _leading_decodes(seqlens) -> int:
    return next((i for i, s in enumerate(seqlens) if s != 1), len(seqlens))


def _with_cache(args, query=None):
    """`args` with copies of the cache and scale (and another query)."""
    args = list(args)
    args[10] = args[10].clone()
    args[11] = None if args[11] is None else args[11].clone()
    if query is not None:
        args[0] = query
    return args


@pytest.fixture
def poisoned(monkeypatch):
    """Every torch.empty / torch.empty_like allocation filled with NaN (or 0x7F bytes)."""
    for name in ("empty", "empty_like"):
        original = getattr(torch, name)

        def allocate(*a, _original=original, **kw):
            t = _original(*a, **kw)
            poison_(t)
            return t

        monkeypatch.setattr(torch, name, allocate)


def check(problem, expect_kernel=None, monkeypatch=None, exact_rows=None):
    """Run the Triton path and the references on copies of the cache; compare caches and output
    (only `exact_rows`, a bool `[T]`, if given: the others must be finite)."""
    args, kwargs = problem
    used = []
    for module in (ca.paged_decode, ca.paged_prefill) if expect_kernel is not None else ():
        def spy(*a, _module=module, _prepare=module.prepare, **kw):
            used.append(_module)
            return _prepare(*a, **kw)

        monkeypatch.setattr(module, "prepare", spy)
    ours = _with_cache(args)
    with torch_ops.use_backend("triton"):
        out = torch.ops.attn.cache_attention(*ours, **kwargs)
    truth_args = _with_cache(args, args[0].double())
    truth = reference.cache_attention(*truth_args, **kwargs, compute_dtype=F64)
    base = reference.cache_attention(*_with_cache(args), **kwargs, compute_dtype=args[0].dtype)
    assert torch.equal(ours[10].view(torch.uint8), truth_args[10].view(torch.uint8)), "cache differs from the reference"
    if ours[11] is not None:
        assert torch.equal(ours[11], truth_args[11]), "scale cache differs from the reference's"
    assert out.dtype == args[0].dtype and out.shape == args[0].shape
    if exact_rows is not None:
        assert torch.isfinite(out).all(), "rows of a sequence with an absent page must stay finite"
        out, truth, base = out[exact_rows], truth[exact_rows], base[exact_rows]
    assert_error_ratio(out, truth, base)
    if expect_kernel is not None:
        assert used == [expect_kernel]


# ---- CPU (interpreter) -------------------------------------------------------------------------

MIXED = dict(seqlens=[1, 5, 3], start_pos=[6, 0, 9])


@pytest.mark.parametrize("cache_layout", [0, 1, 2, 3])
@pytest.mark.parametrize("cache_mode", [0, 1], ids=["offset", "paged"])
def test_modes_layouts_quant(kernel_device, poisoned, cache_mode, cache_layout):
    """A decode and two causal prefills (GQA) in every mode x layout; each quant setting in both modes."""
    quant_bit = (0, 8, 4, 8)[cache_layout]
    check(make_problem(kernel_device, **MIXED, cache_mode=cache_mode, cache_layout=cache_layout,
                       quant_bit=quant_bit))


CPU_CASES = {
    "MHA-not-causal": dict(hkv=4, is_causal=False),
    "MQA-int4-uint8": dict(hkv=1, quant_bit=4, int4_dtype=torch.uint8, cache_layout=3),
    "alibi-6-heads": dict(hq=6, hkv=3, is_alibi=True, cache_mode=1),
    "bf16-fp32-scales": dict(dtype=torch.bfloat16, quant_bit=8, scale_dtype=torch.float32),
    "fp32": dict(dtype=torch.float32, cache_layout=2),
    "unaligned-pages": dict(cache_mode=1, page_shift=1, page_size=3, quant_bit=4),
    "padding-sequence": dict(seqlens=[1, 0, 4], start_pos=[3, 0, 2]),
    "max-bounds-above-lengths": dict(max_kvlen=40),
    "int64-metadata-paged": dict(index_dtype=torch.int64, cache_mode=1, quant_bit=8),
}


@pytest.mark.parametrize("case", list(CPU_CASES))
def test_features(kernel_device, poisoned, case):
    check(make_problem(kernel_device, **{**MIXED, **CPU_CASES[case]}))


@pytest.mark.parametrize("seqlens,is_causal,kernel", [
    ([1, 1, 1], True, "paged_decode"),        # decodes
    ([3, 3], True, "paged_decode"),           # speculative decoding: uniform, causal
    ([3, 3], False, "paged_prefill"),         # uniform but not causal
    ([1, 2], True, "paged_prefill"),          # mixed
], ids=["decodes", "uniform-causal", "uniform-not-causal", "mixed"])
def test_kernel_choice(kernel_device, poisoned, monkeypatch, seqlens, is_causal, kernel):
    """Batches whose sequences all have the same 1..8 causal new tokens (from shapes: T = B * max_seqlen)
    run paged_decode, everything else one paged_prefill."""
    problem = make_problem(kernel_device, seqlens=seqlens, start_pos=[7, 2, 0][:len(seqlens)], is_causal=is_causal,
                           quant_bit=8, cache_mode=1, decoding_batches=0 if max(seqlens) > 1 else None)
    check(problem, getattr(ca, kernel), monkeypatch)


def test_growing_max_kvlen_is_planned_once_per_power_of_two(kernel_device, monkeypatch):
    """A decode loop's max_kvlen grows every step: calls plan (and on CUDA, replay) per power-of-two
    bucket of it, and every bound in a bucket gives the reference's result."""
    args, kwargs = make_problem(kernel_device, seqlens=[1, 1], start_pos=[7, 2])
    planned = []
    monkeypatch.setattr(ca, "prepare", lambda *a, _prepare=ca.prepare, **kw: planned.append(a[9]) or _prepare(*a, **kw))
    for max_kvlen in (9, 12, 16, 17):
        check((args[:9] + (max_kvlen,) + args[10:], kwargs))
    assert planned == [16, 32]


def test_mask_runs_on_vanilla(kernel_device):
    args, kwargs = make_problem(kernel_device, **MIXED)
    args = list(args)
    args[12] = torch.randn(args[0].shape[0], int(args[4][-1]) + 2, dtype=args[0].dtype, device=kernel_device)
    assert any("attn_mask" in r for r in ca.unsupported(*args, **kwargs))
    assert backends.backend_for("cache_attention", *args, **kwargs) == "vanilla"
    with torch_ops.use_backend("triton"), pytest.raises(ValueError, match="attn_mask"):
        torch.ops.attn.cache_attention(*args, **kwargs)


def test_block_size():
    assert ca._block_size(10_000, 0, 128) == ca.OFFSET_BLOCK
    assert ca._block_size(40, 0, 128) == 40           # a cache shorter than a block
    assert ca._block_size(10_000, 1, 128) == 128
    assert ca._block_size(10_000, 1, 384) == 192      # pages above 256 rows: a divisor
    assert ca._block_size(10_000, 1, 100) == 100


# ---- GPU ---------------------------------------------------------------------------------------

GPU_LENGTHS = {
    "decodes": dict(seqlens=[1] * 6, start_pos=[0, 1, 127, 128, 999, 4000]),
    "mixed": dict(seqlens=[1, 1, 300, 17, 1, 129], start_pos=[77, 2000, 0, 513, 4095, 128]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("batch", list(GPU_LENGTHS))
@pytest.mark.parametrize("quant_bit", [0, 8, 4])
@pytest.mark.parametrize("cache_layout", [0, 1, 2, 3])
@pytest.mark.parametrize("cache_mode", [0, 1], ids=["offset", "paged"])
def test_matrix_gpu(kernel_device, poisoned, cache_mode, cache_layout, quant_bit, batch):
    check(make_problem(kernel_device, **GPU_LENGTHS[batch], hq=32, hkv=8, d=128, cache_mode=cache_mode,
                       cache_layout=cache_layout, quant_bit=quant_bit, page_size=128, dtype=torch.float16,
                       group=8, num_layer=2))


GPU_CASES = {
    "MHA-alibi": dict(hq=16, hkv=16, is_alibi=True),
    "MQA-alibi-12-heads": dict(hq=12, hkv=1, is_alibi=True, quant_bit=8),
    "not-causal": dict(is_causal=False, quant_bit=4),
    "bf16": dict(dtype=torch.bfloat16, quant_bit=8, scale_dtype=torch.float32),
    "fp32": dict(dtype=torch.float32),
    "d64": dict(d=64, quant_bit=4, group=16),
    "d256": dict(d=256, quant_bit=8, group=32),
    "pages-384": dict(cache_mode=1, page_size=384, quant_bit=8),
    "pages-16-unaligned": dict(cache_mode=1, page_size=16, page_shift=5),
    "int4-uint8": dict(quant_bit=4, int4_dtype=torch.uint8, cache_layout=3),
}


@pytest.mark.gpu
@pytest.mark.parametrize("batch", list(GPU_LENGTHS))
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_features_gpu(kernel_device, poisoned, case, batch):
    options = {**dict(hq=32, hkv=8, d=128, page_size=64), **GPU_CASES[case]}   # a case overrides the defaults
    check(make_problem(kernel_device, **GPU_LENGTHS[batch], **options))


@pytest.mark.gpu
@pytest.mark.parametrize("batch", list(GPU_LENGTHS))
def test_cuda_graph_replay(kernel_device, batch):
    """Capture one call; write new positions, lengths, pages and inputs into the captured tensors
    (same shapes and bounds), replay, and compare with an eager call and the reference."""
    max_kvlen, page = 4400, 64
    seqlens = GPU_LENGTHS[batch]["seqlens"]
    args, kwargs = make_problem(kernel_device, seqlens=seqlens, start_pos=[max_kvlen - s for s in seqlens],
                                cache_mode=1, quant_bit=8, hq=32, hkv=8, d=128, page_size=page)
    q, cur_k, cur_v, _, kvstarts, cachestarts, start_pos = args[:7]
    num_pages = args[10].shape[0] // page   # layout 0: MaxT first
    out = torch.empty_like(q)
    rng = random.Random(torch.randint(0, 2**31, ()).item())

    def fill(step):
        pos = [rng.randint(0, max_kvlen - s) for s in seqlens]
        kvlens = [p + s for p, s in zip(pos, seqlens)]
        start_pos.copy_(torch.tensor(pos))
        kvstarts.copy_(torch.tensor([0] + kvlens).cumsum(0))
        ids = torch.randperm(num_pages).tolist()
        table = torch.full(cachestarts.shape, FAR_PAGE)
        for b, n in enumerate(kvlens):
            table[b, :-(-n // page)] = torch.tensor([ids.pop() * page for _ in range(-(-n // page))])
        cachestarts.copy_(table)
        for x in (q, cur_k, cur_v):
            x.normal_()

    def call():
        out.copy_(torch.ops.attn.cache_attention(*args, **kwargs))

    def check_replay(replayed):
        truth = reference.cache_attention(*_with_cache(args, q.double()), **kwargs, compute_dtype=F64)
        base = reference.cache_attention(*_with_cache(args), **kwargs, compute_dtype=q.dtype)
        assert_error_ratio(replayed, truth, base)

    with torch_ops.use_backend("triton"):
        assert_replays_match_eager(call, fill, (out,), check_replay)
