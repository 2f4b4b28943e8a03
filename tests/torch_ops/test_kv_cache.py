"""KV-cache number formats (`torch_ops.quant`), views, layouts and allocation
(`torch_ops.kv_cache`). Block management is tested in test_block_tables.py."""

import pytest
import torch

from torch_ops import quant
from torch_ops.kv_cache import (
    LAYOUTS,
    PagedKVCache,
    from_combined,
    from_hnd,
    from_vllm,
    random_,
)

# (storage dtype, quant_group) of every format.
FORMATS = [
    (torch.float16, None),
    (torch.bfloat16, None),
    (torch.float32, None),
    (torch.float8_e4m3fn, None),
    (torch.float8_e5m2, None),
    (torch.int8, 16),
    (torch.uint8, 32),
]


def gen(seed):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# quant.py
# ---------------------------------------------------------------------------------------------


def test_kv_format_by_dtype():
    assert quant.kv_format(torch.bfloat16) is quant.KVFormat.PLAIN
    assert quant.kv_format(torch.float8_e5m2) is quant.KVFormat.FP8
    assert quant.kv_format(torch.int8) is quant.KVFormat.INT8
    assert quant.kv_format(torch.uint8) is quant.KVFormat.INT4
    assert (quant.KVFormat.INT8.bits, quant.KVFormat.INT4.bits) == (8, 4)
    with pytest.raises(TypeError, match="int32"):
        quant.kv_format(torch.int32)


def test_pack_int4_bit_layout():
    # Element 2i in the low nibble, 2i+1 in the high nibble, both stored as q + 8.
    q = torch.tensor([[-8, 7], [3, -1], [0, -5]], dtype=torch.int8)
    expected = torch.tensor([[0x0 | 0xF << 4], [0xB | 0x7 << 4], [0x8 | 0x3 << 4]],
                            dtype=torch.uint8)
    assert torch.equal(quant.pack_int4(q), expected)


def test_pack_unpack_int4_round_trip():
    q = torch.randint(-8, 8, (3, 5, 64), dtype=torch.int8)
    packed = quant.pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 32)
    assert torch.equal(quant.unpack_int4(packed), q)
    # Every byte value unpacks and packs back to itself.
    all_bytes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(quant.pack_int4(quant.unpack_int4(all_bytes)), all_bytes)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
def test_groupwise_shapes_and_error_bound(bits, scale_dtype):
    x = torch.randn(4, 3, 2, 64) * 3
    q, scale = quant.quantize_groupwise(x, bits, 16, scale_dtype)
    assert scale.shape == (4, 3, 2, 4) and scale.dtype == scale_dtype
    assert q.dtype == (torch.int8 if bits == 8 else torch.uint8)
    assert q.shape == ((4, 3, 2, 64) if bits == 8 else (4, 3, 2, 32))
    qmax = 127 if bits == 8 else 7
    values = quant.unpack_int4(q) if bits == 4 else q
    assert values.abs().max() == qmax  # each group's absmax maps to +-qmax
    # The scale is absmax / qmax (rounded to scale_dtype).
    absmax = x.reshape(4, 3, 2, 4, 16).abs().amax(-1)
    torch.testing.assert_close(scale, (absmax / qmax).to(scale_dtype), rtol=0, atol=0)
    # Round to nearest: the error is at most half a step.
    deq = quant.dequantize_groupwise(q, scale, bits)
    step = scale.float().repeat_interleave(16, dim=-1)
    assert torch.all((deq - x).abs() <= step * 0.5 * (1 + 1e-5))


def test_groupwise_zero_group_uses_eps_scale():
    x = torch.randn(2, 32)
    x[0, :16] = 0
    q, scale = quant.quantize_groupwise(x, 8, 16)
    assert scale[0, 0] == quant.GROUP_SCALE_EPS
    assert torch.all(q[0, :16] == 0)
    assert torch.all(scale[:, 1] > quant.GROUP_SCALE_EPS)


def test_groupwise_bad_arguments():
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        quant.quantize_groupwise(x, 2, 16)
    with pytest.raises(ValueError, match="quant group 48 must divide the head dim 64"):
        quant.quantize_groupwise(x, 8, 48)


