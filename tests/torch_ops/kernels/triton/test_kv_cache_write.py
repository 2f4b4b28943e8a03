"""The Triton `attn::kv_cache_write` kernel against `reference.kv_cache_write` (docs/ops.md).

Every call goes through `torch.ops.attn.kv_cache_write` inside `use_backend("triton")`; the
reference runs on clones of the same caches, which are poisoned first (NaN, or 0x7F bytes), so
that every slot not in `slot_mapping` must come back with its poison. key/value (and query) are
strided views of one fused QKV tensor `[T, (Hq + 2 * Hkv) * D]`.

- Without RoPE: caches and scale caches bitwise equal to the reference.
- With RoPE (fp32 rounding may differ): values still bitwise; plain keys and the rotated query
  within the error-ratio bound against a float64 rotation; quantized keys: codes within +-1,
  group scales within 1e-6 relative (one ulp for fp16 scale caches), dequantized keys within
  one quantization step of the reference's.

On CPU the kernel runs in Triton's interpreter (tiny shapes); the broad matrix, large shapes,
a >2^31-element cache and CUDA-graph capture/replay are marked `gpu`.
"""

from __future__ import annotations

import random
import struct
from fractions import Fraction

import pytest
import torch

import torch_ops
from torch_ops import kv_cache, quant, reference
from torch_ops.kernels.triton import kv_cache_write as kcw
from torch_ops.gpu import capture_cuda_graph
from torch_ops.testing import assert_error_ratio, poison_

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
INT8, INT4 = torch.int8, torch.uint8
PLAIN = (FP16, BF16, FP32)


# ---- problem construction ----------------------------------------------------------------------


def make_problem(device, *, cache_dtype, t=9, hq=4, hkv=2, d=64, bs=4, layout="NHD", group=None,
                 scale_dtype=FP32, fp8_per_head=False, rope=None, rot=None, with_query=False, dtype=BF16,
                 index_dtype=torch.int32, num_blocks=None, num_skipped=2, high_slots=False):
    """Random inputs and a poisoned cache. Returns `(key, value, cache, slots, kwargs)` where
    kwargs holds the scales and, with `rope` ("neox"/"gptj"), positions, cos/sin and query."""
    dtype = cache_dtype if cache_dtype in PLAIN else dtype
    nb = num_blocks or -(-t // bs) + 3
    fp8 = cache_dtype in (E4M3, E5M2)
    fp8_scale = torch.ones(hkv if fp8_per_head else ()) if fp8 else None
    cache = kv_cache.PagedKVCache.allocate(nb, bs, hkv, d, cache_dtype, layout=layout, quant_group=group,
                                           scale_dtype=scale_dtype, fp8_scale=fp8_scale, device=device)
    for x in (cache.k, cache.v) + ((cache.k_scale, cache.v_scale) if group else ()):
        poison_(x)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, dtype=dtype, device=device) * 3
    heads = qkv.view(t, hq + 2 * hkv, d)
    query, key, value = heads[:, :hq], heads[:, hq:hq + hkv], heads[:, hq + hkv:]
    if t:
        key[0, 0] *= 1e-7                  # a tiny head: the 1e-5 floor of INT8/INT4 group scales
        value[0, 0, :4] = torch.tensor([0.0, -0.0, 1.0, -1.0])   # signed zeros keep their sign
    if fp8:                                # scales that make the largest values saturate
        for x, s in ((key, cache.k_scale), (value, cache.v_scale)):
            amax = x.float().abs().amax(dim=(0, 2)) if fp8_per_head else x.float().abs().amax()
            s.copy_(amax / (1.25 * torch.finfo(cache_dtype).max))
    capacity = nb * bs
    slots = torch.randperm(capacity)[:t] if not high_slots else capacity - 1 - torch.randperm(min(capacity, 4 * t))[:t]
    slots[torch.randperm(t)[:num_skipped]] = -torch.randint(1, 9, (num_skipped,))
    kwargs = {} if cache.k_scale is None else cache.scale_kwargs()
    if rope:
        rot = rot or d
        angles = torch.rand(64, rot // 2, dtype=torch.float64) * 6.3
        kwargs.update(positions=torch.randint(0, 64, (t,), dtype=index_dtype, device=device),
                      cos_sin_cache=torch.cat([angles.cos(), angles.sin()], -1).float().to(device),
                      rope_neox=rope == "neox")
        if with_query:
            kwargs["query"] = query
    return key, value, cache, slots.to(device=device, dtype=index_dtype), kwargs


def clone(cache: kv_cache.PagedKVCache) -> kv_cache.PagedKVCache:
    c = lambda x: None if x is None else x.clone()
    return kv_cache.PagedKVCache(c(cache.k), c(cache.v), c(cache.k_scale), c(cache.v_scale))


def call_triton(key, value, cache, slots, kwargs):
    with torch_ops.use_backend("triton"):
        return torch.ops.attn.kv_cache_write(key, value, cache.k, cache.v, slots, **kwargs)


# ---- comparison --------------------------------------------------------------------------------


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1).contiguous().view(torch.uint8)


