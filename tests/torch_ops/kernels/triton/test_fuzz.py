"""Property-based tests (hypothesis): the Triton kernels of every op (paged_decode, its MLA
latent-cache form, paged_prefill, context_attention, merge_states, kv_cache_write,
cache_attention) against the
reference on drawn shapes, block sizes, cache formats, layouts and options, with the checks of
each op's kernel tests (error ratio against float64, caches bitwise). On CPU the
kernels run through Triton's interpreter, so the problems stay tiny and the examples few;
`ATTN_FUZZ_EXAMPLES` raises the count (on the GPU machine, say 200)."""

import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torch_ops
from torch_ops import reference
from torch_ops.quant import kv_format
from torch_ops.testing import assert_error_ratio, poison_

from torch_ops.kernels.triton import paged_decode

from . import test_cache_attention as cache_attention, test_kv_cache_write as kv_write, test_mla_decode as mla
from .test_paged_decode import call_triton, check as check_decode, make_problem
from .test_prefill_attention import check, check_paged, make_context, make_paged, run_context, run_paged

FUZZ = settings(max_examples=int(os.environ.get("ATTN_FUZZ_EXAMPLES", "6")), deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
DTYPES = st.sampled_from([torch.bfloat16, torch.float16])
HEADS = st.tuples(st.sampled_from([1, 2]), st.sampled_from([1, 2, 4]))   # (Hkv, query heads per KV head)


@st.composite
def options(draw, hq: int, causal: bool = True) -> dict:
    """A draw of the common options (window and sink tokens only where the op is causal)."""
    opts = {}
    if causal and draw(st.booleans()):
        opts.update(window_left=draw(st.integers(0, 12)), sink_tokens=draw(st.integers(0, 3)))
    if draw(st.booleans()):
        opts["softcap"] = draw(st.sampled_from([2.0, 30.0]))
    if draw(st.booleans()):
        opts["sinks"] = torch.randn(hq)
    if draw(st.booleans()):
        opts["alibi_slopes"] = torch.rand(hq)
    return opts


def _on(device, opts: dict) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in opts.items()}


@FUZZ
@given(data=st.data(), heads=HEADS, d=st.sampled_from([16, 32]), bs=st.sampled_from([1, 3, 4, 16]),
       lens=st.lists(st.integers(0, 40), min_size=1, max_size=3), qps=st.sampled_from([1, 2]),
       cache=st.sampled_from(["plain", "fp8", "int8"]))
def test_paged_decode(kernel_device, data, heads, d, bs, lens, qps, cache):
    hkv, group = heads
    lens = [max(n, qps) if n else 0 for n in lens]   # a sequence holds its new tokens (0: padding)
    formats = {"plain": {}, "fp8": dict(cache_dtype=torch.float8_e4m3fn), "int8": dict(cache_dtype=torch.int8, group=8)}
    problem = make_problem(kernel_device, lens=lens, hq=hkv * group, hkv=hkv, d=d, bs=bs, qps=qps, **formats[cache])
    opts = _on(kernel_device, data.draw(options(hkv * group)))
    out, lse = call_triton(*problem, **opts)
    check_decode(*problem, out, lse, **opts)


@FUZZ
@given(data=st.data(), bs=st.sampled_from([1, 16, 64]), lens=st.lists(st.integers(0, 80), min_size=1, max_size=3),
       qps=st.sampled_from([1, 2]), cache_dtype=st.sampled_from([torch.bfloat16, torch.float8_e4m3fn]),
       splits=st.sampled_from([None, 1, 3]))
def test_mla_decode(kernel_device, data, bs, lens, qps, cache_dtype, splits):
    lens = [max(n, qps) if n else 0 for n in lens]
    args, kwargs = mla.make_problem(kernel_device, lens=lens, qps=qps, bs=bs, cache_dtype=cache_dtype)
    if data.draw(st.booleans()):
        kwargs["sinks"] = torch.randn(args[0].shape[1], device=kernel_device)
    if data.draw(st.booleans()):
        kwargs["key_mask"] = torch.rand(args[0].shape[0], max(lens) + 1, device=kernel_device) < 0.8
    with paged_decode.tuning(num_splits=splits, min_split_tokens=16):
        out, lse = mla.call_triton(args, kwargs)
    mla.check(args, kwargs, out, lse)


@FUZZ
# head dims of one power of two, and of two (48 = 32 + 16: one dot per part)
@given(data=st.data(), heads=HEADS, d=st.sampled_from([16, 32, 48]), bs=st.sampled_from([1, 4, 8]),
       seqs=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 24)), min_size=1, max_size=3),
       causal=st.booleans(), dtype=DTYPES)
def test_paged_prefill(kernel_device, data, heads, d, bs, seqs, causal, dtype):
    hkv, group = heads
    q_lens = [min(q, k) for q, k in seqs]   # queries are the last of each sequence's keys
    problem = make_paged(kernel_device, q_lens=q_lens, seq_lens=[k for _, k in seqs], hq=hkv * group, hkv=hkv,
                         d=d, bs=bs, dtype=dtype)
    opts = _on(kernel_device, data.draw(options(hkv * group, causal)))
    out, lse = run_paged(problem, causal=causal, **opts)
    check_paged(problem, out, lse, causal=causal, **opts)


