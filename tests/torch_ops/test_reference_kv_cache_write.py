"""`kv_cache_write` against the naive quantization of docs/ops.md (reference_helpers.py), with the
fused RoPE against naive rotations."""

from __future__ import annotations

import math

import pytest
import torch

import torch_ops  # noqa: F401  (registers torch.ops.attn)

from .reference_helpers import (
    D, F64, FORMATS, FP8_MAX, GROUP, PLAIN, assert_bitwise_equal, dequant_vector, make_cache, rand, store_vector,
    token_scale,
)


def random_slots(num_tokens, capacity, num_skipped=3) -> torch.Tensor:
    """Distinct random slots, `num_skipped` of them negative (-1 or another negative value)."""
    slots = torch.randperm(capacity)[:num_tokens]
    skipped = torch.randperm(num_tokens)[:num_skipped]
    slots[skipped] = -torch.randint(1, 9, (num_skipped,))
    return slots.int()


@pytest.mark.parametrize("repeated", [False, True], ids=["distinct", "repeated"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_kv_cache_write(fmt, repeated):
    """Tokens land at `slot = block * block_size + offset` in the cache format (FP8 saturating,
    INT8/INT4 with new group scales, the 1e-5 scale floor on a tiny head); negative slots are
    skipped and the rest of the cache is untouched. key/value are views of a fused QKV tensor.
    Of tokens sharing a slot, the last one lands, whole (values and group scales)."""
    hkv, block_size, num_blocks, t = 2, 3, 5, 7
    dtype, kind = FORMATS[fmt]
    k_cache, v_cache, k_scale, v_scale = make_cache(num_blocks, block_size, hkv, fmt)
    qkv = rand(t, 4 + 2 * hkv, D, dtype=dtype if dtype in PLAIN else torch.bfloat16) * 3
    key, value = qkv[:, 4:4 + hkv], qkv[:, 4 + hkv:]
    key[2, 1] *= 1e-6
    if dtype in FP8_MAX:  # scales that make the largest values saturate
        for x, s in ((key, k_scale), (value, v_scale)):
            amax = x.float().abs().amax(dim=(0, 2)) if kind == "head" else x.float().abs().amax()
            s.copy_(amax / (1.25 * FP8_MAX[dtype]))
    slots = random_slots(t, num_blocks * block_size)
    if repeated:
        written = (slots >= 0).nonzero().flatten()
        slots[written[-1]] = slots[written[-3]] = slots[written[0]]
    expected = [x.clone() if x is not None else None for x in (k_cache, v_cache, k_scale, v_scale)]
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        for h in range(hkv):
            where = (slot // block_size, slot % block_size, h)
            store_vector(expected[0], expected[2], where, key[i, h].tolist())
            store_vector(expected[1], expected[3], where, value[i, h].tolist())
    scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
    ret = torch.ops.attn.kv_cache_write(key, value, k_cache, v_cache, slots, **scales)
    assert ret.numel() == 0
    for actual, expect in zip((k_cache, v_cache, k_scale, v_scale), expected):
        if expect is not None:
            assert_bitwise_equal(actual, expect)


def random_cos_sin(max_position: int, rotary_dim: int) -> torch.Tensor:
    """A `[max_position, rotary_dim]` fp32 table: cosines of random angles, then their sines."""
    angles = torch.rand(max_position, rotary_dim // 2, dtype=F64) * 2 * math.pi
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def naive_rope(x, positions, cos_sin, neox: bool) -> torch.Tensor:
    """docs: NeoX rotates `(x[i], x[i + R/2])`, GPT-J `(x[2i], x[2i+1])`, as
    `(a, b) -> (a cos - b sin, b cos + a sin)` with `cos_sin[pos] = [cos..., sin...]`; float64."""
    half = cos_sin.shape[1] // 2
    out = []
    for t, pos in enumerate(positions.tolist()):
        row = cos_sin[pos].double().tolist()
        cos, sin = row[:half], row[half:]
        heads = []
        for vec in x[t].double().tolist():
            rotated = list(vec)
            for i in range(half):
                ia, ib = (i, i + half) if neox else (2 * i, 2 * i + 1)
                a, b = vec[ia], vec[ib]
                rotated[ia], rotated[ib] = a * cos[i] - b * sin[i], b * cos[i] + a * sin[i]
            heads.append(rotated)
        out.append(heads)
    return torch.tensor(out, dtype=F64)


def assert_rounded(actual, exact, magnitude):
    """`actual` is `exact` rounded to its dtype, up to fp32 arithmetic on values of `magnitude`."""
    eps = torch.finfo(actual.dtype).eps
    torch.testing.assert_close(actual.double(), exact, rtol=eps, atol=4 * 2**-24 * magnitude)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("rotary_dim", [D, D // 2], ids=["full", "partial"])
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
def test_kv_cache_write_rope(neox, rotary_dim, dtype):
    """RoPE on key (before it is written) and query (returned as a new tensor); dims past
    `rotary_dim` pass through; values are written unrotated."""
    t, hq, hkv, block_size, num_blocks = 5, 4, 2, 3, 4
    cos_sin = random_cos_sin(16, rotary_dim)
    positions = torch.randint(0, 16, (t,), dtype=torch.int32)
    q, key, value = rand(t, hq, D, dtype=dtype), rand(t, hkv, D, dtype=dtype), rand(t, hkv, D, dtype=dtype)
    q_before = q.clone()
    k_cache, v_cache, _, _ = make_cache(num_blocks, block_size, hkv, "fp16" if dtype == torch.float16 else "fp32")
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = random_slots(t, num_blocks * block_size, num_skipped=1)
    rq = torch.ops.attn.kv_cache_write(key, value, k_cache, v_cache, slots, query=q, positions=positions,
                                       cos_sin_cache=cos_sin, rope_neox=neox)
    assert rq.dtype == dtype and rq.shape == q.shape and torch.equal(q, q_before)
    assert_rounded(rq, naive_rope(q, positions, cos_sin, neox), q.abs().max().item())
    assert torch.equal(rq[..., rotary_dim:], q[..., rotary_dim:])
    rotated_key = naive_rope(key, positions, cos_sin, neox)
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, off = divmod(slot, block_size)
        written[block, off] = True
        assert_rounded(k_cache[block, off], rotated_key[i], key.abs().max().item())
        assert torch.equal(k_cache[block, off, :, rotary_dim:], key[i, :, rotary_dim:])
        assert torch.equal(v_cache[block, off], value[i])
    assert torch.equal(k_cache[~written], k_before[~written]) and torch.equal(v_cache[~written], v_before[~written])


def assert_quantizes(cache, scale, where, x: list[float], magnitude: float) -> None:
    """`cache[where]` holds `x` quantized per the docs, up to which side of a rounding boundary
    an fp32 error of `magnitude * 1e-6` lands on: INT8/INT4 group scales are
    `max(absmax / qmax, 1e-5)` and elements within half a step; FP8 elements are within half an
    ulp of `clamp(x / scale)`."""
    stored = cache[where]
    if stored.dtype in FP8_MAX:
        s = token_scale(scale, where, where[-1])
        half_ulp, half_tiny = {torch.float8_e4m3fn: (2**-4, 2**-10), torch.float8_e5m2: (2**-3, 2**-17)}[stored.dtype]
        m = FP8_MAX[stored.dtype]
        for code, e in zip(stored.double().tolist(), x):
            target = min(max(e / s, -m), m)
            assert abs(code - target) <= max(abs(target) * half_ulp, half_tiny) * 1.001 + magnitude * 1e-6 / s
        return
    qmax = 127 if stored.dtype == torch.int8 else 7
    scales = token_scale(scale, where, where[-1])
    got = dequant_vector(stored, scales)
    for g, s in enumerate(scales):
        xs = x[g * GROUP:(g + 1) * GROUP]
        assert s == pytest.approx(max(max(map(abs, xs)) / qmax, 1e-5), rel=1e-6)
        for value, e in zip(got[g * GROUP:(g + 1) * GROUP], xs):
            assert abs(value - e) <= s / 2 + magnitude * 1e-6


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("fmt", ["e4m3-per-head", "e5m2", "int8", "int4"])
def test_kv_cache_write_rope_quantized(fmt, neox):
    """fp32 keys rotated (partial rotary dim) and then quantized into FP8/INT8/INT4 caches; values
    quantized unrotated."""
    t, hkv, block_size, num_blocks, rotary_dim = 5, 2, 3, 4, D // 2
    cos_sin = random_cos_sin(16, rotary_dim)
    positions = torch.randint(0, 16, (t,), dtype=torch.int32)
    key, value = torch.randn(t, hkv, D) * 2, torch.randn(t, hkv, D) * 2
    k_cache, v_cache, k_scale, v_scale = make_cache(num_blocks, block_size, hkv, fmt)
    slots = random_slots(t, num_blocks * block_size, num_skipped=1)
    torch.ops.attn.kv_cache_write(key, value, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale,
                                  positions=positions, cos_sin_cache=cos_sin, rope_neox=neox)
    rotated = naive_rope(key, positions, cos_sin, neox)
    magnitude = max(key.abs().max().item(), value.abs().max().item())
    for i, slot in enumerate(slots.tolist()):
        for h in range(hkv):
            if slot >= 0:
                where = (slot // block_size, slot % block_size, h)
                assert_quantizes(k_cache, k_scale, where, rotated[i, h].tolist(), magnitude)
                assert_quantizes(v_cache, v_scale, where, value[i, h].tolist(), magnitude)