@pytest.mark.parametrize("dtype", quant.FP8_DTYPES)
def test_fp8_saturates_instead_of_nan(dtype):
    m = quant.fp8_max(dtype)
    scale = torch.tensor(0.5)
    x = torch.tensor([[10 * m, -10 * m, m, 1.0]])
    q = quant.quantize_fp8(x, scale, dtype)
    assert q.dtype == dtype
    torch.testing.assert_close(q.float(), torch.tensor([[m, -m, m, 2.0]]), rtol=0, atol=0)
    deq = quant.dequantize_fp8(q, scale)
    torch.testing.assert_close(deq, torch.tensor([[m / 2, -m / 2, m / 2, 1.0]]))


@pytest.mark.parametrize("dtype", quant.FP8_DTYPES)
@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_round_trip_error_bound(dtype, per_head):
    x = torch.randn(6, 4, 3, 32) * 5  # |x / scale| stays below 448
    scale = torch.rand(3) + 0.1 if per_head else torch.tensor(0.1)
    q = quant.quantize_fp8(x, scale, dtype)
    deq = quant.dequantize_fp8(q, scale)
    # Relative error of round to nearest with 3 (e4m3) or 2 (e5m2) mantissa bits, plus the
    # absolute error of the smallest subnormal step for tiny values.
    rel = 2.0 ** -(4 if dtype == torch.float8_e4m3fn else 3)
    tiny = torch.finfo(dtype).smallest_normal * (scale.reshape(-1, 1) if per_head else scale)
    assert torch.all((deq - x).abs() <= rel * x.abs() + tiny)
    if per_head:  # each head uses its own scale
        head = 1
        torch.testing.assert_close(deq[:, :, head], quant.dequantize_fp8(q[:, :, head], scale[head]))


@pytest.mark.parametrize("dtype, group", FORMATS)
def test_quantize_dequantize_round_trip(dtype, group):
    x = torch.randn(5, 2, 4, 64)
    fmt = quant.kv_format(dtype)
    fp8_scale = torch.tensor(0.01) if fmt is quant.KVFormat.FP8 else None
    stored, group_scales = quant.quantize(x, fp8_scale, dtype, group or 0)
    assert stored.dtype == dtype
    assert (group_scales is not None) == fmt.group_scaled
    scale = group_scales if fmt.group_scaled else fp8_scale
    deq = quant.dequantize(stored, scale, fmt)
    assert deq.shape == x.shape and deq.dtype == torch.float32
    tol = {torch.float32: 0, torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.int8: 0.02,
           torch.float8_e4m3fn: 0.07, torch.float8_e5m2: 0.13, torch.uint8: 0.3}[dtype]
    assert (deq - x).abs().max() <= tol * x.abs().max()


def test_quantize_and_dequantize_need_scales():
    x = torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match="k_scale/v_scale"):
        quant.quantize(x, None, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="needs its scale"):
        quant.dequantize(x.to(torch.int8), None, quant.KVFormat.INT8)


# ---------------------------------------------------------------------------------------------
# Views of users' tensors
# ---------------------------------------------------------------------------------------------


