"""What the `cutlass` backend launches (torch_ops/kernels/cuda/fmha_sm90.py), on the CPU: the persistent-grid knob
and the automatic grid, grid sizes, value layouts, head sections and paged kernels (through a
spied `_kernel`), and the registry's reasons for passing a problem over.
"""

from __future__ import annotations

import pytest
import torch

import torch_ops
from torch_ops import gpu
from torch_ops.kernels.cuda import fmha_sm90, fmha_sm90_build

E4M3, BF16 = torch.float8_e4m3fn, torch.bfloat16


# ---- persistent grid (CPU) -----------------------------------------------------------------------


@pytest.fixture
def knob(monkeypatch):
    """Clears the PERSISTENT knob and its environment variable; returns monkeypatch."""
    monkeypatch.setattr(fmha_sm90, "PERSISTENT", None)
    monkeypatch.delenv("ATTN_CUTLASS_PERSISTENT", raising=False)
    return monkeypatch


def test_persistent_knob_defaults_to_automatic_and_reads_the_environment(knob):
    assert fmha_sm90.persistent_mode() is None
    knob.setenv("ATTN_CUTLASS_PERSISTENT", "1")
    assert fmha_sm90.persistent_mode() is True
    knob.setenv("ATTN_CUTLASS_PERSISTENT", " 0 ")
    assert fmha_sm90.persistent_mode() is False
    knob.setenv("ATTN_CUTLASS_PERSISTENT", "auto")
    assert fmha_sm90.persistent_mode() is None
    knob.setattr(fmha_sm90, "PERSISTENT", True)   # the attribute wins over the environment
    assert fmha_sm90.persistent_mode() is True
    knob.setenv("ATTN_CUTLASS_PERSISTENT", "1")
    knob.setattr(fmha_sm90, "PERSISTENT", False)
    assert fmha_sm90.persistent_mode() is False


@pytest.mark.parametrize("value", ["yes", "true", "2", ""])
def test_persistent_environment_value_must_be_0_1_or_auto(knob, value):
    knob.setenv("ATTN_CUTLASS_PERSISTENT", value)
    with pytest.raises(ValueError, match="ATTN_CUTLASS_PERSISTENT must be 0, 1 or auto"):
        fmha_sm90.persistent_mode()


def test_persistent_attribute_must_be_a_bool_or_none(knob):
    knob.setattr(fmha_sm90, "PERSISTENT", 1)
    with pytest.raises(TypeError, match="PERSISTENT must be True, False or None"):
        fmha_sm90.persistent_mode()


def test_automatic_grid_is_persistent_for_short_prompts_where_it_measured_faster(knob):
    fp8, bf16, fp16 = torch.float8_e4m3fn, torch.bfloat16, torch.float16
    run = fmha_sm90.runs_persistent
    assert run(fp8, 128, False, 16384, 8) and run(fp8, 128, True, 16384, 8)             # mean 2k
    assert not run(fp8, 128, False, 16384, 4) and not run(fp8, 128, True, 16384, 4)     # mean 4k
    assert run(fp8, 128, True, 5000, 3)                                                 # ragged, mean under 2k
    assert not run(fp8, 256, False, 1024, 2)                                            # not in the default build
    assert run(bf16, 128, True, 16384, 16) and not run(bf16, 128, True, 16384, 8)       # causal: mean 1k and 2k
    assert run(bf16, 128, False, 16384, 32) and not run(bf16, 128, False, 16384, 16)    # non-causal: 512 and 1k
    assert run(bf16, 64, False, 16384, 8) and not run(bf16, 64, True, 16384, 4)          # D = 64: mean <= 2k
    assert run(fp16, 128, True, 16384, 16) and run(fp16, 64, True, 16384, 8)           # fp16 as bf16
    assert not run(fp16, 128, False, 16384, 16) and not run(fp16, 64, False, 16384, 4)
    knob.setattr(fmha_sm90, "PERSISTENT", False)
    assert not run(fp8, 128, True, 16384, 32)
    knob.setattr(fmha_sm90, "PERSISTENT", True)
    assert run(fp8, 128, False, 16384, 1) and run(fp16, 64, False, 16384, 1)


