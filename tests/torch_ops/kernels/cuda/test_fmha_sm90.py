"""The `cutlass` backend's kernels (csrc/fmha_sm90.cu through torch_ops/kernels/cuda/fmha_sm90.py).

GPU (marked; needs an sm_90 GPU, nvcc and the nvidia-cutlass wheel; the first call builds the
library, about a minute on 16 cores): `context_attention` on the plain and the persistent kernels,
and `paged_prefill` on the paged ones, against the float64 reference with the error-ratio rule.
FP8 kernels round the softmax probabilities P to e4m3 before the PV product (as FA3/FlashInfer FP8
do), so their baseline is a PyTorch computation that does the same. Host programs built from the
kernel source (needs nvcc and the CUTLASS headers) check the paged kernels' stage layouts.
The build is tested in test_fmha_sm90_build.py, what is launched in test_fmha_sm90_dispatch.py.
"""

from __future__ import annotations

import random
import subprocess
from pathlib import Path

import pytest
import torch

import torch_ops
from torch_ops import quant, reference
from torch_ops.kernels.cuda import fmha_sm90, fmha_sm90_build
from torch_ops.testing import assert_error_ratio, assert_replays_match_eager, poison_

E4M3, BF16, FP16 = torch.float8_e4m3fn, torch.bfloat16, torch.float16


# ---- stage layouts (host programs) ---------------------------------------------------------------


