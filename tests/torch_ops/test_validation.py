"""Bad input gets a ValueError/TypeError naming the argument, eagerly and at trace time; the
data-dependent checks run under ATTN_DEBUG=1."""

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_ops
from torch_ops import reference
from torch_ops.testing import assert_error_ratio

from . import samples


def _set(index_or_name, value):
    """An edit of a sample's (args, kwargs): replace a positional argument or a keyword."""

    def edit(args, kwargs):
        args = list(args)
        if isinstance(index_or_name, int):
            args[index_or_name] = value(args[index_or_name]) if callable(value) else value
        else:
            kwargs = {**kwargs, index_or_name: value(kwargs.get(index_or_name)) if callable(value) else value}
        return tuple(args), kwargs

    return edit


def _both(i, j, value):
    """The same edit applied to two positional arguments (k and v caches, key and value)."""
    return lambda args, kwargs: _set(j, value)(*_set(i, value)(args, kwargs))


# (op, variant, edit, error, message fragment)
BAD = [
    # dtypes
    ("paged_decode", "gqa", _set(0, lambda q: q.to(torch.int32)), TypeError, "query must have dtype"),
    ("paged_decode", "gqa", _set(0, lambda q: q.float()), TypeError, "query must have dtype"),
    ("paged_decode", "gqa", _set(1, lambda k: k.half()), TypeError, "v_cache dtype"),
    ("paged_decode", "gqa", _set(4, lambda s: s.float()), TypeError, "seq_lens must have dtype"),
    ("context_attention", "causal", _set(1, lambda k: k.float()), TypeError, "share one dtype"),
    ("kv_cache_write", "bf16", _both(2, 3, lambda c: c.to(torch.int16)), TypeError, "KV cache dtype"),
    # devices
    ("paged_decode", "gqa", _set(3, lambda t: t.to("meta")), ValueError, "block_tables must be on cpu"),
    ("context_attention", "causal", _set(4, lambda t: t.to("meta")), ValueError, "cu_seqlens_k must be on cpu"),
    # head counts and head dims
    ("paged_decode", "gqa", _set(0, lambda q: q[:, :3].contiguous()), ValueError, "multiple of the KV heads"),
    ("context_attention", "causal", _set(0, lambda q: q[:, :3].contiguous()), ValueError, "multiple of the KV heads"),
    ("paged_decode", "gqa", _set(0, lambda q: q[..., :8].contiguous()), ValueError, "k_cache last dim must be 8"),
    ("context_attention", "causal", _both(1, 2, lambda k: k[..., :8].contiguous()), ValueError, "key head dim"),
    ("context_attention", "mla", _set(2, lambda v: v[:-1]), ValueError, "value must be [Tk, Hkv, D_v] = [10, 2, D_v > 0]"),
    ("paged_prefill", "mla", _set(2, lambda v: v[:-1]), ValueError, "v_cache shape (31, 4, 2, 8) must equal k_cache"),
    ("paged_prefill", "int4", _set(2, lambda v: v[..., :2].contiguous()), ValueError,
     "v_cache head dim (2) must equal k_cache head dim (8) in INT4 caches"),
    ("paged_decode", "gqa", _set(2, lambda v: v[:-1]), ValueError, "v_cache shape (15, 4, 2, 16) must equal k_cache"),
    # block tables and metadata
    ("paged_decode", "gqa", _set(3, lambda t: t[0]), ValueError, "block_tables must be 2-D"),
    ("paged_decode", "gqa", _set(3, lambda t: t[:2]), ValueError, "block_tables must have one row per sequence"),
    ("paged_decode", "gqa", _set(0, lambda q: q[:2]), ValueError, "query tokens"),
    ("paged_prefill", "mixed", _set(4, lambda c: c[:-1]), ValueError, "cu_seqlens_q must have shape"),
    ("context_attention", "causal", _set(4, lambda c: c[:-1]), ValueError, "cu_seqlens_k must have shape"),
    ("kv_cache_write", "bf16", _set(4, lambda s: s[:-1]), ValueError, "slot_mapping must have shape"),
    # layouts
    ("paged_decode", "gqa", _set(1, lambda k: k.transpose(1, 3)), ValueError, "k_cache"),
    ("paged_decode", "gqa", _set(1, lambda k: k.repeat(1, 1, 1, 2)[..., ::2]), ValueError, "contiguous last dim"),
    ("paged_prefill", "mixed", _both(1, 2, lambda k: k.repeat(1, 65, 1, 1)), ValueError, "block_size"),
    ("cache_attention", "offset", _set("cache_layout", 5), ValueError, "cache_layout must be one of"),
    ("cache_attention", "offset", _set(10, lambda c: c.transpose(0, 1)), ValueError, "cache must be"),
    # scales
    ("paged_decode", "fp8", _set("k_scale", torch.ones(3)), ValueError, "k_scale must be 0-d or [2]"),
    ("paged_decode", "fp8", _set("v_scale", None), ValueError, "v_scale is required"),
    ("paged_decode", "fp8", _set("k_scale", lambda s: s.double()), TypeError, "k_scale must have dtype"),
    ("paged_decode", "int8", _set("k_scale", lambda s: s[..., :1].repeat(1, 1, 1, 3)), ValueError, "G dividing"),
    ("paged_decode", "gqa", _set("k_scale", torch.ones(())), ValueError, "only for FP8/INT8/INT4"),
    ("context_attention", "fp8", _set("q_scale", None), ValueError, "q_scale is required"),
    ("context_attention", "causal", _set("q_scale", torch.ones(())), ValueError, "only for float8_e4m3fn"),
    ("paged_decode", "gqa", _set("out_scale", torch.ones(2)), ValueError, "out_scale must be a 0-d"),
    ("cache_attention", "int8", _set(11, None), ValueError, "scale is required"),
    ("cache_attention", "int8", _set("quant_group", 6), ValueError, "quant_group (6) must divide"),
    ("cache_attention", "int8", _set(11, lambda s: s[..., :1]), ValueError, "scale must have the cache's layout"),
    # options
    ("paged_decode", "gqa", _set("window_left", -2), ValueError, "window_left"),
    ("paged_decode", "gqa", _set("softcap", -1.0), ValueError, "softcap"),
    ("paged_decode", "gqa", _set("alibi_slopes", torch.ones(3)), ValueError, "alibi_slopes must have shape"),
    ("paged_decode", "gqa", _set("sinks", torch.ones(4, dtype=torch.float16)), TypeError, "sinks must have dtype"),
    ("paged_decode", "gqa", _set("scale", 0.0), ValueError, "scale must be finite and > 0"),
    ("paged_decode", "gqa", _set("scale", math.inf), ValueError, "scale must be finite and > 0"),
    ("paged_decode", "gqa", _set("scale", math.nan), ValueError, "scale must be finite and > 0"),
    ("paged_decode", "gqa", _set("scale", -0.5), ValueError, "scale must be finite and > 0"),
    ("paged_decode", "gqa", _set("q_scaling", math.nan), ValueError, "q_scaling must be finite"),
    ("context_attention", "causal", _set("softcap", math.inf), ValueError, "softcap must be finite"),
    ("paged_prefill", "mixed", _set("softcap", math.nan), ValueError, "softcap must be finite"),
    ("context_attention", "causal", _set("out_dtype", torch.int8), TypeError, "out_dtype"),
    ("kv_cache_write", "rope", _set("positions", None), ValueError, "RoPE needs both"),
    ("kv_cache_write", "rope", _set("cos_sin_cache", lambda c: c[:, :3]), ValueError, "rotary_dim"),
    ("merge_states", "plain", _set(1, lambda l: l.double()), TypeError, "lse_a must have dtype"),
    ("merge_states", "plain", _set(2, lambda o: o[:, :2]), ValueError, "out_b"),
    ("cache_attention", "offset", _set("num_kv_heads", 3), ValueError, "multiple of num_kv_heads"),
    ("cache_attention", "offset", _set("layer_idx", 2), ValueError, "layer_idx must be in"),
    ("cache_attention", "offset", _set(7, torch.tensor([0.5])), TypeError, "decoding_batches"),
    ("cache_attention", "offset", _set(1, lambda k: k[:-1]), ValueError, "current_key must be"),
    ("cache_attention", "offset", _set(4, lambda k: k[:-1]), ValueError, "kvstarts must have shape"),
    ("cache_attention", "offset", _set(5, lambda c: c.view(3, 1)), ValueError, "cachestarts must be 1-D"),
    ("cache_attention", "paged", _set(5, lambda c: c[:2]), ValueError, "cachestarts must be [B, MaxP]"),
    ("cache_attention", "offset", _set(10, lambda c: c.float()), TypeError, "cache dtype"),
    ("cache_attention", "int8", _set(10, lambda c: c.view(torch.uint8)), TypeError, "cache must have dtype"),
    ("cache_attention", "offset", _set(11, torch.ones(1)), ValueError, "scale is only for quantized caches"),
    ("cache_attention", "int4", _set("quant_group", 1), ValueError, "INT4 needs an even quant_group"),
    ("cache_attention", "int4", _set(12, lambda m: m[:-1]), ValueError, "attn_mask must be"),
    # 1-D metadata is read as consecutive elements
    ("paged_decode", "gqa", _set(4, lambda s: s.repeat_interleave(2)[::2]), ValueError, "seq_lens must be contiguous"),
    ("context_attention", "causal", _set(3, lambda c: c.repeat_interleave(2)[::2]), ValueError,
     "cu_seqlens_q must be contiguous"),
    ("kv_cache_write", "bf16", _set(4, lambda s: s.repeat_interleave(2)[::2]), ValueError,
     "slot_mapping must be contiguous"),
]