def test_automatic_paged_grid_is_persistent_for_d64_cluster_kernels_on_long_chunks(knob):
    bf16, fp16 = torch.bfloat16, torch.float16
    run = fmha_sm90.paged_runs_persistent
    assert run("pagedx2", bf16, 64, 2048, 4) and run("pagedx2", fp16, 64, 4096, 1)       # mean 512 and 4k
    assert not run("pagedx2", bf16, 64, 4096, 16)                                        # 16 x 256: plain
    assert not run("paged", bf16, 64, 8192, 4) and not run("paged16x2", bf16, 128, 8192, 4)
    assert not run("pagedx2", bf16, 128, 8192, 4)                                        # D = 128: plain
    knob.setattr(fmha_sm90, "PERSISTENT", True)
    assert run("paged16", bf16, 128, 16, 16)
    knob.setattr(fmha_sm90, "PERSISTENT", False)
    assert not run("pagedx2", bf16, 64, 8192, 1)


def test_persistent_grid_is_one_cta_per_sm_at_most_one_per_work_tile():
    # S = 8k x 2 sequences, H = 32: (16384 // 128 + 2) * 32 work tiles >> 132 SMs
    assert fmha_sm90.persistent_ctas(16384, 2, 32, 132) == 132
    # 300 query rows in 3 sequences, 2 heads: (300 // 128 + 3) * 2 = 10 work tiles
    assert fmha_sm90.persistent_ctas(300, 3, 2, 132) == 10


@pytest.mark.parametrize("dtype,d,variant,layout", [
    (torch.bfloat16, 128, "plain", fmha_sm90.V_TOKENS), (torch.float16, 64, "persistent", fmha_sm90.V_TOKENS),
    (torch.float8_e4m3fn, 128, "persistent", fmha_sm90.V_TOKENS),   # tiles transposed in shared memory
    (torch.float8_e4m3fn, 128, "plain", fmha_sm90.V_TRANSPOSED_INTERLEAVED),
    (torch.float8_e4m3fn, 256, "plain", fmha_sm90.V_TRANSPOSED),
])
def test_value_layout_follows_the_kernel(kernel_device, dtype, d, variant, layout):
    assert fmha_sm90.value_layout(dtype, d, variant) == layout
    value = torch.randn(37, 2, d, device=kernel_device).to(dtype)
    v, fields = fmha_sm90.value_operand(value, layout)
    assert fields["v_layout"] == layout
    if layout == fmha_sm90.V_TOKENS:
        assert v.data_ptr() == value.data_ptr() and (fields["v_row_stride"], fields["v_head_stride"]) == (2 * d, d)
        return
    tokens = 48 if layout == fmha_sm90.V_TRANSPOSED_INTERLEAVED else 37   # whole groups of 16, zero-padded
    assert v.shape == (2, d, tokens) and fields["v_dim_stride"] == 48 and fields["v_head_stride"] == 48 * d
    order = torch.tensor(transpose_positions(tokens, layout == fmha_sm90.V_TRANSPOSED_INTERLEAVED))
    expected = value.view(torch.uint8)[order.clamp(max=36)].permute(1, 2, 0)
    expected[..., order >= 37] = 0
    assert torch.equal(v.view(torch.uint8), expected)


def transpose_positions(tokens: int, interleaved: bool) -> list[int]:
    """The token at each position along vt's last dim."""
    from torch_ops.kernels.triton.transpose import INTERLEAVE16
    return [p - p % 16 + INTERLEAVE16[p % 16] if interleaved else p for p in range(tokens)]


@pytest.mark.parametrize("hq,hkv,keys,d,size,heads", [
    (32, 32, 8192, 128, 1, 16),     # FP8 8k: 2 MiB of K/V per head, 16 heads in 32 MiB
    (32, 32, 8192, 128, 2, 8),      # bf16: 4 MiB per head
    (32, 8, 8192, 128, 2, 32),      # GQA: 4 query heads share each 4 MiB KV head
    (16, 16, 8192, 256, 1, 8),      # D = 256
    (32, 32, 2048, 128, 1, 32),     # 2k keys: everything fits
    (12, 12, 8192, 128, 2, 6),      # a divisor of hq, not a power of two
    (32, 32, 1 << 20, 256, 2, 1),   # one head's K/V alone exceeds the budget
])
def test_sections_are_the_largest_head_divisor_whose_kv_fits_l2(hq, hkv, keys, d, size, heads):
    section = fmha_sm90.section_heads(hq, hkv, keys, d, size)
    assert section == heads and hq % section == 0


