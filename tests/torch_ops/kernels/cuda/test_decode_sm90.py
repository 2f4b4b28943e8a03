"""The `cuda` backend (torch_ops/kernels/cuda/decode_sm90.py, csrc/decode_sm90.cu): paged decode of small problems.

CPU: the C ABI mirror, the grid and automatic-choice rules, the reasons it declines a call. GPU
(marked): the kernel against the float64 reference with the error-ratio tolerance (the checks of
the Triton kernel's tests), every cluster size, CUDA-graph replays, the automatic choice.
"""

from __future__ import annotations

import ctypes
import random
import re
from pathlib import Path

import pytest
import torch

import torch_ops
from torch_ops.csrc_build import CSRC
from torch_ops.gpu import capture_cuda_graph
from torch_ops.kernels.cuda import decode_sm90 as cd
from torch_ops.testing import assert_replays_match_eager, poison_
from tests.torch_ops.kernels.triton import test_paged_decode as tp

CTYPES = {"const void*": ctypes.c_void_p, "void*": ctypes.c_void_p, "const int*": ctypes.c_void_p, "int*": ctypes.c_void_p,
          "float*": ctypes.c_void_p, "int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "float": ctypes.c_float}


def test_args_mirror_the_header():
    header = (CSRC / "decode_sm90.h").read_text()
    body = re.search(r"typedef struct \{(.*?)\} AttnDecodeArgs;", header, re.S).group(1)
    fields = []
    for line in body.splitlines():
        line = line.split("//")[0].strip()
        if not line:
            continue
        ctype, names = re.fullmatch(r"(const void\*|void\*|const int\*|int\*|float\*|int64_t|int32_t|float)\s+(.+);", line).groups()
        fields += [(name.strip(), CTYPES[ctype]) for name in names.split(",")]
    assert [(n, t) for n, t in cd.DecodeArgs._fields_] == fields


def test_cluster_size_is_a_resident_power_of_two():
    sms = 132

    def resident(n):   # one CTA per SM, and clusters of 16 fit 7 GPCs only (the H200's answer)
        return {1: 132, 2: 66, 4: 30, 8: 15, 16: 7}.get(n, sms // n)
    assert cd.cluster_size(1, 8, 16384, resident) == 8        # 16 clusters of 16 would not all be resident
    assert cd.cluster_size(1, 4, 16384, resident) == 16
    assert cd.cluster_size(1, 32, 16384, resident) == 2       # 32 > 30 clusters of 4 fit
    assert cd.cluster_size(4, 32, 16384, resident) == 1
    assert cd.cluster_size(1, 8, 256, resident) == 2          # each warp keeps >= MIN_WARP_KEYS keys
    assert cd.cluster_size(200, 8, 512, resident) == 1        # more pairs than SMs: no clusters


def _problem(device="cpu", *, t=4, hq=32, hkv=8, d=128, bs=16, dtype=torch.bfloat16, cache_dtype=None):
    q = torch.zeros(t, hq, d, dtype=dtype, device=device)
    k = torch.zeros(8, bs, hkv, d, dtype=cache_dtype or dtype, device=device)
    return q, k, k.clone(), torch.zeros(t, 4, dtype=torch.int32, device=device), torch.full((t,), 5, dtype=torch.int32, device=device)


def test_unsupported_names_what_is_missing():
    assert cd.unsupported(*_problem()) == ["the CUDA decode kernel needs CUDA tensors, got cpu"]
    why = " | ".join(cd.unsupported(*_problem(hq=64, hkv=2, bs=24, d=96), softcap=5.0, sinks=torch.zeros(64)))
    for part in ("32 query rows per KV head", "block_size 24", "head dim 96", "soft-capping", "learned sinks"):
        assert part in why
    why = " | ".join(cd.unsupported(*_problem(cache_dtype=torch.float8_e4m3fn)))
    assert "needs k_scale and v_scale" in why
    why = " | ".join(cd.unsupported(*_problem(dtype=torch.float32)))
    assert "bf16/fp16 queries" in why


@pytest.mark.parametrize("d,groups,scale_dtype,reason", [
    (128, 4, torch.float16, None), (128, 4, torch.float32, None), (64, 2, torch.float16, None),
    (128, 8, torch.float16, "8 scale groups per head"),       # quant_group 16 < D / 4
    (128, 1, torch.float16, "2-byte scale rows"),             # too small for one cp.async
])
def test_group_scales_the_kernel_reads(d, groups, scale_dtype, reason):
    q, k, v, bt, sl = _problem(d=d, cache_dtype=torch.int8)
    ks = torch.ones(*k.shape[:3], groups, dtype=scale_dtype)
    why = [w for w in cd.unsupported(q, k, v, bt, sl, k_scale=ks, v_scale=ks.clone()) if "CUDA tensors" not in w]
    assert why == [] if reason is None else reason in " | ".join(why)
    fields = cd._scale_fields(k, ks, ks, d)
    assert fields["quant_group"] == d // groups and fields["scale_fp32"] == (scale_dtype == torch.float32)
    assert fields["ks_token_stride"] == ks.stride(1)


def test_explicit_request_on_cpu_raises():
    q, k, v, bt, sl = _problem()
    with torch_ops.use_backend("cuda"), pytest.raises(ValueError, match="'cuda' cannot run attn::paged_decode"):
        torch.ops.attn.paged_decode(q, k, v, bt, sl)


def test_compile_command():
    cmd = cd.compile_command("/opt/nvcc", Path("/tmp/lib.so"), ("ATTN_DECODE_STAGES=3",))
    assert cmd[0] == "/opt/nvcc" and "-shared" in cmd and "-gencode=arch=compute_90a,code=sm_90a" in cmd
    assert str(CSRC / "decode_sm90.cu") in cmd and "-DATTN_DECODE_STAGES=3" in cmd and cmd[-2:] == ["-o", "/tmp/lib.so"]


@pytest.fixture
def built(monkeypatch):
    """The library counts as built: the choice rule is what these tests check."""
    monkeypatch.setattr(cd, "library_built", lambda: True)


def test_the_automatic_choice_builds_nothing(monkeypatch):
    monkeypatch.setattr(cd, "library_built", lambda: False)
    monkeypatch.setattr(cd, "_grid", lambda *a: pytest.fail("the choice looked at the library"))
    q, k, v, bt, sl = _problem()
    assert cd.CudaDecodeBackend().auto_declines("paged_decode", (q, k, v, bt, sl), {}) == [cd.NOT_BUILT]


@pytest.mark.parametrize("keys,size,ctas,cache_dtype,declined", [
    (1024, 2, 64, None, False), (4096, 1, 128, None, False), (4096, 2, 64, None, True), (16384, 8, 64, None, False),
    (16384, 16, 64, None, True), (16384, 1, 128, None, True), (65536, 8, 64, None, True),
    (1024, 8, 64, torch.int8, False), (4096, 1, 128, torch.uint8, False), (16384, 8, 64, torch.float8_e4m3fn, True),
    (4096, 2, 128, torch.float8_e4m3fn, False), (4096, 16, 128, torch.float8_e4m3fn, True),
    (16384, 16, 64, torch.int8, True), (32768, 16, 64, torch.float8_e4m3fn, True), (16384, 8, 64, torch.uint8, True),
    (65536, 16, 64, torch.uint8, True),
])
def test_automatic_choice_rule(monkeypatch, built, keys, size, ctas, cache_dtype, declined):
    q, k, v, _, sl = _problem(cache_dtype=cache_dtype)
    bt = torch.zeros(sl.shape[0], keys // 16, dtype=torch.int32)
    monkeypatch.setattr(cd, "_grid", lambda *a: (size, 1, ctas, 132, 132))
    assert bool(cd.CudaDecodeBackend().auto_declines("paged_decode", (q, k, v, bt, sl), {})) == declined
    monkeypatch.setattr(cd, "_grid", lambda *a: (1, 1, 32, 16, 132))   # more pairs (4 x 8) than resident CTAs
    assert cd.CudaDecodeBackend().auto_declines("paged_decode", (q, k, v, bt, sl), {})


def test_long_tables_in_clusters_only_plain_at_d128(monkeypatch, built):
    for size, cache_dtype, d, declined in ((8, None, 128, False), (8, None, 64, True), (16, torch.int8, 128, True),
                                           (8, torch.float8_e4m3fn, 128, True)):
        monkeypatch.setattr(cd, "_grid", lambda *a, size=size: (size, 1, 64, 132, 132))
        q, k, v, _, sl = _problem(d=d, cache_dtype=cache_dtype)
        bt = torch.zeros(sl.shape[0], 16384 // 16, dtype=torch.int32)
        assert bool(cd.CudaDecodeBackend().auto_declines("paged_decode", (q, k, v, bt, sl), {})) == declined


@pytest.mark.parametrize("cache_dtype,d,batch,keys,declined", [
    (torch.int8, 128, 16, 4096, False), (torch.int8, 128, 64, 16384, False), (torch.int8, 128, 8, 4096, False),
    (torch.int8, 128, 4, 16384, True), (torch.int8, 128, 64, 1024, True),
    (torch.uint8, 128, 16, 16384, False), (torch.uint8, 128, 256, 4096, False), (torch.uint8, 64, 256, 4096, False),
    (torch.uint8, 64, 64, 1024, True), (torch.float8_e4m3fn, 128, 16, 16384, True),
    (torch.int8, 128, 32, 256, False), (torch.uint8, 128, 32, 1024, False), (torch.int8, 128, 32, 128, True),
    (torch.uint8, 64, 32, 512, True), (torch.float8_e4m3fn, 128, 32, 512, True),
])
def test_grouped_caches_on_many_pairs(monkeypatch, built, cache_dtype, d, batch, keys, declined):
    q, k, v, _, _ = _problem(t=batch, d=d, cache_dtype=cache_dtype)          # 8 KV heads: 8 x batch pairs
    bt, sl = torch.zeros(batch, keys // 16, dtype=torch.int32), torch.full((batch,), 5, dtype=torch.int32)
    monkeypatch.setattr(cd, "_grid", lambda *a: (1, 1, 8 * batch, 132, 132))
    assert bool(cd.CudaDecodeBackend().auto_declines("paged_decode", (q, k, v, bt, sl), {})) == declined


def test_two_ctas_per_sm_on_multi_wave_grouped_grids():
    assert cd.ctas_per_sm(torch.int8, 128, 4, 512, 132) == 2
    assert cd.ctas_per_sm(torch.uint8, 128, 8, 133, 132) == 2
    assert cd.ctas_per_sm(torch.uint8, 128, 8, 132, 132) == 1      # one wave
    assert cd.ctas_per_sm(torch.uint8, 128, 16, 512, 132) == 1     # two query tiles
    assert cd.ctas_per_sm(torch.uint8, 64, 4, 512, 132) == 1       # not built at D = 64 (slower there)
    assert cd.ctas_per_sm(torch.float8_e4m3fn, 128, 4, 512, 132) == 1
    assert cd.ctas_per_sm(torch.bfloat16, 128, 4, 512, 132) == 1


# ---- GPU ---------------------------------------------------------------------------------------------


def _run_cuda(q, cache, bt, sl, **options):
    out = poison_(torch.empty_like(q))
    lse = poison_(torch.empty(q.shape[:2], dtype=torch.float32, device=q.device))
    with torch_ops.use_backend("cuda"):
        torch.ops.attn.paged_decode.out(q, cache.k, cache.v, bt, sl, out=out, lse=lse, **options)
    return out, lse


MATRIX = [(d, dtype, hq, hkv, qps) for d in cd.HEAD_DIMS for dtype in (torch.bfloat16, torch.float16)
          for hq, hkv in ((32, 32), (32, 8), (64, 8), (32, 4), (16, 1), (8, 2)) for qps in (1, 2, 4)
          if qps * hq // hkv <= cd.MAX_ROWS]


@pytest.mark.gpu
@pytest.mark.parametrize("d,dtype,hq,hkv,qps", MATRIX)
def test_matrix(kernel_device, monkeypatch, d, dtype, hq, hkv, qps):
    """Odd lengths (0, 1, block size +- 1, non-multiples), random pages, shared prefixes, every
    layout, the automatic cluster size and forced ones."""
    rng = random.Random(f"{d}{dtype}{hq}{hkv}{qps}")
    real = cd.cluster_size
    for forced in (None, 1, 2, 3, 4, 8, 16):
        monkeypatch.setattr(cd, "cluster_size", lambda *a, forced=forced: forced or real(*a))
        lens = [rng.choice([0, 1, qps, 15, 16, 17, 100, 255, 513, 1000, 3000]) for _ in range(rng.choice([1, 2, 3, 5]))]
        lens = [max(n, qps) if n else 0 for n in lens]
        q, cache, bt, sl = tp.make_problem(kernel_device, lens=lens, hq=hq, hkv=hkv, d=d, bs=rng.choice([16, 32, 48, 256]),
                                           qps=qps, dtype=dtype, layout=rng.choice(["NHD", "HND", "vllm"]),
                                           share_prefix=rng.random() < 0.3)
        out, lse = _run_cuda(q, cache, bt, sl)
        tp.check(q, cache, bt, sl, out, lse)


QUANT = [  # (cache dtype, extra make_problem arguments)
    (torch.float8_e4m3fn, {}), (torch.float8_e4m3fn, {"fp8_per_head": True}), (torch.float8_e5m2, {}),
    (torch.int8, {"group": 32, "scale_dtype": torch.float16}), (torch.int8, {"group": 64}),
    (torch.uint8, {"group": 32, "scale_dtype": torch.float16}), (torch.uint8, {"group": 128}),
]
QUANT_MATRIX = [(d, dtype, heads, cache_dtype, extra) for d in cd.HEAD_DIMS for dtype in (torch.bfloat16, torch.float16)
                for heads in ((32, 8, 1), (32, 32, 2), (16, 1, 1), (8, 2, 4)) for cache_dtype, extra in QUANT
                if extra.get("group", 0) <= d]


@pytest.mark.gpu
@pytest.mark.parametrize("d,dtype,heads,cache_dtype,extra", QUANT_MATRIX)
def test_quantized_caches(kernel_device, monkeypatch, d, dtype, heads, cache_dtype, extra):
    """FP8 (per tensor, per head, e5m2), INT8 and INT4 with fp16/fp32 group scales: odd lengths,
    random pages, every layout, automatic and forced cluster sizes."""
    _check_random_quantized(kernel_device, monkeypatch, random.Random(f"{d}{dtype}{heads}{cache_dtype}{extra}"),
                            d, dtype, heads, cache_dtype, extra)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,heads,cache_dtype,extra", [
    (dtype, heads, cache_dtype, extra) for dtype in (torch.bfloat16, torch.float16)
    for heads in ((32, 8, 1), (32, 32, 2), (16, 2, 1), (8, 2, 2)) for cache_dtype, extra in QUANT
    if cache_dtype in (torch.int8, torch.uint8) and extra.get("group", 0) <= 128])
def test_two_ctas_per_sm(kernel_device, monkeypatch, dtype, heads, cache_dtype, extra):
    """The INT8/INT4 build for two CTAs per SM (multi-wave grids, D = 128, <= 8 rows), forced on
    small problems: the cases of test_quantized_caches."""
    monkeypatch.setattr(cd, "ctas_per_sm", lambda *a: 2)
    _check_random_quantized(kernel_device, monkeypatch, random.Random(f"two{dtype}{heads}{cache_dtype}{extra}"),
                            128, dtype, heads, cache_dtype, extra)


def _check_random_quantized(device, monkeypatch, rng, d, dtype, heads, cache_dtype, extra):
    """Random lengths (0, 1, odd, around a tile), page sizes, layouts and shared prefixes, at the
    automatic cluster size and at 1, 4 and 16, against the reference."""
    hq, hkv, qps = heads
    real = cd.cluster_size
    for forced in (None, 1, 4, 16):
        monkeypatch.setattr(cd, "cluster_size", lambda *a, forced=forced: forced or real(*a))
        lens = [rng.choice([0, 1, qps, 15, 16, 17, 100, 255, 513, 1000, 3000]) for _ in range(rng.choice([1, 2, 3, 5]))]
        lens = [max(n, qps) if n else 0 for n in lens]
        q, cache, bt, sl = tp.make_problem(device, lens=lens, hq=hq, hkv=hkv, d=d, bs=rng.choice([16, 32, 256]),
                                           qps=qps, dtype=dtype, cache_dtype=cache_dtype,
                                           layout=rng.choice(["NHD", "HND", "vllm"]), share_prefix=rng.random() < 0.3,
                                           **extra)
        out, lse = _run_cuda(q, cache, bt, sl, **cache.scale_kwargs())
        tp.check(q, cache, bt, sl, out, lse)


@pytest.mark.gpu
def test_scale_options(kernel_device):
    q, cache, bt, sl = tp.make_problem(kernel_device, lens=[700, 33], hq=32, hkv=8, d=128, bs=16,
                                       index_dtype=torch.int64)
    out, lse = _run_cuda(q, cache, bt, sl, scale=0.3, q_scaling=1.5)
    tp.check(q, cache, bt, sl, out, lse, scale=0.3, q_scaling=1.5)


@pytest.mark.gpu
def test_cuda_graph_replays_new_lengths(kernel_device):
    q, cache, bt, sl = tp.make_problem(kernel_device, lens=[900] * 4, hq=32, hkv=8, d=128, bs=16)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=kernel_device)
    steps = [[900, 40, 0, 300], [17, 800, 5, 0], [1, 1, 1, 1], [900, 899, 898, 897]]

    def fill(step):
        sl.copy_(torch.tensor(steps[step], dtype=torch.int32))
        q.normal_()

    def call():
        with torch_ops.use_backend("cuda"):
            torch.ops.attn.paged_decode.out(q, cache.k, cache.v, bt, sl, out=out, lse=lse)
    assert_replays_match_eager(call, fill, [out, lse], lambda o, l: tp.check(q, cache, bt, sl, o, l))


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [True, False])
def test_chained_calls_read_the_previous_output(kernel_device, monkeypatch, pdl):
    """Programmatic dependent launch: each call's query is the previous call's output, poisoned
    (NaN) before the chain, eagerly and in CUDA-graph replays; a call that read its query before
    the previous one finished would see NaN or stale values."""
    monkeypatch.setattr(cd, "PDL", pdl)
    q, cache, bt, sl = tp.make_problem(kernel_device, lens=[1000, 77, 512, 3000], hq=32, hkv=8, d=128, bs=16)
    chain = [q] + [torch.empty_like(q) for _ in range(4)]
    lses = [torch.empty(q.shape[:2], dtype=torch.float32, device=kernel_device) for _ in range(4)]

    def run_chain():
        with torch_ops.use_backend("cuda"):
            for i in range(4):
                torch.ops.attn.paged_decode.out(chain[i], cache.k, cache.v, bt, sl, out=chain[i + 1], lse=lses[i])

    def check_chain():
        torch.cuda.synchronize()
        for i in range(4):
            tp.check(chain[i], cache, bt, sl, chain[i + 1], lses[i])

    for t in chain[1:] + lses:
        poison_(t)
    run_chain()
    check_chain()
    graph, _ = capture_cuda_graph(run_chain)
    for _ in range(3):
        q.normal_()
        for t in chain[1:] + lses:
            poison_(t)
        graph.replay()
        check_chain()


@pytest.mark.gpu
def test_automatic_choice_on_the_gpu(kernel_device, csrc_libraries):
    small = tp.make_problem(kernel_device, lens=[512] * 4, hq=32, hkv=8, d=128, bs=16)
    large = tp.make_problem(kernel_device, lens=[16] * 512, hq=32, hkv=8, d=128, bs=16)
    small_int8 = tp.make_problem(kernel_device, lens=[512] * 4, hq=32, hkv=8, d=128, bs=16, cache_dtype=torch.int8,
                                 group=32, scale_dtype=torch.float16)
    long_fp8 = tp.make_problem(kernel_device, lens=[16384], hq=32, hkv=8, d=128, bs=16, cache_dtype=torch.float8_e4m3fn)
    for (q, cache, bt, sl), want in ((small, "cuda"), (large, "triton"), (small_int8, "cuda"), (long_fp8, "triton")):
        assert torch_ops.backend_for("paged_decode", q, cache.k, cache.v, bt, sl, **cache.scale_kwargs()) == want
