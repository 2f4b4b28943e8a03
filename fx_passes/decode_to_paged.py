"""Rewrite a decode step's attention, one query over a `[B, H, S, D]` KV cache, onto
`torch.ops.attn.paged_decode`, which reads the cache in place.

Recognized, in Dynamo's torch-level graph: `F.scaled_dot_product_attention(q [B, Hq, 1, D],
k, v [B, Hkv, S, D], attn_mask=..., scale=...)` with k/v repeated to Hq heads (Hugging Face's
`repeat_kv`, `repeat_interleave`, MQA `expand`) or passed with `enable_gqa`, no dropout, and a
mask that is absent (all S keys), a bool mask that `index_mask.is_key_prefix` proves keeps the
same prefix of the keys in every row, of a length known only at run time (what Hugging Face
builds inside the graph for a `StaticCache` decode step, `arange(S_max) <= arange(1) +
cumulative_length`), or any other bool mask shared by the heads (a graph input, as
`generate()` passes it: left padding included). The cache becomes one page per sequence
(`k.transpose(1, 2)`, block table `arange(B)[:, None]`); with a prefix, the length is the number
of true keys of the mask's first row (an `[S]` reduction); with another mask, each sequence's
length is its last true key + 1 and the mask goes to the op as `key_mask`. When the
batch (and, without a mask, the cache length) is static, the block table (and the lengths) are
made once at the start of the graph (`arange`, `full`) and shared by every layer.

Why: stock compile runs SDPA over k/v that `repeat_kv` has copied to Hq heads (the whole cache
per layer and step, read and written), with a masked SDPA kernel on top; `paged_decode` reads
each KV head once for its group of query heads and stops at the length.

Declined, with the reason logged at DEBUG on logger `fx_passes`: `is_causal=True` (top-left:
the one query would see key 0 only), float masks other than graph inputs and masks that differ
between heads, dropout, query dtypes other than fp16/bf16 or other op rejections, autograd.
Queries of more than one token are left to `sdpa_to_attn`.

Also recognized: the matmul-softmax-matmul spellings that `sdpa_to_attn.match_matmul` reads
(Hugging Face's eager attention: Gemma 2's soft-cap, gpt-oss's learned sinks, BLOOM's `bmm` over
`[B*H, S, D]` views) with one query over the cache, and either no mask or one that goes to the
op as `key_mask`: a float mask from a graph input (as `generate()` passes it to eager attention,
see `replacements.key_mask_of`) or a bool one shared by the heads (BLOOM's, built in the graph);
soft-cap, sinks and ALiBi slopes go to the op, ALiBi positions from a padding mask to a device
check (`replacements.check_alibi`; the op measures `|p - k|` from the last visible key). Declined
there: causal masks.

Values may have a head dim of their own, `v [B, Hkv, S, D_v]` (MLA over decompressed keys and
values, DeepSeek-V3's decode in Hugging Face: `D = qk_nope + qk_rope`, `D_v = v_head_dim`).

At the edge: a length of 0 (an all-false mask row) gives zeros where SDPA gives NaN.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from . import alibi, index_mask, sdpa_to_attn
from .masks import check_mask_shape, is_head_shared_bool, is_input_mask
from .replacements import paged_decode_bhsd
from .sdpa_to_attn import is_scalar_node, unrepeat
from .torch_ir import Decline, call, declined, erase_unused, insert_call, is_tensor, known_equal, shared_node, value

log = logging.getLogger(__name__)

NAME = "decode_to_paged"


def apply(graph: fx.Graph) -> int:
    """Rewrite every one-query SDPA over a cache that `paged_decode` can serve; returns how many."""
    rewritten = 0
    for node in list(graph.nodes):
        c = call(node)
        try:
            if c is not None and c.name == "scaled_dot_product_attention" and _is_decode(c):
                args, kwargs, dead = _match(node, c)
                terms = kwargs.pop("alibi_terms", None)
                q = value(args[0])
                example = _example_output(args, {**kwargs, "alibi_slopes": alibi.example_slopes(q, terms)})
                if terms:
                    kwargs["alibi_slopes"] = alibi.slopes_node(graph, node, terms, q.shape[1], q.device)
            elif c is not None and c.name in ("matmul", "bmm") and _is_decode(c) \
                    and (attention := sdpa_to_attn.match_matmul(node, c, decode=True)) is not None:
                args, kwargs, dead, example = _match_eager(attention)
                kwargs.update(q_factor=sdpa_to_attn.q_factor_node(graph, attention),
                              alibi_slopes=sdpa_to_attn.slopes_node(graph, attention))
            else:
                continue
        except Decline as reason:
            declined(log, NAME, node, reason)
            continue
        kwargs.update(_static_tables(graph, args))
        if kwargs.get("key_mask"):
            args = (*args[:3], sdpa_to_attn.key_mask_node(graph, args[3], node))
            positions = kwargs.get("alibi_positions")
            if positions is not None and sdpa_to_attn.alibi_checked_before(
                    graph, args[3], positions, (value(args[0]).shape[0], value(args[1]).shape[2])):
                kwargs["alibi_positions"] = None   # an earlier layer checks them
        with graph.inserting_before(node):
            new = graph.call_function(paged_decode_bhsd, args, kwargs)
        new.meta.update(node.meta)
        new.meta["example_value"] = example
        if value(node).dim() == 3:   # bmm over [B*H, S, D] views
            new = insert_call(graph, node, "flatten", (new, 0, 1), method=True)
        node.replace_all_uses_with(new)
        erase_unused(graph, [node, *dead])
        rewritten += 1
    return rewritten


def _is_decode(c) -> bool:
    """One query over more than one key, all 4-D (or 3-D for `bmm`): the query's (or the
    probabilities') second-to-last size is 1, the key's (or value's) is not."""
    if c.name == "scaled_dot_product_attention":
        q, k = c.arg(0, "query"), c.arg(1, "key")
    else:
        q, k = c.input, c.arg(1, "mat2" if c.name == "bmm" else "other")
    if not (is_tensor(q) and is_tensor(k) and value(q).dim() == value(k).dim() == (3 if c.name == "bmm" else 4)):
        return False
    return known_equal(value(q).shape[-2], 1) and not known_equal(value(k).shape[-2], 1)


def _match_eager(a: sdpa_to_attn.Attention) -> tuple[tuple, dict, list[fx.Node], torch.Tensor]:
    """(args, kwargs of `paged_decode_bhsd` without the query factor and slopes, the nodes it
    makes dead, its example output) of an eager-spelled decode attention."""
    args = (a.query, a.key, a.value, a.key_mask)
    kwargs = {"scale": a.scale, "key_mask": a.key_mask is not None, "softcap": a.softcap, "sinks": a.sinks,
              "alibi_positions": a.positions}
    slopes = alibi.example_slopes(value(a.query), a.alibi)
    example = _example_output(args, {**kwargs, "q_factor": sdpa_to_attn.q_factor_value(a), "alibi_slopes": slopes})
    return args, kwargs, a.nodes, example


def _match(node: fx.Node, c) -> tuple[tuple, dict, list[fx.Node]]:
    """(args, kwargs of `paged_decode_bhsd`, the K/V repetition nodes it makes dead)."""
    dropout_p = c.arg(4, "dropout_p", 0.0)
    if not isinstance(dropout_p, (int, float)) or dropout_p != 0:
        raise Decline(f"dropout_p={dropout_p} (only 0 is served)")
    if c.arg(5, "is_causal", False) is not False:
        raise Decline("is_causal=True with one query: SDPA aligns the mask top-left (key 0 only)")
    if value(node).requires_grad:
        raise Decline("autograd records it; attn ops are inference-only (run under torch.no_grad())")
    q, mask = c.arg(0, "query"), c.arg(3, "attn_mask")
    (k, k_reps, k_nodes), (v, v_reps, v_nodes) = unrepeat(c.arg(1, "key")), unrepeat(c.arg(2, "value"))
    if not known_equal(k_reps, v_reps):
        raise Decline(f"key and value are repeated differently ({k_reps} vs {v_reps} times)")
    key_mask, extra = False, {}
    if mask is not None:
        if not is_tensor(mask):
            raise Decline("attn_mask is not a tensor")
        check_mask_shape(mask, (*value(q).shape[:-1], value(k).shape[-2]))
        if not is_input_mask(mask) and (found := alibi.masked_bias(mask, [])) is not None \
                and is_head_shared_bool(found[0]):
            mask, extra = found[0], _alibi(q, k, mask, found[1])   # e.g. Falcon's ALiBi in a padded mask
            key_mask = True
        elif not index_mask.is_key_prefix(mask):
            # any other bool mask (e.g. one built outside the graph, as `generate()` does) is
            # passed to the op row by row; it must be the same for every head
            if not is_head_shared_bool(mask) and not is_input_mask(mask):
                raise Decline(f"attn_mask {mask.name} is neither a bool mask shared by the heads nor a prefix of "
                              "the keys nor a float mask from a graph input shared by the heads")
            key_mask = True
    scale, q_factor = c.arg(6, "scale"), None
    if is_scalar_node(scale):  # known at run time only: it multiplies the query
        scale, q_factor = 1.0, scale
    elif scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise Decline(f"scale {scale} is not a number")
    kwargs = {"scale": None if scale is None else float(scale), "q_factor": q_factor, "key_mask": key_mask, **extra}
    return (q, k, v, mask), kwargs, k_nodes + v_nodes


def _alibi(q: fx.Node, k: fx.Node, mask: fx.Node, terms) -> dict:
    """`alibi_terms` (the per-head slope terms, `alibi.frame_slopes`) and `alibi_positions` of the
    ALiBi `terms` of float mask `mask` on the scores of `q [B, Hq, 1, D]` and `k [B, Hkv, S, D]`."""
    heads = value(q).shape[1]
    if not isinstance(heads, int):
        raise Decline(f"ALiBi with a symbolic number of heads ({heads})")
    slopes = alibi.frame_slopes(terms, value(mask).shape, (*value(q).shape[:-1], value(k).shape[-2]), 1, heads)
    positions = {t.positions.node for t in slopes if t.positions is not None}
    if len(positions) > 1:
        raise Decline("ALiBi biases of two run-time position tensors")
    return {"alibi_terms": slopes, "alibi_positions": next(iter(positions), None)}


def _static_tables(graph: fx.Graph, args: tuple) -> dict:
    """The block table (and, without a mask, the lengths) when the batch (and the cache length)
    are static: made once at the start of the graph for every layer, and computed, not held as
    constants (nothing for Inductor to keep alive beside the graph)."""
    q, k, mask = value(args[0]), value(args[1]), args[3]
    b, s = q.shape[0], k.shape[2]
    if not isinstance(b, int) or b == 0:
        return {}
    on = {"dtype": torch.int32, "device": q.device}
    rows = shared_node(graph, torch.arange, (b,), on)
    tables = {"block_tables": shared_node(graph, "view", (rows, (b, 1)), method=True)}
    if mask is None and isinstance(s, int):
        tables["seq_lens"] = shared_node(graph, torch.full, ((b,), s), on)
    return tables


def _example_output(args, kwargs):
    """The replacement's output on the example values; the op's own checks run here."""
    q = value(args[0])
    values = [value(a) if isinstance(a, fx.Node) else a for a in args]
    try:
        with q.fake_mode:
            return paged_decode_bhsd(*values, **{k: value(v) for k, v in kwargs.items()})
    except (TypeError, ValueError) as e:
        raise Decline(f"attn::paged_decode rejects the inputs: {e}") from e