def test_sections_only_for_causal_grids_of_few_waves():
    # 2k causal queries x 32 heads: 16 tiles x 32 = 512 CTAs, under 16 waves of 132
    assert fmha_sm90.sectioned(True, 2048, 32, 132)
    assert not fmha_sm90.sectioned(False, 2048, 32, 132)      # non-causal: head by head
    assert fmha_sm90.sectioned(True, 8448, 32, 132)           # 66 x 32 = 2112 CTAs: 16 waves
    assert not fmha_sm90.sectioned(True, 8576, 32, 132)       # 67 x 32: more


def test_paged_sections_come_from_the_block_table_capacity(monkeypatch):
    """The lengths are on the device: the sections assume every sequence fills its table row."""
    seen = {}
    monkeypatch.setattr(fmha_sm90, "_kernel", lambda op, variant, *rest: seen.update(variant=variant, args=rest[-1]) or _no_launch)
    monkeypatch.setattr(gpu, "sm_count", lambda device: 132)
    q, k_cache, v_cache, _, cu_q, lens = _paged_problem_cpu(hq=32, hkv=8, tq=300, seqs=2)
    tables = torch.zeros(2, 2048, dtype=torch.int32)   # 32k keys: 16 MiB of bf16 K/V per KV head

    def section(q=q, **options):
        fmha_sm90.paged_run(q, k_cache, v_cache, tables, cu_q, lens, out=torch.empty_like(q),
                          lse=torch.empty(q.shape[:2]), **options)
        return seen["variant"], seen["args"]["section_heads"]

    assert section() == ("paged16x2", fmha_sm90.section_heads(32, 8, 2048 * 16, 128, 2)) == ("paged16x2", 8)   # 2 KV heads
    # one head per section, but a cluster's two CTAs run two heads of one section
    assert section(causal=False) == ("paged16x2", 2)
    assert section(q[:, :24], causal=False) == ("paged16", 1)   # 3 query heads per KV head: no clusters
    monkeypatch.setattr(fmha_sm90, "L2_SECTION_BYTES", 0)   # nothing fits: one head per section
    assert section() == ("paged16x2", 2)


def test_paged_persistent_grid_where_forced_or_chosen(monkeypatch):
    """The paged families run the persistent grid when it is forced (one CTA per SM, in sections of
    heads, even ones for the cluster kernels), or where `paged_runs_persistent` picks it (D = 64), the
    plain one otherwise."""
    seen = {}
    monkeypatch.setattr(fmha_sm90, "_kernel", lambda op, variant, *rest: seen.update(variant=variant, args=rest[-1]) or _no_launch)
    monkeypatch.setattr(gpu, "sm_count", lambda device: 132)
    q, k_cache, v_cache, tables, cu_q, lens = _paged_problem_cpu(hq=32, hkv=8, tq=300, seqs=2)

    def launch(q=q):
        fmha_sm90.paged_run(q, k_cache, v_cache, tables, cu_q, lens, out=torch.empty_like(q), lse=torch.empty(q.shape[:2]))
        return seen["variant"], seen["args"]["num_ctas"], seen["args"]["section_heads"]

    assert launch()[:2] == ("paged16x2", 0)
    monkeypatch.setattr(fmha_sm90, "PERSISTENT", True)
    ctas = fmha_sm90.persistent_ctas(300, 2, 32, 132)
    variant, num_ctas, section = launch()
    assert (variant, num_ctas) == ("paged16x2_persistent", ctas) and section % 2 == 0 and 32 % section == 0
    assert launch(q[:, :24])[:2] == ("paged16_persistent", fmha_sm90.persistent_ctas(300, 2, 24, 132))
    assert "paged16x2_persistent" in fmha_sm90_build.built_variants()
    monkeypatch.setattr(fmha_sm90, "PERSISTENT", None)
    q, k_cache, v_cache, tables, cu_q, lens = _paged_problem_cpu(d=64, hq=32, hkv=8, tq=1024, seqs=2)
    assert launch(q)[:2] == ("pagedx2_persistent", fmha_sm90.persistent_ctas(1024, 2, 32, 132))
    assert launch(q[:1000])[:2] == ("pagedx2", 0)   # mean 500 queries