def _same_storage(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_from_hnd_is_a_view_with_the_right_positions():
    nb, h, bs, d = 3, 4, 5, 8
    k_phys = torch.randn(nb, h, bs, d)
    v_phys = torch.randn(nb, h, bs, d)
    k, v = from_hnd(k_phys, v_phys)
    assert k.shape == v.shape == (nb, bs, h, d)
    assert _same_storage(k, k_phys) and _same_storage(v, v_phys)
    k[2, 1, 3] = 100.0
    v[1, 4, 0] = -100.0
    assert torch.all(k_phys[2, 3, 1] == 100.0) and torch.all(v_phys[1, 0, 4] == -100.0)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_from_combined_is_a_view_with_the_right_positions(layout):
    nb, h, bs, d = 3, 4, 5, 8
    shape = (nb, 2, bs, h, d) if layout == "NHD" else (nb, 2, h, bs, d)
    kv = torch.randn(shape)
    k, v = from_combined(kv, layout)
    assert k.shape == v.shape == (nb, bs, h, d)
    assert _same_storage(k, kv) and _same_storage(v, kv)
    k[2, 1, 3] = 100.0
    v[1, 4, 0] = -100.0
    if layout == "NHD":
        assert torch.all(kv[2, 0, 1, 3] == 100.0) and torch.all(kv[1, 1, 4, 0] == -100.0)
    else:
        assert torch.all(kv[2, 0, 3, 1] == 100.0) and torch.all(kv[1, 1, 0, 4] == -100.0)
    assert (kv.abs() == 100.0).sum() == 2 * d


def test_from_vllm_is_a_view_with_the_right_positions():
    kv = torch.randn(2, 3, 5, 4, 8)
    k, v = from_vllm(kv)
    assert k.shape == v.shape == (3, 5, 4, 8)
    assert _same_storage(k, kv) and _same_storage(v, kv)
    k[2, 1, 3] = 100.0
    v[1, 4, 0] = -100.0
    assert torch.all(kv[0, 2, 1, 3] == 100.0) and torch.all(kv[1, 1, 4, 0] == -100.0)


def test_view_constructors_reject_bad_shapes():
    with pytest.raises(ValueError, match=r"kv must be \[num_blocks, 2, block_size, Hkv, D\]"):
        from_combined(torch.randn(3, 3, 5, 4, 8))
    with pytest.raises(ValueError, match=r"kv must be \[num_blocks, 2, Hkv, block_size, D\]"):
        from_combined(torch.randn(3, 5, 4, 8), "HND")
    with pytest.raises(ValueError, match="layout must be 'NHD' or 'HND'"):
        from_combined(torch.randn(3, 2, 5, 4, 8), "vllm")
    with pytest.raises(ValueError, match=r"kv must be \[2, num_blocks"):
        from_vllm(torch.randn(3, 3, 5, 4, 8))
    with pytest.raises(ValueError, match=r"v must be \[num_blocks, Hkv, block_size, D\]"):
        from_hnd(torch.randn(3, 4, 5, 8), torch.randn(3, 4, 5))
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        from_hnd([1, 2], torch.randn(3, 4, 5, 8))


# ---------------------------------------------------------------------------------------------
# PagedKVCache
# ---------------------------------------------------------------------------------------------

# Where logical (block, token, head) of k (0) or v (1) lives in each layout's physical tensor.
PHYSICAL = {
    "NHD": (lambda nb, bs, h, d: (nb, bs, h, d), lambda kv, b, t, hh: (b, t, hh)),
    "HND": (lambda nb, bs, h, d: (nb, h, bs, d), lambda kv, b, t, hh: (b, hh, t)),
    "combined_NHD": (lambda nb, bs, h, d: (nb, 2, bs, h, d), lambda kv, b, t, hh: (b, kv, t, hh)),
    "combined_HND": (lambda nb, bs, h, d: (nb, 2, h, bs, d), lambda kv, b, t, hh: (b, kv, hh, t)),
    "vllm": (lambda nb, bs, h, d: (2, nb, bs, h, d), lambda kv, b, t, hh: (kv, b, t, hh)),
}


def _physical(x, shape):
    """The whole storage of `x` seen as the contiguous physical tensor `shape`."""
    return torch.empty(0, dtype=x.dtype).set_(x.untyped_storage(), 0, shape)


def _changed_rows(phys, before):
    return {tuple(i) for i in (phys != before).any(-1).nonzero().tolist()}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype, group", [(torch.float16, None), (torch.int8, 16), (torch.uint8, 8)])
def test_allocate_layout_places_tokens_physically(layout, dtype, group):
    nb, bs, h, d = 3, 5, 4, 32
    cache = PagedKVCache.allocate(nb, bs, h, d, dtype, layout=layout, quant_group=group)
    shape_of, index_of = PHYSICAL[layout]
    shared = layout.startswith(("combined", "vllm"))
    pairs = [(cache.k, cache.v)] + ([(cache.k_scale, cache.v_scale)] if group else [])
    for k, v in pairs:
        shape = shape_of(nb, bs, h, k.shape[-1])
        k_phys, v_phys = _physical(k, shape), _physical(v, shape)
        assert _same_storage(k, v) == shared
        for phys in (k_phys, v_phys):
            phys.copy_(torch.randint(0, 100, shape))
        k_before, v_before = k_phys.clone(), v_phys.clone()
        k[2, 1, 3] = 100
        v[1, 4, 0] = 101
        k_at, v_at = index_of(0, 2, 1, 3), index_of(1, 1, 4, 0)
        assert torch.all(k_phys[k_at] == 100) and torch.all(v_phys[v_at] == 101)
        if shared:
            assert _changed_rows(k_phys, k_before) == {k_at, v_at}
        else:
            assert _changed_rows(k_phys, k_before) == {k_at}
            assert _changed_rows(v_phys, v_before) == {v_at}


def _dim_order(x):
    return sorted(range(x.dim()), key=x.stride)


@pytest.mark.parametrize("dtype, group", FORMATS)
@pytest.mark.parametrize("layout", ["NHD", "combined_HND"])
def test_allocate_properties_and_scales(dtype, group, layout):
    nb, bs, h, d = 4, 16, 2, 64
    cache = PagedKVCache.allocate(nb, bs, h, d, dtype, layout=layout, quant_group=group,
                                  scale_dtype=torch.float16)
    fmt = quant.kv_format(dtype)
    assert (cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.head_dim) == (nb, bs, h, d)
    assert cache.format is fmt and cache.k.dtype == dtype
    assert cache.k.shape == (nb, bs, h, d // 2 if fmt is quant.KVFormat.INT4 else d)
    assert cache.quant_group == (group or 0)
    if fmt is quant.KVFormat.PLAIN:
        assert cache.k_scale is None and cache.v_scale is None
    elif fmt is quant.KVFormat.FP8:
        assert cache.k_scale.shape == () and torch.all(cache.k_scale == 1.0)
        assert cache.k_scale is not cache.v_scale
    else:
        assert cache.k_scale.shape == (nb, bs, h, d // group)
        assert cache.k_scale.dtype == torch.float16
        # The scale cache has the values' physical layout: same order of strides.
        assert _dim_order(cache.k_scale) == _dim_order(cache.k)
    assert cache.scale_kwargs() == {"k_scale": cache.k_scale, "v_scale": cache.v_scale}


def test_allocate_fp8_scale_is_copied_per_head():
    scale = torch.rand(4) + 0.1
    cache = PagedKVCache.allocate(2, 8, 4, 16, torch.float8_e4m3fn, fp8_scale=scale)
    assert torch.equal(cache.k_scale, scale) and torch.equal(cache.v_scale, scale)
    expected = scale.clone()
    scale.mul_(3)  # the cache owns copies
    cache.k_scale.mul_(2)
    assert torch.equal(cache.v_scale, expected) and torch.equal(cache.k_scale, 2 * expected)


@pytest.mark.parametrize("dtype, group", FORMATS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_random_fill_is_valid_quantized_data(dtype, group, layout):
    cache = PagedKVCache.allocate(3, 8, 4, 32, dtype, layout=layout, quant_group=group,
                                  fp8_scale=torch.ones(4) if dtype in quant.FP8_DTYPES else None)
    assert random_(cache) is cache
    k, v = cache.dequantized()
    assert k.shape == v.shape == (3, 8, 4, 32) and k.dtype == torch.float32
    assert torch.all(torch.isfinite(k)) and torch.all(torch.isfinite(v))
    assert not torch.equal(k, v)
    # Heads have different spreads (std in [0.5, 2)), and values are not degenerate.
    assert 0.3 < k.std() < 2.5
    fmt = cache.format
    if fmt is quant.KVFormat.FP8:
        # Calibrated per head: each head's absmax lands on the FP8 maximum.
        absmax = k.abs().amax(dim=(0, 1, 3))
        torch.testing.assert_close(absmax / cache.k_scale, torch.full((4,), quant.fp8_max(dtype)))
    if fmt is not quant.KVFormat.PLAIN:
        # Re-quantizing the dequantized values gives back the stored bits and scales.
        stored, group_scales = quant.quantize(k, cache.k_scale, dtype, cache.quant_group)
        assert torch.equal(stored.view(torch.uint8), cache.k.view(torch.uint8))
        if fmt.group_scaled:
            torch.testing.assert_close(group_scales, cache.k_scale.float(), rtol=1e-6, atol=0)


def test_random_fill_gives_heads_different_spreads():
    k, _ = random_(PagedKVCache.allocate(4, 16, 16, 32, torch.float16)).dequantized()
    head_std = k.std(dim=(0, 1, 3))  # each head's std is drawn from [0.5, 2)
    assert head_std.min() > 0.4 and head_std.max() < 2.2 and head_std.max() > 1.5 * head_std.min()


def test_random_fill_is_reproducible():
    a = random_(PagedKVCache.allocate(2, 4, 2, 16, torch.int8, quant_group=8), gen(7))
    b = random_(PagedKVCache.allocate(2, 4, 2, 16, torch.int8, quant_group=8), gen(7))
    c = random_(PagedKVCache.allocate(2, 4, 2, 16, torch.int8, quant_group=8), gen(8))
    assert torch.equal(a.k, b.k) and torch.equal(a.v_scale, b.v_scale)
    assert not torch.equal(a.k, c.k)


def test_random_fill_rejects_shared_fp8_scale():
    k = torch.randn(2, 4, 3, 16).to(torch.float8_e4m3fn)
    scale = torch.ones(())
    with pytest.raises(ValueError, match="must not share memory"):
        random_(PagedKVCache(k, k.clone(), scale, scale))


def test_dequantized_matches_the_formula():
    cache = random_(PagedKVCache.allocate(2, 4, 3, 16, torch.uint8, quant_group=4))
    k, _ = cache.dequantized()
    nibbles = torch.stack(((cache.k & 0xF), (cache.k >> 4)), dim=-1).flatten(-2).float() - 8
    expected = nibbles * cache.k_scale.float().repeat_interleave(4, dim=-1)
    torch.testing.assert_close(k, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(dtype=torch.int8, quant_group=48), ValueError,
         "quant_group must divide head_dim 128, got 48"),
        (dict(dtype=torch.int8), ValueError, "needs quant_group"),
        (dict(dtype=torch.float16, quant_group=32), ValueError, "takes no quant_group"),
        (dict(dtype=torch.int32), TypeError, "int32 is not supported"),
        (dict(dtype=torch.float16, layout="NDH"), ValueError, "layout must be one of"),
        (dict(dtype=torch.float16, block_size=257), ValueError,
         r"block_size must be an int in 1\.\.256"),
        (dict(dtype=torch.float16, block_size=0), ValueError, "block_size"),
        (dict(dtype=torch.float16, num_kv_heads=0), ValueError,
         "num_kv_heads must be a positive int"),
        (dict(dtype=torch.uint8, head_dim=129, quant_group=3), ValueError, "head_dim must be even"),
        (dict(dtype=torch.int8, quant_group=32, scale_dtype=torch.bfloat16), TypeError,
         "scale_dtype must be float16 or float32"),
        (dict(dtype=torch.float8_e4m3fn, fp8_scale=torch.ones(3)), ValueError,
         r"fp8_scale must be 0-d or \[Hkv=4\]"),
        (dict(dtype=torch.float8_e4m3fn, fp8_scale=torch.ones((), dtype=torch.float16)), TypeError,
         "fp8_scale must be a float32 tensor"),
        (dict(dtype=torch.float16, fp8_scale=torch.ones(())), ValueError, "only for FP8"),
    ],
)
def test_allocate_rejects_bad_arguments(kwargs, error, message):
    args = dict(num_blocks=2, block_size=16, num_kv_heads=4, head_dim=128) | kwargs
    with pytest.raises(error, match=message):
        PagedKVCache.allocate(**args)


def test_cache_constructor_validates():
    k = torch.randn(2, 4, 3, 16)
    with pytest.raises(ValueError, match="v must match k"):
        PagedKVCache(k, k[:, :2])
    with pytest.raises(ValueError, match="k must have a contiguous last dim"):
        PagedKVCache(k.transpose(2, 3)[:, :, :3], k[..., :3])
    with pytest.raises(ValueError, match="k_scale must be None"):
        PagedKVCache(k, k, torch.ones(()), torch.ones(()))
    k8 = k.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="needs k_scale"):
        PagedKVCache(k8, k8)
    with pytest.raises(ValueError, match=r"v_scale must be 0-d or \[Hkv=3\]"):
        PagedKVCache(k8, k8, torch.ones(()), torch.ones(2))
    q = k.to(torch.int8)
    with pytest.raises(ValueError, match=r"k_scale must be \[2, 4, 3, D // quant_group\]"):
        PagedKVCache(q, q, torch.ones(2, 4, 16), torch.ones(2, 4, 3, 4))
    with pytest.raises(ValueError, match="dividing head_dim 16"):
        PagedKVCache(q, q, torch.ones(2, 4, 3, 5), torch.ones(2, 4, 3, 5))
    with pytest.raises(TypeError, match="k_scale must be float16 or float32"):
        PagedKVCache(q, q, torch.ones(2, 4, 3, 4, dtype=torch.bfloat16), torch.ones(2, 4, 3, 4))
    with pytest.raises(ValueError, match="same shape and dtype"):
        PagedKVCache(q, q, torch.ones(2, 4, 3, 4), torch.ones(2, 4, 3, 2))
    packed = PagedKVCache(q.view(torch.uint8)[..., :8], q.view(torch.uint8)[..., :8],
                          torch.ones(2, 4, 3, 2), torch.ones(2, 4, 3, 2))
    assert (packed.head_dim, packed.quant_group) == (16, 8)