def assert_bitwise(actual, expected, name):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, name
    diff = (bits(actual) != bits(expected)).sum().item()
    assert diff == 0, f"{name}: {diff} bytes differ"


def rope64(x, positions, cos_sin, neox: bool) -> torch.Tensor:
    """The rotation of docs/ops.md in float64 (the truth for the error-ratio bound)."""
    half = cos_sin.shape[1] // 2
    cs = cos_sin[positions.long()].double()
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    x = x.double()
    out = x.clone()
    ia, ib = (slice(0, half), slice(half, 2 * half)) if neox else (slice(0, 2 * half, 2), slice(1, 2 * half, 2))
    a, b = x[..., ia], x[..., ib]
    out[..., ia], out[..., ib] = a * cos - b * sin, b * cos + a * sin
    return out


def codes(x: torch.Tensor) -> torch.Tensor:
    """Stored codes as integers in value order: INT8 as is, INT4 unpacked, FP8 bit patterns as
    signed magnitudes (adjacent FP8 values differ by 1)."""
    if x.dtype == INT8:
        return x.int()
    if x.dtype == INT4:
        return quant.unpack_int4(x).int()
    b = x.view(torch.uint8).int()
    return torch.where(b >= 128, -(b - 128), b)


def one_step(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Dequantized size of one code step at each element of the quantized `x [N, H, D or D/2]`."""
    if x.dtype in (E4M3, E5M2):
        mant, emin = (3, -6) if x.dtype == E4M3 else (2, -14)
        v = x.float().abs()
        exp = torch.floor(torch.log2(v.clamp_min(2.0 ** emin)))
        s = scale.float().reshape(-1, 1) if scale.dim() else scale.float()
        return 2.0 ** (exp - mant) * s
    d = x.shape[-1] * (2 if x.dtype == INT4 else 1)
    return scale.float().repeat_interleave(d // scale.shape[-1], dim=-1)


def gather_rows(x: torch.Tensor, rows) -> torch.Tensor:
    """`x[rows]` through a byte view (CUDA has no advanced indexing for every FP8 op)."""
    return x.view(torch.uint8)[rows].view(x.dtype)


def check(cache, before, key, value, slots, kwargs, rq):
    """`cache` (ours, after the call) and `rq` against the reference run on `before` (a clone of
    the poisoned cache before the call)."""
    ref = clone(before)
    ref_rq = reference.kv_cache_write(key, value, ref.k, ref.v, slots,
                                      **dict(kwargs, **({} if ref.k_scale is None else ref.scale_kwargs())))
    fmt = cache.format
    keep = slots >= 0
    rows = (slots[keep].long() // cache.block_size, slots[keep].long() % cache.block_size)
    written = torch.zeros(cache.k.shape[:2], dtype=torch.bool, device=cache.k.device)
    written[rows] = True
    tensors = {"k_cache": (cache.k, ref.k, before.k), "v_cache": (cache.v, ref.v, before.v)}
    if fmt.group_scaled:
        tensors.update(k_scale=(cache.k_scale, ref.k_scale, before.k_scale),
                       v_scale=(cache.v_scale, ref.v_scale, before.v_scale))
    for name, (ours, _, old) in tensors.items():
        assert_bitwise(gather_rows(ours, ~written), gather_rows(old, ~written), f"{name} outside slot_mapping")
    if fmt is quant.KVFormat.FP8:   # scales are inputs: never written
        assert_bitwise(cache.k_scale, before.k_scale, "k_scale")
        assert_bitwise(cache.v_scale, before.v_scale, "v_scale")
    rope = kwargs.get("positions") is not None
    for name, (ours, expect, _) in tensors.items():
        if not (rope and name.startswith("k")):              # values are never rotated
            assert_bitwise(ours, expect, name)
    if rope:
        check_rotated_key(cache, ref, rows, key[keep], kwargs["positions"][keep], kwargs)
    query = kwargs.get("query")
    if query is None:
        assert rq.numel() == 0
        return
    rot = kwargs["cos_sin_cache"].shape[1]
    assert rq.shape == query.shape and rq.dtype == query.dtype
    truth = rope64(query, kwargs["positions"], kwargs["cos_sin_cache"], kwargs["rope_neox"])
    assert_error_ratio(rq, truth, ref_rq, name="rotated query")
    assert_bitwise(rq[..., rot:], query[..., rot:], "query dims past rotary_dim")


def check_rotated_key(cache, ref, rows, key, positions, kwargs):
    """Rotated keys at `rows`: plain within the error-ratio bound of a float64 rotation;
    quantized codes within +-1 of the reference's, group scales within 1e-6 relative (an ulp for
    fp16 scales), and dequantized values within half a step (INT8/INT4) or a step (FP8, after
    saturation) of the float64 rotation, plus its fp32 rounding."""
    fmt = cache.format
    ours, theirs = gather_rows(cache.k, rows), gather_rows(ref.k, rows)
    truth = rope64(key, positions, kwargs["cos_sin_cache"], kwargs["rope_neox"])
    if fmt is quant.KVFormat.PLAIN:
        assert_error_ratio(ours, truth, theirs, name="rotated key")
        return
    diff = (codes(ours) - codes(theirs)).abs().max().item() if ours.numel() else 0
    assert diff <= 1, f"rotated key codes differ by {diff}"
    if fmt.group_scaled:
        scale, ref_scale = gather_rows(cache.k_scale, rows), gather_rows(ref.k_scale, rows)
        rtol = 1e-6 if scale.dtype == FP32 else torch.finfo(scale.dtype).eps
        torch.testing.assert_close(scale, ref_scale, rtol=rtol, atol=0)
        bound = one_step(ours, scale) / 2
    else:
        scale = cache.k_scale
        limit = torch.finfo(ours.dtype).max * (scale.double().reshape(-1, 1) if scale.dim() else scale.double())
        truth = torch.maximum(torch.minimum(truth, limit), -limit)
        bound = one_step(ours, scale)
    err = (quant.dequantize(ours, scale, fmt, torch.float64) - truth).abs()
    slack = 1e-5 * truth.abs().max().item() if truth.numel() else 0.0
    assert (err <= bound * 1.001 + slack).all(), "dequantized rotated key too far from the rotation"


def run_and_check(problem):
    key, value, cache, slots, kwargs = problem
    before = clone(cache)
    query_before = kwargs["query"].clone() if "query" in kwargs else None
    rq = call_triton(key, value, cache, slots, kwargs)
    if query_before is not None:
        assert_bitwise(kwargs["query"], query_before, "query (input) must not change")
    check(cache, before, key, value, slots, kwargs, rq)


# ---- CPU (interpreter) cases: few and tiny -----------------------------------------------------

# cache dtype, layout, block size, head dim, Hkv, group, scale dtype, fp8 per head, index dtype
NO_ROPE = [
    (BF16, "NHD", 16, 128, 2, None, FP32, False, torch.int32),
    (FP16, "HND", 1, 64, 4, None, FP32, False, torch.int64),
    (FP32, "combined_NHD", 5, 96, 1, None, FP32, False, torch.int32),
    (E4M3, "vllm", 16, 128, 2, None, FP32, False, torch.int32),
    (E5M2, "combined_HND", 3, 80, 2, None, FP32, True, torch.int64),
    (INT8, "NHD", 16, 128, 2, 32, FP16, False, torch.int32),
    (INT8, "HND", 7, 96, 2, 24, FP32, False, torch.int32),
    (INT4, "vllm", 1, 64, 4, 16, FP16, False, torch.int32),
    (INT4, "combined_NHD", 16, 128, 1, 128, FP32, False, torch.int64),
    (INT4, "HND", 5, 96, 2, 24, FP16, False, torch.int32),   # padded groups: stored group by group
]


@pytest.mark.parametrize("cache_dtype,layout,bs,d,hkv,group,scale_dtype,per_head,index_dtype", NO_ROPE,
                         ids=[f"{str(c[0])[6:]}-{c[1]}-bs{c[2]}-d{c[3]}-g{c[5]}" for c in NO_ROPE])
def test_write_bitwise(kernel_device, cache_dtype, layout, bs, d, hkv, group, scale_dtype, per_head, index_dtype):
    run_and_check(make_problem(kernel_device, cache_dtype=cache_dtype, layout=layout, bs=bs, d=d, hkv=hkv,
                               hq=2 * hkv, group=group, scale_dtype=scale_dtype, fp8_per_head=per_head,
                               index_dtype=index_dtype))


# cache dtype, style, rotary dim (None: D), with query, head dim, Hq/Hkv, group, scale dtype, layout
ROPE = [
    (BF16, "neox", None, True, 128, (8, 2), None, FP32, "NHD"),
    (BF16, "gptj", 32, True, 64, (4, 2), None, FP32, "HND"),
    (FP16, "neox", 48, False, 96, (4, 1), None, FP32, "vllm"),
    (FP32, "gptj", None, True, 64, (2, 2), None, FP32, "combined_HND"),
    (E4M3, "neox", 32, True, 64, (4, 2), None, FP32, "NHD"),
    (E5M2, "gptj", 48, False, 80, (4, 2), None, FP32, "combined_NHD"),
    (INT8, "gptj", None, True, 64, (4, 2), 16, FP16, "NHD"),
    (INT8, "neox", 64, False, 96, (2, 1), 24, FP32, "HND"),
    (INT4, "neox", 32, True, 128, (8, 2), 32, FP16, "vllm"),
    # NeoX over the whole head dim into FP8: rows taken as two halves (split_halves)
    (E4M3, "neox", None, True, 64, (4, 2), None, FP32, "HND"),
    (E5M2, "neox", None, False, 128, (2, 1), None, FP32, "combined_NHD"),
]


@pytest.mark.parametrize("cache_dtype,style,rot,with_query,d,heads,group,scale_dtype,layout", ROPE,
                         ids=[f"{str(c[0])[6:]}-{c[1]}-rot{c[2] or c[4]}-q{int(c[3])}-d{c[4]}" for c in ROPE])
def test_write_rope(kernel_device, cache_dtype, style, rot, with_query, d, heads, group, scale_dtype, layout):
    hq, hkv = heads
    run_and_check(make_problem(kernel_device, cache_dtype=cache_dtype, rope=style, rot=rot, with_query=with_query,
                               d=d, hq=hq, hkv=hkv, group=group, scale_dtype=scale_dtype, layout=layout,
                               fp8_per_head=cache_dtype == E4M3, dtype=FP16 if cache_dtype == E5M2 else BF16))


@pytest.mark.parametrize("cache_dtype", [INT8, INT4], ids=["int8", "int4"])
def test_group_scale_rounded_down(kernel_device, cache_dtype):
    # groups whose absmax (a bf16 input) makes the fp16 scale absmax / QMAX round down the most,
    # so that absmax / s exceeds QMAX (the kernel relies on rint bringing it back: it does not
    # clamp), with the other elements multiples of s / 2 (halfway points of x / s: x * RN(1 / s) may
    # fall on either side of them, and the reference must agree)
    key, value, cache, slots, kwargs = make_problem(kernel_device, cache_dtype=cache_dtype, t=8, hkv=2, d=64,
                                                    group=16, scale_dtype=FP16, num_skipped=0)
    qmax = 127.0 if cache_dtype == INT8 else 7.0
    candidates = torch.arange(0x3A00, 0x4400, dtype=torch.int16).view(BF16).float()    # bf16 values 5e-4..2
    over = candidates / (candidates / qmax).clamp(min=1e-5).to(FP16).float()   # up to 127.33 (subnormal s)
    worst = candidates[over.argsort(descending=True)[:128]]
    assert (over.sort(descending=True).values[:128] > qmax).all()
    e = torch.arange(16)
    groups = [x[t, h, 16 * g:16 * g + 16] for x in (key, value) for t in range(8) for h in range(2) for g in range(4)]
    for x, absmax in zip(groups, worst):
        s = (absmax / qmax).clamp(min=1e-5).to(FP16).float()
        ties = (e - 8) * 0.5 * s
        x.copy_(torch.where(e % 2 == 0, ties, absmax * torch.sign(ties + 0.1)))
    run_and_check((key, value, cache, slots, kwargs))


def test_head_blocks_and_odd_head_counts(kernel_device):
    # tiny tiles: several head blocks per token, with Hq = 12 and Hkv = 3 (not powers of 2)
    problem = make_problem(kernel_device, cache_dtype=INT4, group=16, d=64, hq=12, hkv=3, t=5, rope="gptj",
                           with_query=True)
    with kcw.tuning(tile_elems=dict.fromkeys(kcw.tuning.current.tile_elems, 128)):
        run_and_check(problem)


def test_out_of_range_slots_are_skipped(kernel_device):
    # not part of the contract (ATTN_DEBUG rejects them), but the kernel must not write out of
    # bounds: a slot >= num_blocks * block_size is skipped like a negative one
    key, value, cache, slots, kwargs = make_problem(kernel_device, cache_dtype=INT8, group=16)
    capacity = cache.num_blocks * cache.block_size
    skipped = slots.clone()
    valid = (slots >= 0).nonzero().flatten()[:2]
    slots[valid] = torch.tensor([capacity, capacity + 12345], dtype=slots.dtype, device=slots.device)
    skipped[valid] = -1
    before = clone(cache)
    rq = call_triton(key, value, cache, slots, kwargs)
    check(cache, before, key, value, skipped, kwargs, rq)


def test_no_tokens(kernel_device):
    key, value, cache, slots, kwargs = make_problem(kernel_device, cache_dtype=BF16, t=0, num_skipped=0,
                                                    rope="neox", with_query=True)
    before = clone(cache)
    rq = call_triton(key, value, cache, slots, kwargs)
    assert rq.shape == kwargs["query"].shape
    assert_bitwise(cache.k, before.k, "k_cache")


def test_unsupported_reasons():
    key = torch.empty(3, 2, 2048, dtype=BF16)
    cache = torch.empty(4, 16, 2, 2048, dtype=BF16)
    slots = torch.zeros(3, dtype=torch.int32)
    assert "head dim 2048" in " ".join(kcw.unsupported(key, key, cache, cache, slots))
    key = torch.empty(3, 2, 96, dtype=BF16)
    cache = torch.empty(4, 16, 2, 96, dtype=INT8)
    scale = torch.empty(4, 16, 2, 32)                      # quant group 3
    rope = dict(positions=torch.zeros(3, dtype=torch.int32), cos_sin_cache=torch.empty(8, 32))
    assert "even quant group" in " ".join(kcw.unsupported(key, key, cache, cache, slots, k_scale=scale,
                                                          v_scale=scale, rope_neox=False, **rope))
    assert kcw.unsupported(key, key, cache, cache, slots, k_scale=scale, v_scale=scale, rope_neox=True, **rope) == []
    assert kcw.unsupported(key, key, cache, cache, slots, k_scale=scale, v_scale=scale) == []


def _rn32(v: Fraction) -> Fraction:
    """`v` rounded to the nearest fp32 value, ties to even (normal and subnormal range)."""
    if v == 0:
        return Fraction(0)
    mag = abs(v)
    e = mag.numerator.bit_length() - mag.denominator.bit_length()
    if Fraction(2) ** e > mag:
        e -= 1
    ulp = Fraction(2) ** (max(e, -126) - 23)
    n = mag / ulp
    whole, frac = divmod(n.numerator, n.denominator)
    if 2 * frac > n.denominator or (2 * frac == n.denominator and whole % 2):
        whole += 1
    return (1 if v > 0 else -1) * whole * ulp


def test_group_scale_division_by_constant_reciprocal():
    # the GPU computes absmax / qmax as q = RN(x r), RN(q + RN(x - q qmax) r) with r = RN(1 / qmax)
    # (`_div_by_qmax`); in exact arithmetic that must be the correctly rounded quotient
    rng = random.Random(0)
    bits = [rng.getrandbits(31) for _ in range(3000)] + [1, 0x007FFFFF, 0x00800000, 0x3F800000, 0x7F7FFFFF]
    for fmt, rcp in kcw._QMAX_RCP.items():
        qmax, r = fmt.qmax, Fraction(rcp)
        assert r == _rn32(Fraction(1) / Fraction(qmax))
        for b in bits:
            if (b >> 23) & 0xFF == 0xFF:
                continue
            x = Fraction(struct.unpack("<f", struct.pack("<I", b))[0])
            q = _rn32(x * r)
            got = _rn32(q + _rn32(x - q * int(qmax)) * r)
            assert got == _rn32(x / int(qmax)), (qmax, hex(b))


def test_split_halves_only_for_fp8_and_whole_neox_rotations():
    from torch_ops.kernels.triton import kv_cache_write as kcw
    cache = {dt: torch.empty(1, 16, 1, 64, dtype=dt) for dt in (BF16, E4M3, INT8)}
    cos_sin = {rot: torch.empty(8, rot) for rot in (32, 64)}
    pos = torch.zeros(1, dtype=torch.int64)
    assert kcw.split_halves(64, cache[E4M3], pos, cos_sin[64], True)
    assert not kcw.split_halves(64, cache[E4M3], pos, cos_sin[32], True)         # partial rotation
    assert not kcw.split_halves(64, cache[E4M3], pos, cos_sin[64], False)        # GPT-J pairs are adjacent
    assert not kcw.split_halves(64, cache[E4M3], None, None, True)               # no RoPE
    assert not kcw.split_halves(96, cache[E4M3], pos, torch.empty(8, 96), True)  # not a power of two
    assert not kcw.split_halves(64, cache[BF16], pos, cos_sin[64], True)         # measured slower
    assert not kcw.split_halves(64, cache[INT8], pos, cos_sin[64], True)
    assert kcw.group_layout(64, cache[E4M3], None, True) == (32, 2, 1, 32)
    assert kcw.group_layout(64, cache[E4M3], None) == (64, 1, 1, 64)


def test_tile_depends_on_shapes_only():
    # (tokens, heads) per program: ~`Tuning.tile_elems` elements, fewer tokens when T is small
    with kcw.tuning(min_programs_per_sm=4):
        assert kcw.tile(16384, 8, 128, 132, 4096) == (4, 8)
        assert kcw.tile(16384, 8, 128, 132, 2048) == (2, 8)
        assert kcw.tile(16384, 32, 128, 132, 4096) == (1, 32)
        assert kcw.tile(16384, 1, 128, 132, 4096) == (16, 1)
        assert kcw.tile(64, 8, 128, 132, 4096) == (1, 8)
        assert kcw.tile(3, 8, 128, 1, 4096) == (1, 8)
        assert kcw.tile(9, 2, 64, 1, 4096) == (2, 2)
        assert kcw.tile(1, 64, 1024, 132, 4096) == (1, 4)


# ---- GPU: the broad matrix ---------------------------------------------------------------------

# cache dtype, group, scale dtype, head dim, block size, (Hq, Hkv), layout, extra
MATRIX = [
    (BF16, None, FP32, 128, 16, (32, 8), "NHD", {}),
    (BF16, None, FP32, 64, 1, (8, 1), "HND", {"index_dtype": torch.int64}),
    (FP16, None, FP32, 80, 17, (8, 2), "combined_NHD", {}),
    (FP16, None, FP32, 256, 256, (16, 4), "vllm", {}),
    (FP32, None, FP32, 96, 16, (4, 4), "combined_HND", {}),
    (E4M3, None, FP32, 128, 16, (32, 8), "NHD", {}),
    (E4M3, None, FP32, 96, 5, (8, 2), "vllm", {"fp8_per_head": True}),
    (E5M2, None, FP32, 256, 64, (8, 1), "HND", {"fp8_per_head": True}),
    (INT8, 32, FP16, 128, 16, (32, 8), "NHD", {}),
    (INT8, 24, FP32, 96, 16, (8, 2), "combined_HND", {}),
    (INT8, 128, FP16, 128, 1, (8, 8), "vllm", {}),
    (INT8, 5, FP32, 80, 16, (4, 2), "NHD", {}),
    (INT4, 32, FP16, 128, 16, (32, 8), "NHD", {}),
    (INT4, 16, FP32, 80, 33, (8, 2), "HND", {}),
    (INT4, 2, FP16, 64, 16, (4, 1), "combined_NHD", {}),
    (INT4, 256, FP32, 256, 16, (16, 2), "vllm", {}),
]
ROPE_VARIANTS = [None, ("neox", None, True), ("gptj", None, True), ("neox", "half", False), ("gptj", "half", True)]


@pytest.mark.gpu
@pytest.mark.parametrize("rope", ROPE_VARIANTS,
                         ids=["norope", "neox-full-q", "gptj-full-q", "neox-half", "gptj-half-q"])
@pytest.mark.parametrize("cache_dtype,group,scale_dtype,d,bs,heads,layout,extra", MATRIX,
                         ids=[f"{str(c[0])[6:]}-g{c[1]}-d{c[3]}-bs{c[4]}-{c[5][0]}x{c[5][1]}-{c[6]}" for c in MATRIX])
@pytest.mark.parametrize("t", [1, 300])
def test_matrix(kernel_device, t, cache_dtype, group, scale_dtype, d, bs, heads, layout, extra, rope):
    if rope and rope[0] == "gptj" and group and group % 2:
        pytest.skip("GPT-J RoPE needs an even quant group (unsupported says so)")
    style, rot, with_query = rope or (None, None, False)
    rot = d // 2 if rot == "half" else None
    hq, hkv = heads
    run_and_check(make_problem(kernel_device, cache_dtype=cache_dtype, group=group, scale_dtype=scale_dtype, d=d,
                               bs=bs, hq=hq, hkv=hkv, layout=layout, t=t, num_skipped=min(t - 1, 7),
                               rope=style, rot=rot, with_query=with_query, **extra))


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype,group", [(BF16, None), (E4M3, None), (INT8, 32), (INT4, 32)])
@pytest.mark.parametrize("rope", [None, "neox", "gptj"])
def test_large(kernel_device, cache_dtype, group, rope):
    run_and_check(make_problem(kernel_device, cache_dtype=cache_dtype, group=group, scale_dtype=FP16, t=16384,
                               hq=32, hkv=8, d=128, bs=16, num_blocks=1200, num_skipped=100,
                               rope=rope, with_query=rope is not None))


@pytest.mark.gpu
def test_cache_over_2g_elements(kernel_device):
    # an FP8 cache of 2.3e9 elements per tensor, written in its last blocks: int64 addressing
    nb = 2**31 // (16 * 8 * 128) + 4096
    problem = make_problem(kernel_device, cache_dtype=E4M3, t=1000, hq=32, hkv=8, d=128, bs=16, num_blocks=nb,
                           high_slots=True, rope="neox", with_query=True)
    assert problem[2].k.numel() > 2**31
    run_and_check(problem)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype,group,rope", [(BF16, None, "neox"), (E4M3, None, "gptj"), (INT8, 16, None),
                                                    (INT4, 32, "neox")])
def test_cuda_graph_replay(kernel_device, cache_dtype, group, rope):
    """Capture one call; then write new tokens, slots, positions (and FP8 scales) into the
    captured tensors in place, replay, and compare each replay with the reference."""
    t = 96
    key, value, cache, slots, kwargs = make_problem(kernel_device, cache_dtype=cache_dtype, group=group, t=t,
                                                    hq=16, hkv=4, d=128, bs=16, num_blocks=64, rope=rope,
                                                    with_query=rope is not None)
    qkv = key._base                      # the fused QKV tensor that key, value and query view
    positions = kwargs.get("positions")

    def fill(step):
        qkv.normal_()
        new = torch.randperm(cache.num_blocks * cache.block_size, device=slots.device)[:t].to(slots.dtype)
        new[step % t] = -1
        slots.copy_(new)
        if positions is not None:
            positions.random_(0, kwargs["cos_sin_cache"].shape[0])
        if cache.format is quant.KVFormat.FP8:
            cache.k_scale.mul_(1.5)
            cache.v_scale.mul_(0.75)

    def call():
        return call_triton(key, value, cache, slots, kwargs)

    graph, rq = capture_cuda_graph(call)
    for step in range(1, 4):
        fill(step)
        before = clone(cache)
        graph.replay()
        torch.cuda.synchronize()
        check(cache, before, key, value, slots, kwargs, rq)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_nan_in_a_group_makes_its_scale_nan_as_in_the_reference(kernel_device, fmt):
    """One policy on every backend: a NaN key reads back as NaN in its whole group, never as 0."""
    dtype = torch.int8 if fmt == "int8" else torch.uint8
    caches = {}
    for backend in ("vanilla", "triton"):
        cache = kv_cache.PagedKVCache.allocate(2, 4, 2, 16, dtype, quant_group=8, device=kernel_device)
        key = torch.randn(3, 2, 16, device=kernel_device, dtype=torch.bfloat16)
        key[1, 0, 3] = float("nan")
        slots = torch.tensor([0, 1, 2], dtype=torch.int32, device=kernel_device)
        with torch_ops.use_backend(backend):
            torch.ops.attn.kv_cache_write(key, key, cache.k, cache.v, slots, **cache.scale_kwargs())
        caches[backend] = cache.dequantized()[0][0, :3]
    for got in caches.values():
        assert got[1, 0, :8].isnan().all() and not got[1, 0, 8:].isnan().any() and not got[[0, 2]].isnan().any()