@pytest.mark.parametrize("block_size,d,variant,box_rows", [
    (16, 128, "paged16", 16), (48, 128, "paged16", 16), (8, 128, "paged", 8), (32, 128, "paged", 32),
    (256, 128, "paged", 128), (64, 64, "paged", 64), (8, 64, "paged", 8)])
@pytest.mark.parametrize("layout", ["own", "halves", "padded"])
@pytest.mark.parametrize("hq", [2, 4, 6])
def test_paged_kernel_by_box_rows_head_dim_and_cache_layout(monkeypatch, block_size, d, variant, box_rows, layout, hq):
    """Boxes of up to the key tile's tokens x the whole head dim; at D = 128 the paged16 kernels take
    16-token boxes, and the larger boxes of caches that TMA cannot see as one line of tokens (here
    blocks padded by a token; K and V as halves of one [blocks, 2, block_size, Hkv, D] tensor are one).
    An even number of query heads per KV head takes the family's cluster kernels."""
    seen = {}
    monkeypatch.setattr(fmha_sm90, "_kernel", lambda op, variant, *rest: seen.update(variant=variant, args=rest[-1]) or _no_launch)
    monkeypatch.setattr(gpu, "sm_count", lambda device: 132)
    q, k_cache, v_cache, tables, cu_q, lens = _paged_problem_cpu(d=d, block_size=block_size, hq=hq, hkv=2)
    if layout == "halves":
        k_cache, v_cache = torch.stack((k_cache, v_cache), dim=1).unbind(1)
    elif layout == "padded":
        k_cache, v_cache = (torch.zeros(c.shape[0], block_size + 1, *c.shape[2:], dtype=c.dtype)[:, :block_size]
                            for c in (k_cache, v_cache))
    fmha_sm90.paged_run(q, k_cache, v_cache, tables, cu_q, lens, out=torch.empty_like(q), lse=torch.empty(q.shape[:2]))
    if layout == "padded" and d == 128 and box_rows > 16:
        variant, box_rows = "paged16", 16
    if hq == 4 and box_rows <= 32:
        variant += "x2"
    assert (seen["variant"], seen["args"]["box_rows"]) == (variant, box_rows)


def test_context_sections_follow_the_rule_at_the_mean_key_length(monkeypatch):
    """Causal launches of few waves run in sections sized at the mean key length; the rest head by head."""
    seen = {}
    monkeypatch.setattr(fmha_sm90, "_kernel", lambda op, variant, *rest: seen.update(variant=variant, args=rest[-1]) or _no_launch)
    monkeypatch.setattr(gpu, "sm_count", lambda device: 132)
    q = torch.randn(4096, 32, 128).to(BF16)       # 2k queries per sequence: the plain grid
    kv = torch.randn(2 * 8192, 32, 128).to(BF16)   # two sequences of 8k keys: 4 MiB of K/V per head
    cu_q, cu_k = torch.tensor([0, 2048, 4096], dtype=torch.int32), torch.tensor([0, 8192, 16384], dtype=torch.int32)

    def section(causal):
        fmha_sm90.run(q, kv, kv, cu_q, cu_k, out=torch.empty_like(q), lse=torch.empty(q.shape[:2]), causal=causal)
        assert seen["variant"] == "plain"
        return seen["args"]["section_heads"]

    assert section(True) == fmha_sm90.section_heads(32, 32, 8192, 128, 2) == 8
    assert section(False) == 1


# ---- registry (CPU) ------------------------------------------------------------------------------