def test_paged_decode_takes_any_block_size(kernel_device):
    """One page per sequence (a static cache) needs pages longer than 256 tokens: the Triton
    kernel reads them like any other (here through the interpreter on CPU)."""
    args, kwargs = samples.sample("paged_decode", "gqa")
    q, k, v, bt, sl = (a.to(kernel_device) for a in args)
    long_k, long_v = (c.repeat(1, 65, 1, 1) for c in (k, v))
    sl = sl * 30   # up to 270 keys: past the first 256 of a page
    with torch_ops.use_backend("triton"):
        out, lse = torch.ops.attn.paged_decode(q, long_k, long_v, bt, sl, **kwargs)
    truth = reference.paged_decode(q, long_k, long_v, bt, sl, compute_dtype=torch.float64)
    base = reference.paged_decode(q, long_k, long_v, bt, sl, compute_dtype=q.dtype)
    assert_error_ratio(out, truth[0], base[0])
    assert_error_ratio(lse, truth[1], base[1], name="lse")


@pytest.mark.parametrize("op,variant,edit,error,match", BAD, ids=[f"{b[0]}-{b[4][:30]}" for b in BAD])
def test_bad_input_raises(op, variant, edit, error, match):
    args, kwargs = edit(*samples.sample(op, variant))
    with pytest.raises(error, match=match.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        getattr(torch.ops.attn, op)(*args, **kwargs)


@pytest.mark.parametrize("case", [BAD[0], BAD[8], BAD[23]], ids=["dtype", "heads", "scale"])
def test_bad_input_raises_at_trace_time(case):
    """The fakes run the same checks, so torch.compile reports bad input while tracing."""
    op, variant, edit, error, match = case
    args, kwargs = edit(*samples.sample(op, variant))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        with pytest.raises(error, match=match.split("[")[0]):
            getattr(torch.ops.attn, op)(*fake_args, **kwargs)


@pytest.mark.parametrize("name,bad", [("scale", math.nan), ("softcap", -math.inf), ("q_scaling", 0.0)])
def test_number_options_are_checked_on_every_call(name, bad):
    """Python-number options are part of a call's signature: a planned signature with a good
    value does not let a bad one through, without ATTN_DEBUG."""
    args, kwargs = samples.paged_decode("gqa")
    torch.ops.attn.paged_decode(*args, **kwargs, **{name: 0.5})
    with pytest.raises(ValueError, match=f"{name} must be finite"):
        torch.ops.attn.paged_decode(*args, **kwargs, **{name: bad})


def test_out_buffers_are_checked():
    args, kwargs = samples.paged_decode("gqa")
    out, lse = torch.ops.attn.paged_decode(*args, **kwargs)
    with pytest.raises(ValueError, match="out must have shape"):
        torch.ops.attn.paged_decode.out(*args, **kwargs, out=out[1:], lse=lse)
    with pytest.raises(TypeError, match="out must have dtype"):
        torch.ops.attn.paged_decode.out(*args, **kwargs, out=out.float(), lse=lse)
    with pytest.raises(TypeError, match="lse must have dtype"):
        torch.ops.attn.paged_decode.out(*args, **kwargs, out=out, lse=lse.half())


# Data-dependent checks: silent on the fast path, errors with ATTN_DEBUG=1.
DATA_BAD = [
    ("paged_decode", "gqa", _set(3, lambda t: t + 1000), "block_tables entries"),
    ("paged_decode", "gqa", _set(4, lambda s: s + 100), "seq_lens must be in"),
    ("paged_prefill", "mixed", _set(4, lambda c: c.flip(0)), "cu_seqlens_q must start at 0"),
    ("paged_prefill", "mixed", _set(5, lambda s: s * 0 + 1), "query lengths"),
    ("context_attention", "causal", _set(3, lambda c: c - 1), "cu_seqlens_q must start at 0"),
    ("kv_cache_write", "bf16", _set(4, lambda s: s + 10_000), "slot_mapping entries"),
    ("cache_attention", "offset", _set(6, lambda p: p + 1), "kvstarts must hold start_pos"),
    ("cache_attention", "offset", _set(5, lambda c: c + 40), "cachestarts must address rows"),
    ("cache_attention", "offset", _set(8, 0), "max_seqlen/max_kvlen"),
    ("cache_attention", "offset", _set(3, lambda s: s.flip(0)), "seqstarts must start at 0"),
    ("cache_attention", "offset", _set(7, torch.tensor([2])), "decoding_batches"),
    ("cache_attention", "paged", _set(5, lambda c: c + 1000), "cachestarts must address rows"),
    ("cache_attention", "int4", _set(12, lambda m: m[:, :5]), "attn_mask last dim"),
    ("paged_decode", "int8", _set(4, lambda s: s.clamp(max=1)), "query lengths"),   # 2 new tokens in 1 key
    ("kv_cache_write", "rope", _set("positions", lambda p: p + 32), "positions must be in 0..31"),
    ("kv_cache_write", "int4", _set("positions", lambda p: p - 40), "positions must be in"),
    ("kv_cache_write", "bf16", _set(4, lambda s: torch.cat([s[:1], s[:1], s[2:]])), "must not repeat a slot"),
    ("paged_decode", "fp8", _set("out_scale", torch.tensor(0.0)), "out_scale must be finite and > 0"),
    ("paged_decode", "fp8", _set("out_scale", torch.tensor(-0.05)), "out_scale must be finite and > 0"),
    ("paged_decode", "fp8", _set("out_scale", torch.tensor(math.inf)), "out_scale must be finite and > 0"),
    ("paged_decode", "fp8", _set("out_scale", torch.tensor(math.nan)), "out_scale must be finite and > 0"),
    ("paged_decode", "features", _set("sinks", lambda s: s / 0), "sinks must be finite"),
    ("paged_decode", "features", _set("sinks", lambda s: s.index_fill(0, torch.tensor([2]), math.nan)),
     "sinks must be finite"),
    ("context_attention", "causal", _set("sinks", torch.tensor([0.0, math.nan, 1.0, 2.0])), "sinks must be finite"),
    ("paged_decode", "features", _set("alibi_slopes", lambda a: a.index_fill(0, torch.tensor([0]), math.inf)),
     "alibi_slopes must be finite"),
    ("paged_decode", "fp8", _set("k_scale", lambda s: s.index_fill(0, torch.tensor([1]), math.inf)),
     "k_scale must be finite"),
    ("context_attention", "fp8", _set("q_scale", torch.tensor(math.nan)), "q_scale must be finite"),
    ("kv_cache_write", "fp8", _set("v_scale", torch.tensor(math.inf)), "v_scale must be finite"),
    ("merge_states", "plain", _set(1, lambda lse: lse.clamp(max=math.inf).index_fill(0, torch.tensor([1]), math.inf)),
     "lse_a must be finite or -inf"),
    ("merge_states", "plain", _set(3, lambda lse: lse.index_fill(1, torch.tensor([2]), math.inf)),
     "lse_b must be finite or -inf"),
    ("merge_states", "plain", _set(3, lambda lse: lse.index_fill(0, torch.tensor([4]), math.nan)),
     "lse_b must be finite or -inf"),
    # block ids among the blocks a sequence uses, lengths within the block table
    ("paged_decode", "gqa", _set(3, lambda t: t - 1000), "block_tables entries used by seq_lens must be in 0..15"),
    ("paged_prefill", "int4", _set(3, lambda t: t.index_fill(1, torch.tensor([0]), 32)),
     "block_tables entries used by seq_lens must be in 0..31"),
    ("paged_decode", "mqa", _set(4, lambda s: s.index_fill(0, torch.tensor([1]), -1)), "seq_lens must be in"),
    ("paged_prefill", "mixed", _set(5, lambda s: s.index_fill(0, torch.tensor([3]), 13)),
     "seq_lens must be in 0..max_blocks_per_seq \\* block_size = 0..12"),
    # cu_seqlens start at 0, never decrease, end at T
    ("paged_prefill", "mixed", _set(4, lambda c: torch.cat([c[:-1], c[-1:] + 1])), "cu_seqlens_q must start at 0, "
     "never decrease and end at 10"),
    ("paged_prefill", "mixed", _set(4, lambda c: c.index_fill(0, torch.tensor([2]), 0)), "cu_seqlens_q must"),
    ("context_attention", "cross", _set(4, lambda c: torch.cat([c[:-1], c[-1:] + 2])), "cu_seqlens_k must start at 0, "
     "never decrease and end at 11"),
    ("context_attention", "mqa", _set(4, lambda c: c.index_fill(0, torch.tensor([2]), 1)), "cu_seqlens_k must"),
    # cache_attention offsets
    ("cache_attention", "offset", _set(6, lambda p: p - 3), "start_pos must be >= 0"),
    ("cache_attention", "paged", _set(4, lambda k: k.flip(0)), "kvstarts must start at 0"),
    ("cache_attention", "offset", _set(3, lambda s: s + 1), "seqstarts must start at 0"),
    ("cache_attention", "offset", _set(5, lambda c: c - 1), "cachestarts must address rows"),
    ("cache_attention", "int8", _set(5, lambda c: c[:, :1]), "exceed MaxP \\* page_size = 4"),
    ("cache_attention", "int8", _set(5, lambda c: c.index_fill(1, torch.tensor([0]), -4)),
     "cachestarts must address rows"),
]


@pytest.mark.parametrize("op,variant,edit,match", DATA_BAD, ids=[d[3][:30] for d in DATA_BAD])
def test_data_checks_under_attn_debug(op, variant, edit, match, monkeypatch):
    args, kwargs = edit(*samples.sample(op, variant))
    monkeypatch.setenv("ATTN_DEBUG", "1")
    with pytest.raises(ValueError, match=match):
        getattr(torch.ops.attn, op)(*args, **kwargs)
