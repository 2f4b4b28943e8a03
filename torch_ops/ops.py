"""Every `attn::` schema and its fake (meta) implementation; nothing else.

The real implementations are registered by `torch_ops.backends`. `docs/ops.md` documents the
semantics; `tests/torch_ops/test_schemas.py` pins these strings.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from . import checks

LIB = torch.library.Library("attn", "DEF")

_COMMON = (
    "float? scale=None, float q_scaling=1.0, Tensor? alibi_slopes=None, int window_left=-1, "
    "int sink_tokens=0, Tensor? sinks=None, float softcap=0.0, Tensor? out_scale=None"
)
_KV_SCALES = "Tensor? k_scale=None, Tensor? v_scale=None"
_OUT = "Tensor(a!) out, Tensor(b!) lse"

# name -> (positional arguments, keyword-only arguments); attention ops get a functional
# overload returning (out, lse) and an `.out` overload writing into caller buffers.
ATTENTION_OPS = {
    "paged_decode": (
        "Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens",
        f"{_COMMON}, {_KV_SCALES}, Tensor? key_mask=None",
    ),
    "paged_prefill": (
        "Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor cu_seqlens_q, "
        "Tensor seq_lens",
        f"bool causal=True, {_COMMON}, {_KV_SCALES}, Tensor? key_mask=None",
    ),
    "context_attention": (
        "Tensor query, Tensor key, Tensor value, Tensor cu_seqlens_q, Tensor cu_seqlens_k",
        f"bool causal=False, {_COMMON}, Tensor? q_scale=None, {_KV_SCALES}, ScalarType? out_dtype=None, "
        "Tensor? positions=None, Tensor? cos_sin_cache=None, bool rope_neox=True, Tensor? key_mask=None",
    ),
    "merge_states": ("Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b", ""),
}

SCHEMAS = {}
for _name, (_args, _kwargs) in ATTENTION_OPS.items():
    _kw = f", *, {_kwargs}" if _kwargs else ""
    SCHEMAS[_name] = f"{_name}({_args}{_kw}) -> (Tensor out, Tensor lse)"
    _kw_out = f", *, {_kwargs}, {_OUT}" if _kwargs else f", *, {_OUT}"
    SCHEMAS[f"{_name}.out"] = f"{_name}.out({_args}{_kw_out}) -> ()"

SCHEMAS["kv_cache_write"] = (
    "kv_cache_write(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
    "Tensor slot_mapping, *, Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None, "
    "Tensor? query=None, Tensor? positions=None, Tensor? cos_sin_cache=None, bool rope_neox=True) "
    "-> Tensor"
)
SCHEMAS["cache_attention"] = (
    "cache_attention(Tensor query, Tensor current_key, Tensor current_value, Tensor seqstarts, "
    "Tensor kvstarts, Tensor cachestarts, Tensor start_pos, Tensor decoding_batches, "
    "SymInt max_seqlen, SymInt max_kvlen, Tensor(a!) cache, Tensor(b!)? scale=None, "
    "Tensor? attn_mask=None, *, int num_heads, int head_dim, bool is_causal=True, "
    "bool is_alibi=False, int num_kv_heads=0, int num_layer=1, int layer_idx=0, int quant_bit=0, "
    "int quant_group=8, int cache_mode=0, int cache_layout=0, int page_size=128) -> Tensor"
)

for _schema in SCHEMAS.values():
    LIB.define(_schema)


def with_schema_defaults(qualname: str, fn):
    """Wrap `fn` so it always receives every schema argument: positional ones positionally,
    keyword-only ones by keyword, omitted ones at their defaults (the dispatcher passes only
    what the caller gave)."""
    name, _, overload = qualname.partition(".")
    schema = getattr(getattr(torch.ops.attn, name), overload or "default")._schema
    positional = [a for a in schema.arguments if not a.kwarg_only]
    keyword = [a for a in schema.arguments if a.kwarg_only]

    def wrapper(*args, **kwargs):
        args = list(args) + [a.default_value for a in positional[len(args):]]
        full_kwargs = {a.name: kwargs[a.name] if a.name in kwargs else a.default_value for a in keyword}
        return fn(*args, **full_kwargs)

    return wrapper


def attention_output_dtype(query: torch.Tensor, out_scale, out_dtype=None) -> torch.dtype:
    """The dtype of an attention op's `out`: FP8 with `out_scale`, else `out_dtype` or the query's
    (bf16 for FP8 queries)."""
    if out_scale is not None:
        return torch.float8_e4m3fn
    if out_dtype is not None:
        return out_dtype
    return torch.bfloat16 if query.dtype == torch.float8_e4m3fn else query.dtype


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The standard ALiBi slopes (Press et al.) that `cache_attention(is_alibi=True)` uses: fp32
    `[num_heads]`, the geometric sequence of the largest power of two of heads, then every other
    slope of the sequence for twice that many."""
    n = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]
    slopes += [2.0 ** (-4.0 * (2 * i + 1) / n) for i in range(num_heads - n)]
    return torch.tensor(slopes, dtype=torch.float32)