def _problem(device="cpu", *, dtype=BF16, d=128, tq=5, tk=7, hq=4, hkv=2):
    q = torch.randn(tq, hq, d, device=device).to(dtype)
    k = torch.randn(tk, hkv, d, device=device).to(dtype)
    v = torch.randn(tk, hkv, d, device=device).to(dtype)
    cu_q = torch.tensor([0, tq], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, tk], dtype=torch.int32, device=device)
    return q, k, v, cu_q, cu_k


def test_backend_is_chosen_ahead_of_triton_on_cuda():
    for op in ("context_attention", "paged_prefill"):
        names = torch_ops.backends.PRIORITY[op]
        assert names.index("cutlass") < names.index("triton")
    assert fmha_sm90.CutlassBackend.auto_devices == ("cuda",)


def test_cpu_tensors_are_not_served_and_an_explicit_request_says_why():
    problem = _problem()
    assert torch_ops.backend_for("context_attention", *problem) != "cutlass"
    with torch_ops.use_backend("cutlass"), pytest.raises(ValueError, match="cutlass.*need CUDA tensors"):
        torch.ops.attn.context_attention(*problem)
    with torch_ops.use_backend("cutlass"), pytest.raises(ValueError, match="no CUTLASS kernel for attn::merge_states"):
        out = torch.randn(3, 2, 8)
        torch.ops.attn.merge_states(out, torch.randn(3, 2), out, torch.randn(3, 2))


@pytest.mark.parametrize("options,reason", [
    ({"alibi_slopes": torch.ones(4)}, "ALiBi"),
    ({"window_left": 16}, "sliding windows"),
    ({"sink_tokens": 4}, "sink tokens"),
    ({"sinks": torch.zeros(4)}, "learned sinks"),
    ({"softcap": 30.0}, "soft-capping"),
    ({"positions": torch.arange(5), "cos_sin_cache": torch.ones(8, 128)}, "fused RoPE"),
    ({"out_dtype": torch.float32}, "epilogue writes bf16, fp16 or float8_e4m3fn"),
])
def test_unsupported_options_are_named(options, reason):
    q, k, *_ = _problem()
    why = fmha_sm90.problem_reasons(q, k, **options)
    assert len(why) == 1 and reason in why[0]
    assert fmha_sm90.problem_reasons(q, k, out_scale=torch.tensor(1.0)) == []


@pytest.mark.parametrize("dtype,d", [(torch.float32, 128), (BF16, 96), (E4M3, 64), (E4M3, 96), (torch.float8_e5m2, 128)])
def test_unsupported_dtypes_and_head_dims_are_named(dtype, d):
    q, k, *_ = _problem(dtype=dtype, d=d)
    (why,) = fmha_sm90.problem_reasons(q, k)
    assert "no CUTLASS kernel for" in why and f"head dim {d}" in why


def test_empty_keys_are_not_served():
    q, k, *_ = _problem(tk=0)
    assert fmha_sm90.problem_reasons(q, k) == ["key is empty (total_k == 0)"]


def _no_launch(*args, **kwargs) -> None:
    """A spied `_kernel`: the tests read what it was prepared with."""


_no_launch.describe = "a spy"


def _paged_problem_cpu(*, dtype=BF16, cache_dtype=None, d=128, block_size=16, hq=4, hkv=2, tq=300, seqs=2):
    q = torch.randn(tq, hq, d).to(dtype)
    k_cache = torch.zeros(8, block_size, hkv, d, dtype=cache_dtype or dtype)
    tables = torch.zeros(seqs, 4, dtype=torch.int32)
    lens = torch.full((seqs,), 40, dtype=torch.int32)
    cu_q = torch.tensor([0, *[tq] * seqs], dtype=torch.int32)
    return q, k_cache, k_cache.clone(), tables, cu_q, lens