@FUZZ
@given(data=st.data(), heads=HEADS, d=st.sampled_from([16, 32, 48]),
       seqs=st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), min_size=1, max_size=3),
       causal=st.booleans(), dtype=DTYPES)
def test_context_attention(kernel_device, data, heads, d, seqs, causal, dtype):
    hkv, group = heads
    q_lens = [q if not causal else k for q, k in seqs]   # causal self-attention: as many queries as keys
    problem = make_context(kernel_device, q_lens=q_lens, k_lens=[k for _, k in seqs], hq=hkv * group, hkv=hkv,
                           d=d, dtype=dtype)
    opts = _on(kernel_device, data.draw(options(hkv * group, causal)))
    out, lse = run_context(problem, causal=causal, **opts)
    check("context_attention", problem, out, lse, causal=causal, **opts)


@FUZZ
@given(t=st.integers(1, 6), h=st.integers(1, 5), d=st.sampled_from([8, 16, 40]), dtype=DTYPES,
       empty=st.floats(0, 1))
def test_merge_states(kernel_device, t, h, d, dtype, empty):
    out_a, out_b = (torch.randn(t, h, d, dtype=dtype, device=kernel_device) for _ in range(2))
    lse_a, lse_b = (torch.randn(t, h, device=kernel_device) * 4 for _ in range(2))
    lse_a[torch.rand(t, h, device=kernel_device) < empty] = float("-inf")   # empty partial states
    out, lse = torch.empty_like(out_a), torch.empty_like(lse_a)
    poison_(out)
    poison_(lse)
    with torch_ops.use_backend("triton"):
        torch.ops.attn.merge_states.out(out_a, lse_a, out_b, lse_b, out=out, lse=lse)
    truth = reference.merge_states(out_a.double(), lse_a.double(), out_b.double(), lse_b.double())
    base = reference.merge_states(out_a, lse_a, out_b, lse_b)
    assert_error_ratio(out, truth[0], base[0])
    assert_error_ratio(lse, truth[1], base[1], name="lse")


poisoned = cache_attention.poisoned   # the fixture: every torch.empty allocation poisoned

KV_FORMATS = {   # name -> cache dtype
    "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2, "int8": torch.int8, "int4": torch.uint8,
}


@FUZZ
@given(data=st.data(), fmt=st.sampled_from(list(KV_FORMATS)), t=st.integers(1, 9), heads=HEADS,
       d=st.sampled_from([16, 32, 48]), bs=st.sampled_from([1, 3, 4, 16]),
       layout=st.sampled_from(["NHD", "HND", "combined_NHD", "combined_HND", "vllm"]),
       rope=st.sampled_from([None, "neox", "gptj"]), index_dtype=st.sampled_from([torch.int32, torch.int64]))
def test_kv_cache_write(kernel_device, data, fmt, t, heads, d, bs, layout, rope, index_dtype):
    hkv, group = heads
    cache_dtype = KV_FORMATS[fmt]
    opts = {}
    if kv_format(cache_dtype).group_scaled:
        opts.update(group=data.draw(st.sampled_from([g for g in (8, 16, d) if d % g == 0])),
                    scale_dtype=data.draw(st.sampled_from([torch.float16, torch.float32])))
    elif fmt in ("e4m3", "e5m2"):
        opts["fp8_per_head"] = data.draw(st.booleans())
    if rope:
        opts.update(rope=rope, rot=data.draw(st.sampled_from([d, d // 2])), with_query=data.draw(st.booleans()))
    problem = kv_write.make_problem(kernel_device, cache_dtype=cache_dtype, t=t, hq=hkv * group, hkv=hkv, d=d, bs=bs,
                                    layout=layout, index_dtype=index_dtype, num_skipped=min(t - 1, 2), **opts)
    kv_write.run_and_check(problem)


@FUZZ
@given(data=st.data(), heads=HEADS, d=st.sampled_from([16, 32]), cache_mode=st.sampled_from([0, 1]),
       cache_layout=st.sampled_from([0, 1, 2, 3]), quant_bit=st.sampled_from([0, 8, 4]),
       seqs=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 12)), min_size=1, max_size=3),
       is_causal=st.booleans(), is_alibi=st.booleans(), dtype=DTYPES)
def test_cache_attention(kernel_device, poisoned, data, heads, d, cache_mode, cache_layout, quant_bit, seqs,
                         is_causal, is_alibi, dtype):
    hkv, group = heads
    opts = {}
    if cache_mode == 1:
        opts.update(page_size=data.draw(st.sampled_from([3, 4, 8])), page_shift=data.draw(st.integers(0, 2)))
    if quant_bit:
        opts.update(group=data.draw(st.sampled_from([8, d])),
                    scale_dtype=data.draw(st.sampled_from([torch.float16, torch.float32])))
    problem = cache_attention.make_problem(
        kernel_device, seqlens=[s for s, _ in seqs], start_pos=[p for _, p in seqs], hq=hkv * group, hkv=hkv, d=d,
        cache_mode=cache_mode, cache_layout=cache_layout, quant_bit=quant_bit, is_causal=is_causal,
        is_alibi=is_alibi, dtype=dtype, **opts)
    cache_attention.check(problem)
