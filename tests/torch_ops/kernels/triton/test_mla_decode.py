"""`attn::paged_decode` over an MLA latent cache (`v_cache = k_cache[..., :512]`, D = 576, one KV
head) and other value head dims below D: the Triton kernel (`torch_ops.kernels.triton.mla_decode`)
against the float64 reference, the contract's checks and the fakes.

Truth is `reference.paged_decode(..., compute_dtype=float64)` on the same (FP8) cache, the baseline
the same in the query dtype; `assert_error_ratio` bounds our error by twice the baseline's plus
the output's rounding floor. Calls go through `torch.ops.attn.paged_decode.out` with NaN-poisoned
`out`/`lse` (and split-K partials). On CPU the kernel runs in Triton's interpreter on small
problems (Hq = 16); the DeepSeek-V3-sized ones and CUDA graphs are marked `gpu`.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_ops
from torch_ops import errors, quant, reference
from torch_ops.kernels.cuda import decode_sm90
from torch_ops.kernels.triton import mla_decode
from torch_ops.kernels.triton import paged_decode as pd
from torch_ops.testing import assert_error_ratio, assert_replays_match_eager, max_error, poison_

pytestmark = pytest.mark.usefixtures("poisoned_workspace", "clear_error_flags")

BF16, FP16 = torch.bfloat16, torch.float16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
D, DV = 576, 512            # DeepSeek-V3 / Kimi K2: 512 latent dims + 64 RoPE dims
UNUSED_BLOCK = 2**30 - 1    # table entries past a sequence's length: reading one would fault


def latent_cache(num_blocks, bs, cache_dtype, device, *, d=D, scale=None):
    """`(k_cache [num_blocks, bs, 1, d], k_scale)`: random latents, FP8 ones quantized with one
    per-tensor scale (None for plain caches)."""
    x = torch.randn(num_blocks, bs, 1, d, device=device)
    if cache_dtype in (E4M3, E5M2):
        s = torch.tensor(0.02 if scale is None else scale, device=device)
        return quant.quantize_fp8(x, s, cache_dtype), s
    return x.to(cache_dtype), None


def make_problem(device, *, lens, hq=16, qps=1, bs=16, cache_dtype=BF16, dtype=BF16, extra_blocks=1,
                 max_blocks=None):
    """A latent-cache decode problem: each sequence on random blocks, `v_cache` the first 512 dims of
    `k_cache`. Returns `(args, kwargs)` of `paged_decode`."""
    per_seq = [-(-n // bs) for n in lens]
    needed = sum(per_seq) + 2
    k_cache, s = latent_cache(needed, bs, cache_dtype, device)
    width = max_blocks or max(per_seq + [1]) + extra_blocks
    ids = torch.randperm(needed).tolist()
    table = torch.full((len(lens), width), UNUSED_BLOCK, dtype=torch.int32)
    for b, n in enumerate(per_seq):
        n = min(n, width)
        table[b, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    q = torch.randn(len(lens) * qps, hq, D, dtype=dtype, device=device)
    args = (q, k_cache, k_cache[..., :DV], table.to(device), torch.tensor(lens, dtype=torch.int32, device=device))
    kwargs = {} if s is None else {"k_scale": s, "v_scale": s}
    return args, kwargs


def call_triton(args, kwargs):
    q, _, v_cache = args[:3]
    out_dtype = E4M3 if kwargs.get("out_scale") is not None else q.dtype
    out = torch.empty(*q.shape[:2], v_cache.shape[-1], dtype=out_dtype, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    poison_(out)
    poison_(lse)
    with torch_ops.use_backend("triton"):
        torch.ops.attn.paged_decode.out(*args, out=out, lse=lse, **kwargs)
    return out, lse


def check(args, kwargs, out, lse):
    """(out, lse) against the float64 truth with the error-ratio tolerance; sequences without keys
    give zeros and -inf (or the sink)."""
    q, seq_lens = args[0], args[4]
    kw = dict(kwargs)
    out_scale = kw.pop("out_scale", None)
    truth_o, truth_l = reference.paged_decode(*args, compute_dtype=torch.float64, **kw)
    base_o, base_l = reference.paged_decode(*args, compute_dtype=q.dtype, **kw)
    assert not torch.isnan(out.float()).any(), "out has NaN (unwritten or bad masking)"
    assert not torch.isnan(lse).any(), "lse has NaN"
    if out_scale is not None:
        s = out_scale.double()
        fp8_floor = (truth_o / s).clamp(-448, 448)
        fp8_floor = 2 * (fp8_floor.to(E4M3).double() - fp8_floor).abs().max().item() + 1e-6
        assert_error_ratio(out.double(), truth_o / s, base_o.double() / s, floor=fp8_floor, name="fp8 out")
    else:
        assert_error_ratio(out, truth_o, base_o)
    assert_error_ratio(lse, truth_l, base_l, name="lse")
    empty = (seq_lens <= 0).repeat_interleave(q.shape[0] // seq_lens.shape[0])
    if empty.any():
        assert (out[empty].float() == 0).all()
        sinks = kwargs.get("sinks")
        want = sinks.expand(int(empty.sum()), -1) if sinks is not None else torch.full_like(lse[empty], -math.inf)
        torch.testing.assert_close(lse[empty], want.float())


def launch_of(args, kwargs):
    q, _, v_cache = args[:3]
    out = torch.empty(*q.shape[:2], v_cache.shape[-1], dtype=q.dtype, device=q.device)
    return pd.prepare(*args, out=out, lse=torch.empty(q.shape[:2], device=q.device), **kwargs)


# ---- CPU (interpreter) cases -------------------------------------------------------------------


@pytest.mark.parametrize("bs,cache_dtype,qps,splits", [
    (16, BF16, 1, None), (16, E4M3, 4, None), (1, BF16, 4, 3), (1, E4M3, 1, 2),
    (64, BF16, 1, 4), (64, E4M3, 4, 1),
], ids=lambda x: str(x).replace("torch.", ""))
def test_latent_cache(kernel_device, knobs, bs, cache_dtype, qps, splits):
    # ragged lengths: a padding sequence (0 keys), one shorter than a page, one over several pages
    knobs(num_splits=splits, min_split_tokens=16)
    args, kwargs = make_problem(kernel_device, lens=[300, 0, qps + 5, 129], qps=qps, bs=bs, cache_dtype=cache_dtype)
    if splits is not None:
        assert launch_of(args, kwargs).num_splits == splits
    out, lse = call_triton(args, kwargs)
    check(args, kwargs, out, lse)
    errors.check_errors()   # good metadata sets no error bit


@pytest.mark.parametrize("bs,splits", [(16, 3), (64, None)])
def test_sm90_tiles(kernel_device, knobs, bs, splits):
    # the sm_90 plain-cache tiles (`config(..., sm90=True)`: 64 rows x 64 keys, several 16-key
    # pages or one 64-key page per tile), with a tile cut by the split and by the length
    knobs(config={"BLOCK_N": 64, "num_warps": 8, "num_stages": 2}, num_splits=splits, min_split_tokens=16)
    args, kwargs = make_problem(kernel_device, lens=[300, 0, 69, 129], qps=4, bs=bs)
    launch = launch_of(args, kwargs)
    assert "64 query rows x 64-key tiles" in launch.describe
    out, lse = call_triton(args, kwargs)
    check(args, kwargs, out, lse)


def test_config_choices(monkeypatch):
    monkeypatch.setattr(mla_decode, "interpreting", lambda: False)
    wide = mla_decode.config(128, False, sm90=True)
    assert (wide["BLOCK_M"], wide["BLOCK_N"], wide["num_warps"], wide["num_stages"]) == (64, 64, 8, 2)
    assert wide["separate_values_stages"] == 1
    for cfg in (mla_decode.config(128, False), mla_decode.config(128, False, sm90=True, key_mask=True),
                mla_decode.config(128, False, sm90=True, values_in_keys=False)):
        assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_stages"]) == (64, 16, 3)
    assert mla_decode.config(128, True, sm90=True)["BLOCK_M"] == 32
    assert mla_decode.config(16, False, sm90=True)["BLOCK_N"] == 32


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("qps", [1, 2])
def test_key_mask(kernel_device, knobs, splits, qps):
    # random holes, a row that sees no key, and a mask narrower than the longest sequence
    knobs(num_splits=splits, min_split_tokens=16)
    args, kwargs = make_problem(kernel_device, lens=[70, 9, 40], qps=qps, bs=16)
    key_mask = torch.rand(args[0].shape[0], 60, device=kernel_device) < 0.7
    key_mask[qps] = False
    out, lse = call_triton(args, dict(kwargs, key_mask=key_mask))
    check(args, dict(kwargs, key_mask=key_mask), out, lse)
    assert torch.isinf(lse[qps]).all() and (out[qps].float() == 0).all()


@pytest.mark.parametrize("splits", [1, 3])
def test_lengths_past_the_table_are_clamped(kernel_device, knobs, splits):
    # sequence 0 claims 1000 keys in a table of 4 x 16, sequence 1 claims a negative length
    knobs(num_splits=splits, min_split_tokens=16)
    args, kwargs = make_problem(kernel_device, lens=[64, 20, 33], bs=16, max_blocks=4)
    lens = torch.tensor([1000, -5, 33], dtype=torch.int32, device=kernel_device)
    args = (*args[:4], lens)
    out, lse = call_triton(args, kwargs)
    check(args, kwargs, out, lse)
    with pytest.raises(ValueError, match="seq_lens: length outside"):
        errors.check_errors()


@pytest.mark.parametrize("bad_id,cache_dtype,splits", [(-1, BF16, 1), (10**6, E4M3, 2)])
def test_block_ids_outside_the_cache(kernel_device, knobs, bad_id, cache_dtype, splits):
    """Sequences with an absent block get finite rows; the others are exact (docs/ops.md, Errors)."""
    knobs(num_splits=splits, min_split_tokens=16)
    args, kwargs = make_problem(kernel_device, lens=[70, 40, 16], bs=16, cache_dtype=cache_dtype)
    table = args[3].clone()
    table[0, 1] = bad_id     # among sequence 0's keys 16..31
    table[2, 0] = bad_id     # sequence 2's only block
    args = (*args[:3], table, args[4])
    out, lse = call_triton(args, kwargs)
    assert torch.isfinite(out.float()).all() and not torch.isnan(lse).any()
    good = (args[0][1:2], *args[1:3], table[1:2], args[4][1:2])
    check(good, kwargs, out[1:2], lse[1:2])
    with pytest.raises(ValueError, match="block_tables: block id outside"):
        errors.check_errors()


def test_values_of_their_own_cache(kernel_device, knobs):
    """A `v_cache` that is not `k_cache`'s first dims (same shape and strides, other storage) is read
    on its own, also by a plan made for an aliased call of the same signature."""
    knobs(num_splits=2, min_split_tokens=16)
    args, kwargs = make_problem(kernel_device, lens=[90, 33], cache_dtype=E4M3)
    other, _ = latent_cache(args[1].shape[0], args[1].shape[1], E4M3, kernel_device)
    for v_cache in (args[2], other[..., :DV], args[2]):
        call = (*args[:2], v_cache, *args[3:])
        assert mla_decode.values_in_keys(args[1], v_cache) == (v_cache.data_ptr() == args[1].data_ptr())
        check(call, kwargs, *call_triton(call, kwargs))


@pytest.mark.parametrize("splits", [1, 2])
def test_sinks_fp8_output_fp16_e5m2(kernel_device, knobs, splits):
    knobs(num_splits=splits, min_split_tokens=16)
    args, kwargs = make_problem(kernel_device, lens=[80, 0, 19], qps=2, cache_dtype=E5M2, dtype=FP16)
    kwargs.update(sinks=torch.randn(16, device=kernel_device), out_scale=torch.tensor(0.02, device=kernel_device),
                  scale=1 / math.sqrt(192))
    check(args, kwargs, *call_triton(args, kwargs))


def test_other_value_dims_and_kv_heads(kernel_device, knobs):
    # D = 48 = 32 + 16 over 2 KV heads of 4 query heads (GQA), separate per-head FP8 scales
    knobs(num_splits=2, min_split_tokens=16)
    k_cache, _ = latent_cache(12, 4, E4M3, kernel_device, d=48)
    k_cache = k_cache.expand(12, 4, 2, 48).contiguous()
    k_scale, v_scale = (torch.tensor(s, device=kernel_device) for s in ([0.02, 0.03], [0.05, 0.04]))
    table = torch.randperm(12).view(2, 6).to(kernel_device, torch.int32)
    args = (torch.randn(4, 8, 48, dtype=BF16, device=kernel_device), k_cache, k_cache[..., :32], table,
            torch.tensor([21, 7], dtype=torch.int32, device=kernel_device))
    kwargs = dict(k_scale=k_scale, v_scale=v_scale)
    check(args, kwargs, *call_triton(args, kwargs))


def test_one_page_per_sequence(kernel_device, knobs):
    # a single-column table (a static cache per sequence): 300-token pages, every tile in one page
    knobs(num_splits=2, min_split_tokens=16)
    args, kwargs = make_problem(kernel_device, lens=[300, 0, 41], qps=2, bs=300, max_blocks=1)
    check(args, kwargs, *call_triton(args, kwargs))


def test_empty_block_table(kernel_device):
    # no table columns: every length clamps to 0
    args, kwargs = make_problem(kernel_device, lens=[0, 0])
    args = (*args[:3], args[3][:, :0], torch.tensor([5, 0], dtype=torch.int32, device=kernel_device))
    check(args, kwargs, *call_triton(args, kwargs))


def test_split_count_and_workspace_follow_shapes_only(kernel_device):
    """The grid and the split-K workspace come from shapes (the table's width), never from the
    lengths: one plan serves every step of a CUDA graph."""
    args, kwargs = make_problem(kernel_device, lens=[4000, 1], bs=64, max_blocks=64)
    launch = launch_of(args, kwargs)
    shorter = launch_of((*args[:4], torch.tensor([1, 1], dtype=torch.int32, device=kernel_device)), kwargs)
    assert launch.num_splits == shorter.num_splits > 1
    assert [k.grid for k in launch.kernels] == [k.grid for k in shorter.kernels]


def test_unsupported_reasons(kernel_device):
    args, kwargs = make_problem(kernel_device, lens=[5], cache_dtype=E4M3)
    assert pd.unsupported(*args, **kwargs) == []
    q, k, _, bt, sl = args
    reasons = {
        "value head dim D_v = 500": pd.unsupported(q, k, k[..., :500], bt, sl, **kwargs),
        "ALiBi": pd.unsupported(*args, alibi_slopes=torch.ones(16), **kwargs),
        "sliding windows": pd.unsupported(*args, window_left=8, **kwargs),
        "soft-capping": pd.unsupported(*args, softcap=5.0, **kwargs),
        "value head dim of its own": decode_sm90.problem_reasons(*args, **kwargs),
    }
    for fragment, why in reasons.items():
        assert any(fragment in w for w in why), (fragment, why)
    k128 = torch.zeros(4, 16, 1, 128, dtype=BF16, device=kernel_device)   # a head dim the CUDA kernel is built for
    why = decode_sm90.problem_reasons(torch.zeros(1, 16, 128, dtype=BF16, device=kernel_device), k128, k128[..., :64], bt, sl)
    assert why == ["a value head dim of its own (D_v = 64, D = 128) is not implemented"], why
    with torch_ops.use_backend("triton"), pytest.raises(ValueError, match="soft-capping"):
        torch.ops.attn.paged_decode(*args, softcap=5.0, **kwargs)


# ---- the contract: validation and the fakes ------------------------------------------------------


def _small():
    """A small latent-cache call on CPU: D = 48 = 32 + 16, 4 heads, 2 tokens per sequence, FP8."""
    k, _ = latent_cache(8, 4, E4M3, "cpu", d=48)
    s = torch.tensor(0.02)
    return ((torch.randn(4, 4, 48, dtype=BF16), k, k[..., :32], torch.randperm(8).view(2, 4).int(),
             torch.tensor([9, 3], dtype=torch.int32)), {"k_scale": s, "v_scale": s})


def _edit(i, fn):
    return lambda args, kwargs: (tuple(fn(a) if j == i else a for j, a in enumerate(args)), kwargs)


def _kw(name, value):
    return lambda args, kwargs: (args, {**kwargs, name: value})


BAD = [
    ("v_cache blocks", _edit(2, lambda v: v[:-1]), ValueError, "v_cache shape (7, 4, 1, 32) must equal k_cache shape"),
    ("v_cache tokens", _edit(2, lambda v: v[:, :2]), ValueError, "v_cache shape (8, 2, 1, 32) must equal k_cache"),
    ("v_cache dtype", _edit(2, lambda v: v.view(torch.int8)), TypeError, "v_cache dtype torch.int8 must equal"),
    ("v_cache strides", _edit(2, lambda v: v.repeat(1, 1, 1, 2)[..., ::2]), ValueError,
     "v_cache must have a contiguous last dim"),
    ("v_cache rank", _edit(2, lambda v: v[0]), ValueError, "v_cache must be 4-D"),
    ("int8 cache", lambda a, k: ((a[0], a[1].view(torch.int8), a[2].view(torch.int8), *a[3:]),
                                 {"k_scale": torch.ones(8, 4, 1, 6), "v_scale": torch.ones(8, 4, 1, 6)}),
     ValueError, "v_cache head dim (32) must equal k_cache head dim (48) in INT8 caches"),
    ("query head dim", _edit(0, lambda q: q[..., :40]), ValueError, "k_cache last dim must be 40"),
    ("query dtype", _edit(0, lambda q: q.float()), TypeError, "query must have dtype in (float16, bfloat16)"),
    ("query tokens", _edit(0, lambda q: q[:3]), ValueError, "query tokens (3) must be B * q_per_seq"),
    ("too many tokens", _edit(0, lambda q: q.repeat(5, 1, 1)), ValueError, "q_per_seq in 1..8"),
    ("missing v_scale", _kw("v_scale", None), ValueError, "v_scale is required for a fp8 KV cache"),
    ("k_scale shape", _kw("k_scale", torch.ones(2)), ValueError, "k_scale must be 0-d or [1] (per head)"),
    ("k_scale dtype", _kw("k_scale", torch.tensor(1.0, dtype=torch.float64)), TypeError, "k_scale must have dtype"),
    ("block_tables rows", _edit(3, lambda t: t[:1]), ValueError, "block_tables must have one row per sequence"),
    ("seq_lens dtype", _edit(4, lambda s: s.float()), TypeError, "seq_lens must have dtype"),
]


@pytest.mark.parametrize("edit,error,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_raises(edit, error, match):
    args, kwargs = edit(*_small())
    with pytest.raises(error, match=re.escape(match)):
        torch.ops.attn.paged_decode(*args, **kwargs)


def test_out_buffers_have_the_value_head_dim():
    args, kwargs = _small()
    out, lse = torch.empty(4, 4, 48, dtype=BF16), torch.empty(4, 4)
    with pytest.raises(ValueError, match=r"out must have shape \(4, 4, 32\)"):
        torch.ops.attn.paged_decode.out(*args, **kwargs, out=out, lse=lse)


def test_fake_shapes_and_trace_time_checks():
    args, kwargs = _small()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(a) for a in args]
        fake[2] = fake[1][..., :32]
        out, lse = torch.ops.attn.paged_decode(*fake, **kwargs)
        assert (out.shape, out.dtype, lse.shape, lse.dtype) == ((4, 4, 32), BF16, (4, 4), torch.float32)
        out8, _ = torch.ops.attn.paged_decode(*fake, **kwargs, out_scale=torch.tensor(0.1))
        assert out8.shape == (4, 4, 32) and out8.dtype == E4M3
        with pytest.raises(ValueError, match="v_cache shape"):
            torch.ops.attn.paged_decode(*fake[:2], fake[2][:-1], *fake[3:], **kwargs)
    meta = [a.to("meta") for a in args]
    out, lse = torch.ops.attn.paged_decode(*meta, **{k: v.to("meta") for k, v in kwargs.items()})
    assert out.shape == (4, 4, 32) and out.device.type == "meta" and lse.shape == (4, 4)


def test_reference_reads_values_as_the_keys_first_dims():
    """The oracle on a latent cache equals attention over dense keys and their first D_v dims."""
    args, kwargs = _small()
    q, k, v, bt, sl = args
    out, lse = reference.paged_decode(*args, **kwargs, compute_dtype=torch.float64)
    dense = quant.dequantize_fp8(k, kwargs["k_scale"], torch.float64)
    for b in range(2):
        keys = dense[bt[b].long()].flatten(0, 1)[:sl[b]]
        o, l = reference.attend(q[2 * b:2 * b + 2], keys, keys[..., :32], torch.arange(sl[b] - 2, sl[b]),
                                causal=True, compute_dtype=torch.float64)
        assert max_error(out[2 * b:2 * b + 2], o) < 1e-12 and max_error(lse[2 * b:2 * b + 2], l) < 1e-12


# ---- GPU: DeepSeek-V3-sized problems (run on the GPU machine: pytest -m gpu) -----------------------


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [BF16, E4M3], ids=["bf16", "fp8"])
@pytest.mark.parametrize("batch,qps", [(1, 1), (1, 4), (16, 1), (64, 2)])
@pytest.mark.parametrize("bs", [1, 16, 64])
def test_deepseek_shapes_gpu(kernel_device, cache_dtype, batch, qps, bs):
    # Hq = 128 absorbed heads, contexts up to 4096 keys (ragged, one padding sequence)
    lens = [4096] + [max(qps, (4096 * (i + 1)) // batch - 7 * i) for i in range(batch - 1)]
    if batch > 2:
        lens[1] = 0
    args, kwargs = make_problem(kernel_device, lens=lens, hq=128, qps=qps, bs=bs, cache_dtype=cache_dtype)
    kwargs["scale"] = 1 / math.sqrt(192)
    check(args, kwargs, *call_triton(args, kwargs))
    errors.check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [BF16, E4M3], ids=["bf16", "fp8"])
def test_cuda_graph_replay_gpu(kernel_device, cache_dtype):
    # the table holds every step's keys: a length past a sequence's blocks would read absent ones
    args, kwargs = make_problem(kernel_device, lens=[4096, 1900, 5, 77], hq=128, qps=2, bs=64,
                                cache_dtype=cache_dtype, max_blocks=64)
    q, k_cache, v_cache, table, seq_lens = args
    out = torch.empty(*q.shape[:2], DV, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:2], device=q.device)
    call_triton(args, kwargs)   # plans the signature and allocates the error flag outside the capture

    def call():
        with torch_ops.use_backend("triton"):
            torch.ops.attn.paged_decode.out(*args, out=out, lse=lse, **kwargs)

    def fill(step):
        q.copy_(torch.randn_like(q))
        seq_lens.copy_(torch.tensor([4096 - step, 1000 + 300 * step, 3 - step, 77], dtype=torch.int32))   # 0 at step 3

    assert_replays_match_eager(call, fill, (out, lse), lambda o, l: check(args, kwargs, o, l))