def test_paged_prefill_reasons():
    q, k, v, tables, *_ = _paged_problem_cpu()
    assert fmha_sm90.paged_problem_reasons(q, k, v, tables) == []
    assert fmha_sm90.paged_problem_reasons(q, k, v, tables, out_scale=torch.tensor(1.0)) == []

    def reasons(**kw):
        q, k, v, tables, *_ = _paged_problem_cpu(**kw)
        (why,) = fmha_sm90.paged_problem_reasons(q, k, v, tables)
        return why

    assert "no paged CUTLASS kernel for torch.bfloat16 with head dim 256" in reasons(d=256)
    assert "FP8/INT8/INT4 caches run on Triton" in reasons(cache_dtype=E4M3)
    assert "block_size 12 is not a multiple of 8" in reasons(block_size=12)
    assert "ALiBi" in fmha_sm90.paged_problem_reasons(q, k, v, tables, alibi_slopes=torch.ones(4))[0]
    swapped = k.transpose(1, 2).contiguous().transpose(1, 2)   # [blocks, tokens, heads, D], heads outer
    assert "not ordered head <= token <= block" in fmha_sm90.paged_problem_reasons(q, swapped, v, tables)[0]
    padded = torch.zeros(8, 16, 2, 132, dtype=BF16)[..., :128]   # head stride 264 bytes
    assert "16-byte aligned" in fmha_sm90.paged_problem_reasons(q, padded, v, tables)[0]


def test_paged_prefill_goes_to_triton_for_decode_heavy_batches_and_small_blocks(monkeypatch):
    monkeypatch.setattr(fmha_sm90, "library_built", lambda: True)
    backend = fmha_sm90.CutlassBackend()
    prefill = _paged_problem_cpu(tq=300, seqs=2, block_size=16)
    assert backend.auto_declines("paged_prefill", prefill, {}) == []
    (why,) = backend.auto_declines("paged_prefill", _paged_problem_cpu(tq=100, seqs=64, block_size=64), {})
    assert "queries per sequence" in why
    assert backend.auto_declines("paged_prefill", _paged_problem_cpu(tq=300, seqs=2, block_size=8), {}) == []
    # 1 KB boxes: to Triton, but not where a cluster kernel shares each box between two CTAs
    (why,) = backend.auto_declines("paged_prefill", _paged_problem_cpu(tq=300, seqs=2, block_size=8, d=64, hq=2), {})
    assert "TMA boxes of 8 tokens (block_size 8) x 64 dims, 1024 bytes for one CTA" in why
    assert backend.auto_declines("paged_prefill", _paged_problem_cpu(tq=300, seqs=2, block_size=8, d=64, hq=4), {}) == []
    assert torch_ops.backend_for("paged_prefill", *prefill) != "cutlass"   # CPU tensors


def test_mixed_backend_is_first_and_serves_batches_that_may_hold_a_long_sequence(monkeypatch):
    monkeypatch.setattr(fmha_sm90, "library_built", lambda: True)
    names = torch_ops.backends.PRIORITY["paged_prefill"]
    assert names.index("mixed") < names.index("cutlass") < names.index("triton")
    backend = fmha_sm90.MixedBatchBackend()
    assert backend.auto_declines("paged_prefill", _paged_problem_cpu(tq=100, seqs=64, block_size=16), {}) == []
    (why,) = backend.auto_declines("paged_prefill", _paged_problem_cpu(tq=300, seqs=1), {})
    assert "one sequence" in why
    (why,) = backend.auto_declines("paged_prefill", _paged_problem_cpu(tq=64, seqs=8), {})
    assert "no sequence can have more than 64 queries" in why
    (why,) = backend.auto_declines("paged_prefill", _paged_problem_cpu(tq=300, seqs=2, block_size=8, d=64, hq=2), {})
    assert "1024 bytes for one CTA" in why
    assert "serves attn::paged_prefill only" in backend.reasons("context_attention", _problem(), {})[0]
    assert any("CUDA" in why for why in backend.reasons("paged_prefill", _paged_problem_cpu(), {}))


def test_the_automatic_choice_builds_nothing(monkeypatch):
    """An unbuilt library is passed over, with the way to build it; an explicit request builds it."""
    monkeypatch.setattr(fmha_sm90, "library_built", lambda: False)
    for backend in (fmha_sm90.CutlassBackend(), fmha_sm90.MixedBatchBackend()):
        assert backend.auto_declines("paged_prefill", _paged_problem_cpu(tq=300, seqs=2), {}) == [fmha_sm90.NOT_BUILT]
    assert "torch_ops.warmup()" in fmha_sm90.NOT_BUILT