def _paged_output_spec(query, k_cache, v_cache, *args, out_scale=None, **kwargs):
    return query, checks.paged_value_dim(query, k_cache, v_cache), attention_output_dtype(query, out_scale)


def _context_output_spec(query, key, value, *args, out_scale=None, out_dtype=None, **kwargs):
    return query, value.shape[-1], attention_output_dtype(query, out_scale, out_dtype)


def _merge_output_spec(out_a, *args):
    return out_a, out_a.shape[-1], out_a.dtype


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """How the fronts treat an op: `check(*args, **kwargs)` validates it (metadata only);
    attention ops have `output_spec(*args, **kwargs) -> (query, value_dim, out_dtype)`, which
    gives `out [T, Hq, value_dim]` and `lse [T, Hq]`. `bucketed` names integer arguments that
    change from call to call (e.g. a growing max length) and that a launch may read only as an
    upper bound: calls are planned, and replayed, per power-of-two `bucket` of their value."""

    check: Callable
    output_spec: Callable | None = None
    bucketed: tuple[str, ...] = ()

    def new_outputs(self, args, kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        query, value_dim, out_dtype = self.output_spec(*args, **kwargs)
        t, hq = query.shape[0], query.shape[1]
        return (query.new_empty((t, hq, value_dim), dtype=out_dtype),
                query.new_empty((t, hq), dtype=torch.float32))

    def check_outputs(self, args, kwargs, out, lse) -> None:
        query, value_dim, out_dtype = self.output_spec(*args, **kwargs)
        t, hq = query.shape[0], query.shape[1]
        checks.check_out_buffers(out, lse, (t, hq, value_dim), out_dtype, (t, hq), query.device)


SPECS = {
    "paged_decode": OpSpec(checks.check_paged_decode, _paged_output_spec),
    "paged_prefill": OpSpec(checks.check_paged_prefill, _paged_output_spec),
    "context_attention": OpSpec(checks.check_context_attention, _context_output_spec),
    "merge_states": OpSpec(checks.check_merge_states, _merge_output_spec),
    "kv_cache_write": OpSpec(checks.check_kv_cache_write),
    "cache_attention": OpSpec(checks.check_cache_attention, bucketed=("max_kvlen",)),
}


def bucket(value: int) -> int:
    """The power of two a positive `value` rounds up to (other values stand for themselves)."""
    return 1 << (value - 1).bit_length() if value > 0 else value


def _attention_fakes(spec: OpSpec):
    def functional(*args, **kwargs):
        spec.check(*args, **kwargs)
        return spec.new_outputs(args, kwargs)

    def with_out(*args, out, lse, **kwargs):
        spec.check(*args, **kwargs)
        spec.check_outputs(args, kwargs, out, lse)

    return functional, with_out


def _kv_cache_write_fake(key, value, k_cache, v_cache, slot_mapping, **kwargs):
    checks.check_kv_cache_write(key, value, k_cache, v_cache, slot_mapping, **kwargs)
    query = kwargs["query"]
    return torch.empty_like(query) if query is not None else key.new_empty(0)


def _cache_attention_fake(*args, **kwargs):
    checks.check_cache_attention(*args, **kwargs)
    return torch.empty_like(args[0])


for _name in ATTENTION_OPS:
    _functional, _with_out = _attention_fakes(SPECS[_name])
    torch.library.register_fake(f"attn::{_name}", with_schema_defaults(_name, _functional), lib=LIB)
    torch.library.register_fake(f"attn::{_name}.out", with_schema_defaults(f"{_name}.out", _with_out), lib=LIB)
torch.library.register_fake("attn::kv_cache_write", with_schema_defaults("kv_cache_write", _kv_cache_write_fake), lib=LIB)
torch.library.register_fake("attn::cache_attention", with_schema_defaults("cache_attention", _cache_attention_fake), lib=LIB)