@pytest.mark.parametrize("check,define", [("paged_layout_check.cu", 1), ("block_boxes_check.cu", 2)])
def test_paged_stage_layouts_match_the_tma_boxes(tmp_path, check, define):
    """Host programs built from the kernel source: every element of every TMA box lands where the K
    and V stage layouts put its key and dim (PagedLayouts), and (BlockBoxes, permuted key orders) the
    masks see each accumulator element's key and step k of the PV product pairs P and V at the same keys."""
    pytest.importorskip("cutlass_library", reason="needs the nvidia-cutlass headers (pip install '.[cutlass]')")
    nvcc = fmha_sm90_build.find_nvcc()
    if nvcc is None:
        pytest.skip("needs nvcc")
    exe = tmp_path / "check"
    cmd = [nvcc, "-std=c++17", "-O1", f"-gencode=arch=compute_{fmha_sm90_build.ARCH},code=sm_{fmha_sm90_build.ARCH}",
           "--expt-relaxed-constexpr", "-DATTN_ELEMENT_BF16", "-DATTN_HEAD_DIM=128", "-DATTN_PERSISTENT=0",
           f"-DATTN_PAGED={define}", *(f"-I{p}" for p in fmha_sm90_build.cutlass_include_dirs()),
           f"-I{fmha_sm90_build.CSRC}",
           str(Path(__file__).with_name(check)), "-o", str(exe)]
    build = subprocess.run(cmd, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    result = subprocess.run([str(exe)], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.startswith("OK"), result.stdout


# ---- numerics (GPU) ------------------------------------------------------------------------------


def cumsum0(lens, device):
    return torch.tensor([0, *lens], dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)


def fp8_problem(device, q_lens, k_lens, hq, hkv, d, per_head):
    """Quantized packed inputs and their descales: `(q8, k8, v8, cu_q, cu_k), scales`."""
    def scale(heads):
        s = torch.rand(heads, device=device) * 0.01 + 0.02 if per_head else torch.tensor(0.025, device=device)
        return s.float()

    scales = {"q_scale": scale(hq), "k_scale": scale(hkv), "v_scale": scale(hkv)}
    raw = {"q": torch.randn(sum(q_lens), hq, d, device=device) * 4,
           "k": torch.randn(sum(k_lens), hkv, d, device=device) * 4,
           "v": torch.randn(sum(k_lens), hkv, d, device=device) * 4}
    q8, k8, v8 = (quant.quantize_fp8(raw[n], scales[f"{n}_scale"], E4M3) for n in "qkv")
    return (q8, k8, v8, cumsum0(q_lens, device), cumsum0(k_lens, device)), scales


# With probabilities rounded to e4m3, the kernel's and the baseline's largest errors fall on
# different elements and vary by seed. H200, D = 256, causal, 16 seeds: (error - floor) / baseline
# error 0.94 median, 1.43 max; one seed of the suite reached 2.1.
FP8_P_RATIO = 2.5


def fp8_p_baseline(problem, *, causal, q_scale, k_scale, v_scale, scale=None):
    """What an FP8 attention does in PyTorch: fp32 logits and softmax, probabilities rounded to
    e4m3 for the product with the e4m3 values of V, the sum taken before rounding, the V descale
    applied last. Returns `out [Tq, Hq, D]` fp32."""
    q8, k8, v8, cu_q, cu_k = problem
    q, k = quant.dequantize_fp8(q8, q_scale, torch.float32), quant.dequantize_fp8(k8, k_scale, torch.float32)
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    qs, ks = cu_q.tolist(), cu_k.tolist()
    for b in range(len(qs) - 1):
        lq, lk = qs[b + 1] - qs[b], ks[b + 1] - ks[b]
        if lq == 0 or lk == 0:
            continue
        qb = q[qs[b]:qs[b + 1]].transpose(0, 1)
        kb, vb = (x[ks[b]:ks[b + 1]].float().repeat_interleave(group, 1).transpose(0, 1) for x in (k, v8))
        s = qb @ kb.transpose(1, 2) * (scale or q.shape[-1] ** -0.5)
        if causal:
            last = torch.arange(lq, device=q.device)[:, None] + lk - lq
            s = s.masked_fill(torch.arange(lk, device=q.device)[None, :] > last, float("-inf"))
        p = torch.exp(s - s.amax(-1, keepdim=True).clamp_min(-1e30))
        o = (p.to(E4M3).float() @ vb) / p.sum(-1, keepdim=True).clamp_min(1e-30)
        out[qs[b]:qs[b + 1]] = o.transpose(0, 1)
    v_scale_per_q_head = v_scale.float().expand(k.shape[1]).repeat_interleave(group)
    return out * v_scale_per_q_head[:, None]


@pytest.fixture(params=[False, True], ids=["plain", "persistent"])
def grid(request, monkeypatch):
    """Runs a GPU test on the plain kernels (one CTA per work tile) and on the persistent ones."""
    monkeypatch.setattr(fmha_sm90, "PERSISTENT", request.param)
    return request.param


def run_cutlass(problem, out_dtype, **options):
    out = torch.empty(problem[0].shape, dtype=out_dtype, device=problem[0].device)
    lse = torch.empty(problem[0].shape[:2], dtype=torch.float32, device=problem[0].device)
    poison_(out)
    poison_(lse)
    with torch_ops.use_backend("cutlass"):
        torch.ops.attn.context_attention.out(*problem, out=out, lse=lse, **options)
    return out, lse


def check(problem, out, lse, baseline_out, **options):
    truth_o, truth_l = reference.context_attention(*problem, compute_dtype=torch.float64, **options)
    low = BF16 if problem[0].dtype == E4M3 else problem[0].dtype   # the Triton FP8 tests' lse baseline too
    _, base_l = reference.context_attention(*problem, compute_dtype=low, **options)
    assert not torch.isnan(out.float()).any() and not torch.isnan(lse).any(), "unwritten or NaN output"
    assert_error_ratio(out, truth_o, baseline_out, ratio=FP8_P_RATIO if problem[0].dtype == E4M3 else 2.0)
    assert_error_ratio(lse, truth_l, base_l, name="lse")
    empty = torch.isinf(truth_l)
    assert (out.float()[empty] == 0).all() and (lse[empty] == float("-inf")).all(), "rows with no key: 0 and -inf"


# ragged batches: an empty sequence, queries without keys, fewer keys than queries (causal rows
# that see nothing), lengths off the 128-row / key-tile grid, one long sequence, and key starts
# off the 16-key grid (FP8 V is read transposed, where TMA needs 16-byte aligned box starts)
RAGGED = [([300, 0, 17, 129, 64], [300, 0, 700, 129, 0]), ([1000], [1000]), ([5, 200], [3, 1024]),
          ([1, 3, 40], [301, 7, 290])]


@pytest.mark.gpu
@pytest.mark.usefixtures("grid")
@pytest.mark.parametrize("d,hq,hkv", [(128, 8, 2), (256, 4, 4)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("lens", RAGGED, ids=["ragged", "single", "short-q", "key-offsets"])
def test_fp8_context_attention(d, hq, hkv, causal, per_head, lens):
    problem, scales = fp8_problem("cuda", *lens, hq, hkv, d, per_head)
    assert fmha_sm90.unsupported(*problem, causal=causal, **scales) == []
    out, lse = run_cutlass(problem, BF16, causal=causal, **scales)
    check(problem, out, lse, fp8_p_baseline(problem, causal=causal, **scales), causal=causal, **scales)


@pytest.mark.gpu
@pytest.mark.usefixtures("grid")
@pytest.mark.parametrize("dtype,d", [(BF16, 64), (FP16, 64), (BF16, 128), (FP16, 128), (BF16, 256)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", RAGGED, ids=["ragged", "single", "short-q", "key-offsets"])
def test_16bit_context_attention(dtype, d, causal, lens):
    q_lens, k_lens = lens
    problem = (torch.randn(sum(q_lens), 8, d, device="cuda", dtype=dtype),
               torch.randn(sum(k_lens), 2, d, device="cuda", dtype=dtype),
               torch.randn(sum(k_lens), 2, d, device="cuda", dtype=dtype),
               cumsum0(q_lens, "cuda"), cumsum0(k_lens, "cuda"))
    out, lse = run_cutlass(problem, dtype, causal=causal, scale=0.1, q_scaling=1.5)
    baseline, _ = reference.context_attention(*problem, compute_dtype=dtype, causal=causal, scale=0.1, q_scaling=1.5)
    check(problem, out, lse, baseline, causal=causal, scale=0.1, q_scaling=1.5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,causal", [(E4M3, 128, False), (E4M3, 128, True), (BF16, 128, False), (BF16, 128, True),
                                           (BF16, 64, False), (BF16, 64, True), (FP16, 128, True), (FP16, 64, False)])
def test_automatic_grid_runs_short_batches_on_the_default_librarys_persistent_kernels(monkeypatch, dtype, d, causal):
    monkeypatch.setattr(fmha_sm90, "PERSISTENT", None)
    monkeypatch.delenv("ATTN_CUTLASS_PERSISTENT", raising=False)
    q_lens, k_lens = RAGGED[0]
    if dtype == E4M3:
        problem, scales = fp8_problem("cuda", q_lens, k_lens, 8, 2, d, True)
        baseline = fp8_p_baseline(problem, causal=causal, **scales)
    else:
        problem, scales = (torch.randn(sum(q_lens), 8, d, device="cuda", dtype=dtype),
                           torch.randn(sum(k_lens), 2, d, device="cuda", dtype=dtype),
                           torch.randn(sum(k_lens), 2, d, device="cuda", dtype=dtype),
                           cumsum0(q_lens, "cuda"), cumsum0(k_lens, "cuda")), {}
        baseline, _ = reference.context_attention(*problem, compute_dtype=dtype, causal=causal)
    assert fmha_sm90.runs_persistent(dtype, d, causal, sum(q_lens), len(q_lens))
    out, lse = run_cutlass(problem, BF16 if dtype == E4M3 else dtype, causal=causal, **scales)
    check(problem, out, lse, baseline, causal=causal, **scales)


def many_sequences(count, long_every, rng):
    """`count` lengths, mostly 0-40 with one of 129-400 every `long_every`: a tile search over more
    than 128 sequences takes two rounds of reads."""
    return [rng.randint(129, 400) if i % long_every == 0 else rng.randint(0, 40) for i in range(count)]


@pytest.mark.gpu
@pytest.mark.usefixtures("grid")
@pytest.mark.parametrize("causal", [False, True])
def test_context_attention_over_many_sequences(causal):
    rng = random.Random(0)
    q_lens = many_sequences(700, 50, rng)
    k_lens = [q + rng.randint(0, 30) for q in q_lens]
    problem = (torch.randn(sum(q_lens), 8, 128, device="cuda", dtype=BF16),
               torch.randn(sum(k_lens), 2, 128, device="cuda", dtype=BF16),
               torch.randn(sum(k_lens), 2, 128, device="cuda", dtype=BF16),
               cumsum0(q_lens, "cuda"), cumsum0(k_lens, "cuda"))
    out, lse = run_cutlass(problem, BF16, causal=causal)
    baseline, _ = reference.context_attention(*problem, compute_dtype=BF16, causal=causal)
    check(problem, out, lse, baseline, causal=causal)


@pytest.mark.gpu
@pytest.mark.usefixtures("grid")
def test_fp8_output_scale():
    problem, scales = fp8_problem("cuda", [200, 77], [300, 77], 8, 8, 128, per_head=True)
    out_scale = torch.tensor(0.05, device="cuda")
    out, lse = run_cutlass(problem, E4M3, causal=True, out_scale=out_scale, **scales)
    truth, _ = reference.context_attention(*problem, causal=True, compute_dtype=torch.float64, **scales)
    t = (truth / 0.05).clamp(-448, 448)
    base = fp8_p_baseline(problem, causal=True, **scales).double() / 0.05
    floor = 2 * (t.to(E4M3).double() - t).abs().max().item()
    assert_error_ratio(out.double(), t, base, floor=floor, name="fp8 out")


@pytest.mark.gpu
@pytest.mark.usefixtures("grid")
@pytest.mark.parametrize("pad", [64, 4], ids=["aligned", "misaligned"])
def test_strided_inputs_and_outputs(pad):
    """q/k/v as views of one fused qkv tensor, and an out buffer with a padded head stride (a
    16-byte multiple or not: the epilogue's 16-byte stores then go through a contiguous buffer)."""
    t, h, d = 333, 4, 128
    qkv = torch.randn(t, 3 * h, d, device="cuda", dtype=BF16)
    problem = (qkv[:, :h], qkv[:, h:2 * h], qkv[:, 2 * h:], cumsum0([100, 233], "cuda"), cumsum0([100, 233], "cuda"))
    out = poison_(torch.empty(t, h, d + pad, device="cuda", dtype=BF16))[..., :d]
    lse = poison_(torch.empty(t, h, device="cuda"))
    with torch_ops.use_backend("cutlass"):
        torch.ops.attn.context_attention.out(*problem, out=out, lse=lse, causal=True)
    baseline, _ = reference.context_attention(*problem, compute_dtype=BF16, causal=True)
    check(problem, out, lse, baseline, causal=True)


@pytest.mark.gpu
@pytest.mark.usefixtures("grid")
def test_cuda_graph_replay_follows_new_lengths():
    """Lengths live in device tensors: a captured graph replays new batches without recapture."""
    d, hq, hkv, cap = 128, 8, 2, 1024
    problem, scales = fp8_problem("cuda", [cap // 2, cap // 2], [cap // 2, cap // 2], hq, hkv, d, per_head=True)
    q8, k8, v8, cu_q, cu_k = problem
    out = torch.empty(cap, hq, d, device="cuda", dtype=BF16)
    lse = torch.empty(cap, hq, device="cuda")

    def call():
        with torch_ops.use_backend("cutlass"):
            torch.ops.attn.context_attention.out(q8, k8, v8, cu_q, cu_k, out=out, lse=lse, causal=True, **scales)

    def fill(step):
        new, _ = fp8_problem("cuda", [cap // 2, cap // 2], [cap // 2, cap // 2], hq, hkv, d, per_head=True)
        for dst, src in zip((q8, k8, v8), new[:3]):
            dst.copy_(src)
        split = [cap // 2, 100, 300, 1000][step]
        cu_q.copy_(cumsum0([split, cap - split], "cuda"))
        cu_k.copy_(cu_q)

    def verify(o, l):
        check(problem, o, l, fp8_p_baseline(problem, causal=True, **scales), causal=True, **scales)

    assert_replays_match_eager(call, fill, [out, lse], verify)


@pytest.mark.gpu
@pytest.mark.parametrize("num_ctas,section_heads", [(1, 1), (7, 2), (64, 8)])
@pytest.mark.parametrize("dtype,d", [(E4M3, 128), (BF16, 64), (BF16, 128), (E4M3, 256)])
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_ctas_loop_over_many_tiles(monkeypatch, num_ctas, section_heads, dtype, d, causal):
    """Few CTAs, each running many work tiles in turn (one CTA: all of them): the pipelines carry
    their state from tile to tile, spare tiles are skipped, every row of every head is written."""
    monkeypatch.setattr(fmha_sm90, "PERSISTENT", True)
    monkeypatch.setattr(fmha_sm90, "persistent_ctas", lambda *shape: num_ctas)
    monkeypatch.setattr(fmha_sm90, "section_heads", lambda *shape: section_heads)
    q_lens, k_lens = [300, 0, 17, 129, 64, 1000, 255], [300, 0, 700, 129, 0, 1000, 601]
    hq, hkv = 8, 2
    if dtype == E4M3:
        problem, scales = fp8_problem("cuda", q_lens, k_lens, hq, hkv, d, per_head=True)
        baseline = fp8_p_baseline(problem, causal=causal, **scales)
    else:
        problem = (torch.randn(sum(q_lens), hq, d, device="cuda", dtype=dtype),
                   torch.randn(sum(k_lens), hkv, d, device="cuda", dtype=dtype),
                   torch.randn(sum(k_lens), hkv, d, device="cuda", dtype=dtype),
                   cumsum0(q_lens, "cuda"), cumsum0(k_lens, "cuda"))
        scales = {}
        baseline, _ = reference.context_attention(*problem, compute_dtype=dtype, causal=causal)
    out, lse = run_cutlass(problem, BF16, causal=causal, **scales)
    check(problem, out, lse, baseline, causal=causal, **scales)



# ---- paged_prefill (GPU) -------------------------------------------------------------------------


def paged_problem(q_lens, k_lens, *, dtype, d, hq, hkv, block_size):
    """`(query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens)` with shuffled blocks; every
    cache slot past a sequence's end, and the spare blocks its table points at there, hold NaN."""
    per_seq = [-(-k // block_size) for k in k_lens]
    num_blocks = sum(per_seq) + 2
    k_cache, v_cache = (torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype, device="cuda")
                        for _ in range(2))
    order = torch.randperm(num_blocks - 1).tolist()
    tables = torch.full((len(k_lens), max(per_seq + [1]) + 1), num_blocks - 1, dtype=torch.int32)
    for b, (k_len, n) in enumerate(zip(k_lens, per_seq)):
        tables[b, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
        for cache in (k_cache, v_cache):
            keys = torch.randn(k_len, hkv, d, dtype=dtype, device="cuda")
            slots = torch.arange(k_len)
            cache[tables[b, slots // block_size].long(), slots % block_size] = keys
    query = torch.randn(sum(q_lens), hq, d, dtype=dtype, device="cuda")
    return query, k_cache, v_cache, tables.cuda(), cumsum0(q_lens, "cuda"), torch.tensor(k_lens, device="cuda")


def run_paged(problem, backend="cutlass", **options):
    query = problem[0]
    out = torch.empty_like(query)
    lse = torch.empty(query.shape[:2], dtype=torch.float32, device="cuda")
    poison_(out)
    poison_(lse)
    with torch_ops.use_backend(backend):
        torch.ops.attn.paged_prefill.out(*problem, out=out, lse=lse, **options)
    return out, lse


def check_paged(problem, out, lse, **options):
    truth_o, truth_l = reference.paged_prefill(*problem, compute_dtype=torch.float64, **options)
    base_o, base_l = reference.paged_prefill(*problem, compute_dtype=problem[0].dtype, **options)
    assert not torch.isnan(out.float()).any() and not torch.isnan(lse).any(), "unwritten or NaN output"
    assert_error_ratio(out, truth_o, base_o)
    assert_error_ratio(lse, truth_l, base_l, name="lse")
    empty = torch.isinf(truth_l)
    assert (out.float()[empty] == 0).all() and (lse[empty] == float("-inf")).all(), "rows with no key: 0 and -inf"


# (q_lens, k_lens): chunks over cached prefixes of every length mod 8, an empty chunk, a sequence
# without keys, more queries than keys, and one sequence across many key tiles
PAGED_LENS = [([300, 0, 17, 129, 64, 5], [700, 40, 17, 1000, 0, 3]), ([1000], [1000]), ([77, 128], [1281, 1155])]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d", [(BF16, 64), (BF16, 128), (FP16, 128)])
@pytest.mark.parametrize("block_size", [8, 16, 48, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", PAGED_LENS, ids=["ragged", "single", "chunks"])
def test_paged_prefill(dtype, d, block_size, causal, lens):
    problem = paged_problem(*lens, dtype=dtype, d=d, hq=8, hkv=2, block_size=block_size)
    assert fmha_sm90.paged_unsupported(*problem, causal=causal) == []
    out, lse = run_paged(problem, causal=causal, scale=0.1, q_scaling=1.5)
    check_paged(problem, out, lse, causal=causal, scale=0.1, q_scaling=1.5)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_prefill_d64_long_chunks_on_the_automatic_persistent_grid(block_size, causal):
    q_lens, k_lens = [600, 0, 1500, 513], [900, 7, 1500, 2000]
    problem = paged_problem(q_lens, k_lens, dtype=BF16, d=64, hq=8, hkv=2, block_size=block_size)
    assert fmha_sm90.paged_runs_persistent("pagedx2", BF16, 64, sum(q_lens), len(q_lens))
    out, lse = run_paged(problem, causal=causal)
    check_paged(problem, out, lse, causal=causal)


# (q_len, seq_len): decodes and short chunks (the Triton kernel's launches) around chunks of more than
# 64 queries (CUTLASS), 64 and 65 queries on either side of the split, an empty sequence, and more
# queries than keys
MIXED_SEQS = [(1, 900), (300, 700), (64, 64), (1, 33), (65, 1000), (0, 5), (3, 3), (129, 200), (17, 400),
              (1, 1), (70, 40), (2, 129)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,hq,hkv", [(BF16, 128, 8, 2), (FP16, 64, 8, 8), (BF16, 128, 32, 4)])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_mixed_backend(csrc_libraries, dtype, d, hq, hkv, block_size, causal):
    seqs = random.sample(MIXED_SEQS, len(MIXED_SEQS))
    problem = paged_problem([q for q, _ in seqs], [k for _, k in seqs], dtype=dtype, d=d, hq=hq, hkv=hkv,
                            block_size=block_size)
    assert torch_ops.backend_for("paged_prefill", *problem, causal=causal) == "mixed"
    out, lse = run_paged(problem, "mixed", causal=causal, scale=0.1, q_scaling=1.5)
    check_paged(problem, out, lse, causal=causal, scale=0.1, q_scaling=1.5)


@pytest.mark.gpu
def test_mixed_backend_over_many_sequences():
    rng = random.Random(1)
    q_lens = [q if q > 40 else rng.choice([1, 1, 2, q]) for q in many_sequences(300, 40, rng)]
    k_lens = [q + rng.randint(0, 600) for q in q_lens]
    problem = paged_problem(q_lens, k_lens, dtype=BF16, d=128, hq=8, hkv=2, block_size=16)
    out, lse = run_paged(problem, "mixed")
    check_paged(problem, out, lse)


@pytest.mark.gpu
def test_mixed_backend_misaligned_out():
    """The CUTLASS part writes through a contiguous buffer (garbage in the other rows), the Triton part after it."""
    problem = paged_problem([1, 200, 5, 77], [300, 500, 5, 400], dtype=BF16, d=128, hq=8, hkv=2, block_size=16)
    query = problem[0]
    out = poison_(torch.empty(query.numel() + 1, dtype=BF16, device="cuda"))[1:].view(query.shape)
    lse = poison_(torch.empty(query.shape[:2], device="cuda"))
    with torch_ops.use_backend("mixed"):
        torch.ops.attn.paged_prefill.out(*problem, out=out, lse=lse)
    check_paged(problem, out, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("d,block_size,layout,kernel", [
    (128, 32, "halves", ("paged", 32)), (64, 16, "halves", ("paged", 16)), (128, 32, "padded", ("paged16", 16)),
    (128, 8, "padded", ("paged", 8)), (64, 16, "padded", ("paged", 16)), (64, 16, "k_padded", ("paged", 16))])
@pytest.mark.parametrize("hkv", [8, 2])
def test_paged_prefill_fp8_output_and_strided_cache(d, block_size, layout, kernel, hkv):
    """FP8 output through out_scale; K and V as the halves of one [blocks, 2, block, Hkv, D] tensor, or
    in blocks padded by a token (at D = 128 TMA cannot see them as one line of 8-token groups), or K
    alone padded (no line: K's and V's blocks lie differently); MHA and 4 query heads per KV head (the
    cluster kernels)."""
    problem = paged_problem([200, 77], [500, 77], dtype=BF16, d=d, hq=8, hkv=hkv, block_size=block_size)
    if layout == "halves":
        kv = torch.stack(problem[1:3], dim=1)
        problem = (problem[0], kv[:, 0], kv[:, 1], *problem[3:])
    else:
        def pad(cache):
            padded = torch.full((cache.shape[0], block_size + 1, *cache.shape[2:]), float("nan"), dtype=BF16,
                                device="cuda")
            padded[:, :block_size] = cache
            return padded[:, :block_size]
        k, v = problem[1:3]
        problem = (problem[0], pad(k), pad(v) if layout == "padded" else v, *problem[3:])
    assert fmha_sm90.paged_kernel(*problem[1:3], 8 // hkv) == (kernel[0] + ("x2" if hkv == 2 else ""), kernel[1])
    out_scale = torch.tensor(0.02, device="cuda")
    out = torch.empty(problem[0].shape, dtype=E4M3, device="cuda")
    lse = torch.empty(problem[0].shape[:2], device="cuda")
    poison_(out)
    poison_(lse)
    with torch_ops.use_backend("cutlass"):
        torch.ops.attn.paged_prefill.out(*problem, out=out, lse=lse, out_scale=out_scale)
    truth, _ = reference.paged_prefill(*problem, compute_dtype=torch.float64)
    base, _ = reference.paged_prefill(*problem, compute_dtype=BF16)
    t = (truth / 0.02).clamp(-448, 448)
    floor = 2 * (t.to(E4M3).double() - t).abs().max().item()
    assert_error_ratio(out.double(), t, base.double() / 0.02, floor=floor, name="fp8 out")


@pytest.mark.gpu
@pytest.mark.parametrize("backend,q_lens,k_lens", [
    ("cutlass", [[256, 256], [100, 412], [300, 212], [511, 1]],
     [[2048, 2048], [700, 1999], [2048, 301], [1024, 555]]),
    # sequences moving across the mixed backend's 64-query split
    ("mixed", [[1, 300, 100, 111], [200, 1, 1, 310], [64, 65, 250, 133], [512, 0, 0, 0]],
     [[700, 300, 900, 333], [700, 1, 900, 333], [700, 65, 900, 333], [700, 1, 900, 333]]),
])
def test_paged_prefill_cuda_graph_replay_follows_new_tables_and_lengths(backend, q_lens, k_lens):
    cap = max(map(max, k_lens))
    problem = paged_problem(q_lens[0], [cap] * len(q_lens[0]), dtype=BF16, d=128, hq=8, hkv=2, block_size=16)
    query, k_cache, v_cache, tables, cu_q, lens = problem
    out = torch.empty_like(query)
    lse = torch.empty(query.shape[:2], device="cuda")
    blocks = -(-cap // 16)

    def call():
        with torch_ops.use_backend(backend):
            torch.ops.attn.paged_prefill.out(*problem, out=out, lse=lse)

    def fill(step):
        query.normal_()
        tables[:, :blocks].copy_(tables[:, :blocks].flip(0) if step % 2 else tables[:, :blocks])
        cu_q.copy_(cumsum0(q_lens[step], "cuda"))
        lens.copy_(torch.tensor(k_lens[step], device="cuda"))

    assert_replays_match_eager(call, fill, [out, lse], lambda o, l: check_paged(problem, o, l))
