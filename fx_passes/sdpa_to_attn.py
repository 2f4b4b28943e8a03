"""Rewrite attention over `[B, H, S, D]` tensors onto `torch.ops.attn.context_attention`.

Recognized spellings, in Dynamo's torch-level graph:

* `F.scaled_dot_product_attention(q, k, v, is_causal=..., scale=..., enable_gqa=...)` without
  dropout, and without mask or with a bool mask that `index_mask` proves is `k <= q` (Hugging
  Face's compiled causal mask) or `q - w <= k <= q` (its sliding-window mask: `window_left=w`),
  or a float mask of such a mask and an ALiBi bias (`alibi.additive_mask`: Falcon's
  `masked_fill(alibi / sqrt(D), where(m, 0, min) < -1, min)`; the bias may be absent), or of a
  bool mask the heads share, causal and padded, and an ALiBi bias from the padding mask's
  positions (`alibi.masked_bias`: Falcon's ALiBi over a padded batch; `key_mask`); any
  other bool mask that the heads share (e.g. a padding mask passed in, as in Hugging Face's
  `generate()`) goes to the op as `key_mask`, row by row, without causality, and so does a float
  mask that is a graph input shared by the heads (`is_input_mask`: Hugging Face's eager masks
  under `generate()`, 0 or `finfo.min`; `replacements.key_mask_of` checks the values on the device);
* `softmax(q @ k.transpose(-2, -1) <ops>, dim=-1) @ v`, where `<ops>` are any number of
  scalings by constants (`*`, `/`, also in place; none means scale 1) and at most one causal
  `masked_fill(mask, -inf or finfo.min)` whose mask is `triu`/`tril` of `ones`, possibly negated
  (`~`, `logical_not`, `== 0`) or provably causal (`index_mask`), or at most one additive
  `+ where(mask, 0, -inf or finfo.min)` with a provably causal or sliding-window mask (Hugging
  Face's eager spelling) or `+ mask` of a float graph-input mask as above or `+ where(mask, 0,
  -inf)` of any other bool mask the heads share (BLOOM's padded mask, built in the graph from
  the 2-D mask: `key_mask`), and soft-capping `c * tanh(s / c)` by a constant `c` before the mask
  (`softcap=c`; Gemma 2's spelling, whose cap Dynamo lifts to a graph input under
  `dynamic=True`: then declined); float casts around the softmax (fp32 softmax) and eval-mode
  dropout are allowed; learned sinks: the softmax over `cat([scores, sinks.reshape(1, -1, 1,
  1).expand(...)], -1)` (minus its row max or not) with the last probability column dropped
  before `@ v` (`sinks=`; gpt-oss's spelling); ALiBi biases added to the scores (any number,
  each under the scalings after it) and the mask folded with one (Falcon's eager spelling);
* the same with `bmm` over `[B*H, S, D]` views of `[B, H, S, D]` q, k, v, the scores
  `baddbmm(bias, q, k^T, beta=b, alpha=a)` (`b * bias + a * q @ k^T`) and viewed as `[B, H, S,
  S]` for the mask (BLOOM's spelling); the result is the op's output viewed as `[B*H, S, D]`.

ALiBi: a bias that `alibi` proves is per-head slopes times key positions, up to a term constant
per row, becomes the op's `alibi_slopes` (constant slopes fold into a graph constant; slopes
from a buffer and symbolic factors such as BLOOM's lifted `beta` are applied at run time). With
a causal mask: `slope * k` is `-slope * |q - k|` plus a row constant where `k <= q`. With a
`key_mask` instead, the op's query `i` sits at `Sk - Sq + i` and the replacement checks on the
device that no query sees a key after it (`replacements.check_alibi`). Positions from a padding
mask `m` (`(cumsum(m) - 1) * m`, BLOOM's and Falcon's, `alibi.padding_positions`) are `k - c_b`
on the keys of a left-padded row: the same check fails the call where they are not the key
index plus one number on the keys a query sees (a mask with holes); they need a `key_mask`.
Layers over the same mask, positions and shapes share one check (`alibi_checked_before`).

K/V repeated to the query head count, by `repeat_interleave(n, dim=1)`, `expand` of one head,
or Hugging Face's `repeat_kv` (`k[:, :, None].expand(...).reshape(...)`), are fed to the op
un-repeated: GQA. The rewrite packs `[B, H, S, D]` to `[B*S, H, D]` with
`cu_seqlens = arange(B + 1) * S` and returns a `[B, H, S, D_v]` view of the packed output (the
layout flash SDPA returns on CUDA). Values may have a head dim of their own, `D_v != D` (MLA
prefill over decompressed keys and values: DeepSeek-V3's `D = qk_nope + qk_rope`, `D_v =
v_head_dim`); the op's `scale` then defaults to `1/sqrt(D)`, as SDPA's does.

Scales that are not constants (`/ math.sqrt(q.size(-1))` under `dynamic=True` is symbolic, and
`dynamic=True` lifts float module attributes such as Hugging Face's `scaling` to graph inputs,
read with `.item()`) multiply the query instead (`q_factor`; RoPE, which the op may apply, is
linear, so scaling before it is the same), and the op's `scale` keeps the constant part.

Declined, with the reason logged at DEBUG on logger `fx_passes` and the graph unchanged: any
other mask or bias (bool masks that differ between heads, float masks that are neither of the
above, ALiBi without a causal mask or a `key_mask`, positions from a padding
mask without a `key_mask`), dropout in training, dtypes other than
fp16/bf16/fp32, devices other than CPU/CUDA, attention that autograd records (the op has no
autograd formula: compile under no_grad), one query over many keys (a decode step over a `[B,
H, S, D]` cache: the op would repack the cache every call; on an H200 that made a 1B Llama
decode step 2.3x slower than stock compile), query and key head dims that differ, attention
weights used elsewhere, and causal attention unless Sq == Sk is guaranteed: SDPA's `is_causal`
(and a `triu` mask) is aligned top-left, the op's causal mask bottom-right.

A direct walk of the pre-grad graph rather than `register_replacement`: the pattern matcher
matches ATen graphs, in which SDPA has already been lowered to a device-, dtype- and
version-specific op (with torch 2.11: `_scaled_dot_product_flash_attention_for_cpu` on CPU,
`_scaled_dot_product_cudnn_attention` for fp16 on an H200) and the matmul spelling may already
have been rewritten by Inductor's `fuse_attention`. Here each spelling has a few forms (which
`torch_ir.call` folds together) whose arguments are read and checked directly, and each decline
can name its reason.
"""

from __future__ import annotations

import dataclasses
import logging
import operator

import torch
import torch.fx as fx

from . import alibi, index_mask
from .masks import (CASTS, added_mask, causal_fill, check_mask_shape, is_head_shared_bool, is_input_mask,
                    key_mask_added)
from .replacements import context_attention_bhsd, key_mask_of
from .torch_ir import Call, Decline, call, declined, erase_unused, insert_call, is_tensor, known_equal, value

log = logging.getLogger(__name__)

NAME = "sdpa_to_attn"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DEVICES = ("cpu", "cuda")
# scalings of the scores; the in-place ones (`scores /= c`) act on scores nothing else reads
_SCALINGS = {"mul": "mul", "div": "div", "imul": "mul", "itruediv": "div", "mul_": "mul", "div_": "div"}


@dataclasses.dataclass
class Attention:
    """A recognized attention: `node` computes it; `nodes` become dead once it is replaced."""

    node: fx.Node
    query: fx.Node
    key: fx.Node
    value: fx.Node
    causal: bool
    scale: float | None
    nodes: list[fx.Node]
    q_factors: list[tuple[fx.Node, bool]] = dataclasses.field(default_factory=list)  # (factor, divides)
    window_left: int = -1   # causal with a sliding window: the keys q - window_left .. q
    softcap: float = 0.0    # soft-capped scores: softcap * tanh(s / softcap)
    sinks: fx.Node | None = None   # learned sink logits [Hq]: one more softmax column without a value
    alibi: list[alibi.Term] | None = None   # ALiBi slopes (`alibi.frame_slopes`), summed by `alibi.slopes_node`
    merged: bool = False    # `node` returns [B*Hq, Sq, D] (bmm over [B*H, S, D] views)
    key_mask: fx.Node | None = None   # a mask shared by the heads, of any pattern (not causal): bool, or float (0 or finfo.min)
    positions: fx.Node | None = None  # the ALiBi's run-time positions [B, Sk] (`alibi.padding_positions`)


def apply(graph: fx.Graph) -> int:
    """Rewrite every attention in `graph` that the op can serve; returns how many."""
    rewritten = 0
    for node in list(graph.nodes):
        c = call(node)
        match = _MATCHERS.get(c.name) if c is not None else None
        if match is None:
            continue
        try:
            attention = match(node, c)
            if attention is None:
                continue
            example = _example_output(attention)
        except Decline as reason:
            declined(log, NAME, node, reason)
            continue
        _replace(graph, attention, example)
        rewritten += 1
    return rewritten


def _match_sdpa(node: fx.Node, c: Call) -> Attention:
    """`F.scaled_dot_product_attention`. Heads: equal, or one K/V head broadcast, or GQA with
    enable_gqa; all three mean what the op means by query head h reading KV head h // (Hq / Hkv)."""
    dropout_p = c.arg(4, "dropout_p", 0.0)
    if not isinstance(dropout_p, (int, float)) or dropout_p != 0:
        raise Decline(f"dropout_p={dropout_p} (only 0 is served)")
    causal, scale = c.arg(5, "is_causal", False), c.arg(6, "scale")
    if not isinstance(causal, bool):
        raise Decline("is_causal is not a constant bool")
    mask, mask_nodes, slopes, key_mask = c.arg(3, "attn_mask"), [], None, None
    if mask is not None:
        q, k = value(c.arg(0, "query")), value(c.arg(1, "key"))
        if causal or not is_tensor(mask) or not is_tensor(q) or not is_tensor(k):
            raise Decline("attn_mask is given with is_causal=True or is not a tensor")
        scores_shape = (*q.shape[:-1], k.shape[-2])
        check_mask_shape(mask, scores_shape)
        if value(mask).dtype == torch.bool:
            window = index_mask.causal_window(mask, mask_nodes)
            if window is None:
                # another bool mask (e.g. one built outside the graph, with padding) goes to the op
                # row by row, if the heads share it
                if not is_head_shared_bool(mask):
                    raise Decline(f"attn_mask {mask.name} is neither the causal mask (k <= q, or q - w <= k <= q) "
                                  "nor a bool mask shared by the heads")
                key_mask, window, mask_nodes = mask, -1, []
        elif is_input_mask(mask):
            key_mask, window = mask, -1
        else:
            window, terms = alibi.additive_mask(mask, mask_nodes) or (None, None)
            if window is None and (found := alibi.masked_bias(mask, mask_nodes)) is not None \
                    and is_head_shared_bool(found[0]):
                (key_mask, terms), window = found, -1   # e.g. Falcon's ALiBi in a padded mask
            elif window is None:
                raise Decline(f"float attn_mask {mask.name} is not recognized as where(causal mask or a bool mask "
                              "shared by the heads, 0 or an ALiBi bias, -inf) (an ALiBi bias: per-head slopes times "
                              "key positions) nor is it a graph input shared by the heads")
            slopes = _frame_slopes([(terms, value(mask).shape, scores_shape, False, 1.0, ())], q) if terms else []
        causal = key_mask is None
    else:
        window = -1
    factors = []
    if is_scalar_node(scale):
        factors, scale = [(scale, False)], 1.0
    elif scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise Decline(f"scale {scale} is not a number")
    return _attention(node, c.arg(0, "query"), c.arg(1, "key"), c.arg(2, "value"), causal=causal,
                      scale=None if scale is None else float(scale), nodes=[node, *mask_nodes], q_factors=factors,
                      window_left=window, alibi=slopes, key_mask=key_mask)


def match_matmul(node: fx.Node, c: Call, decode: bool = False) -> Attention | None:
    """`softmax(scores) @ v`, or None if `node` is some other matmul. With `bmm`, the operands
    may be `[B*H, S, D]` views of `[B, H, S, D]` tensors (BLOOM), and the scores `baddbmm(bias,
    q, k^T)` with an ALiBi bias. `decode`: match one query over many keys (see `_attention`)."""
    x, v = c.input, c.arg(1, "mat2" if c.name == "bmm" else "other")
    merged = merged_output = _is_3d(node)   # the [B*H, ...] frame (views of [B, H, ...])
    heads = []   # the [B, H] of each view between the frames
    chain = []  # from the probabilities back to q @ k^T: each must have one user
    while (cx := call(x)) is not None:
        if _is_float_cast(x, cx) or cx.name == "dropout":
            _check_eval_dropout(cx)
        elif merged and (x4 := _unmerged(x)) is not None:
            merged = False
            heads.append(value(x4).shape[:2])
        elif not _is_same_shape_view(x, cx):
            break
        chain.append(x)
        x = cx.input
    sink_dropped = cx is not None and cx.name == "getitem" and _drops_last_key(cx)
    if sink_dropped:
        chain.append(x)
        x = cx.input
        cx = call(x)
    if cx is None or cx.name != "softmax":
        return None
    chain.append(x)
    dim, ndim = cx.arg(1, "dim"), value(x).dim()
    if not isinstance(dim, int) or dim % ndim != ndim - 1:
        raise Decline(f"softmax over dim {dim}, not the key dim")
    scale, causal, window, softcap, mask_nodes, factors, key_mask = 1.0, False, -1, 0.0, [], [], None
    biases = []  # (terms, bias shape, scores shape, merged, factor, symbolic factors) of each ALiBi bias
    x, sinks = cx.input, None
    if sink_dropped:
        x, sinks = _split_sinks(x, mask_nodes)
    while (cx := call(x)) is not None and cx.name not in _PRODUCTS:
        chain.append(x)
        if _is_float_cast(x, cx) or _is_same_shape_view(x, cx):
            x = cx.input
        elif not merged and (x3 := _unsplit(x)) is not None:
            merged = True
            heads.append(value(x).shape[:2])
            x = x3
        elif cx.name in _SCALINGS:
            x, factor = _scaling(cx)
            divides = _SCALINGS[cx.name] == "div"
            if isinstance(factor, fx.Node):
                factors.append((factor, divides))
            else:
                scale = scale / factor if divides else scale * factor
        elif cx.name == "tanh" and not softcap:
            # soft-capping `c * tanh(s / c)`: the scaling seen so far (after the tanh) is c
            if factors or scale <= 0:
                raise Decline("tanh of the scores not under one constant positive factor (soft-capping c * tanh(s / c))")
            x, softcap = cx.input, scale   # the factors before the tanh keep multiplying `scale`
        elif cx.name == "masked_fill" and not causal and not softcap:
            x, causal = causal_fill(cx, mask_nodes), True
        elif cx.name == "add" and not softcap and key_mask is None and (found := key_mask_added(cx, mask_nodes)):
            x, key_mask = found
            check_mask_shape(key_mask, value(x).shape)
        elif cx.name == "add" and not softcap:
            x, bias, found_window, terms = added_mask(cx, mask_nodes)
            if found_window is not None:
                if causal:
                    raise Decline("two causal masks on the scores")
                check_mask_shape(bias, value(x).shape)
                causal, window = True, found_window
            if terms:
                biases.append((terms, value(bias).shape, value(x).shape, merged, scale, tuple(factors)))
        else:
            raise Decline(f"the scores pass through {cx.name} (understood: constant scaling, casts, "
                          "one causal masked_fill or causal additive mask, ALiBi biases, soft-capping before the mask)")
    if cx is None:
        raise Decline("the scores are not q @ k^T")
    if key_mask is not None and causal:
        raise Decline("a causal mask and a key mask on the same scores")
    chain.append(x)
    for n in chain:
        if len(n.users) != 1:
            raise Decline(f"{n.name} is used outside the attention (e.g. returned attention weights)")
    q, kt = cx.input, cx.arg(1, "mat2" if cx.name == "bmm" else "other")
    if cx.name == "baddbmm":
        q, kt = cx.arg(1, "batch1"), cx.arg(2, "batch2")
        scale, factors, found_window = _baddbmm(x, cx, scale, factors, biases, softcap, mask_nodes)
        if found_window is not None:
            if causal:
                raise Decline("two causal masks on the scores")
            causal, window = True, found_window
    if scale <= 0:
        raise Decline(f"scale {scale} is not positive")
    q, k, v = _heads_of((q, merged), (_untransposed(kt), merged), (v, merged_output), heads=heads)
    slopes = _frame_slopes(biases, value(q))
    return _attention(node, q, k, v, causal=causal, scale=scale,
                      nodes=[node, *chain, kt, *mask_nodes], q_factors=factors, window_left=window, softcap=softcap,
                      sinks=sinks, alibi=slopes, merged=merged_output, key_mask=key_mask, decode=decode)


_PRODUCTS = ("matmul", "bmm", "baddbmm")


def _baddbmm(node: fx.Node, c: Call, scale: float, factors: list, biases: list, softcap: float, nodes: list):
    """`baddbmm(bias, q, k^T, beta=b, alpha=a)`, i.e. `b * bias + a * q @ k^T`: returns the scale
    and symbolic factors of `q @ k^T` and the bias's causal window; appends its ALiBi terms to
    `biases`."""
    beta, alpha = c.kwargs.get("beta", 1), c.kwargs.get("alpha", 1)
    bias_factors, bias_scale = list(factors), scale
    for f in (alpha, beta):
        if not (is_scalar_node(f) or (isinstance(f, (int, float)) and not isinstance(f, bool))):
            raise Decline(f"baddbmm with beta/alpha {getattr(f, 'name', f)}, not numbers")
    if is_scalar_node(alpha):
        factors = factors + [(alpha, False)]
    else:
        scale = scale * alpha
    if is_scalar_node(beta):
        bias_factors.append((beta, False))
    else:
        bias_scale = bias_scale * beta
    if isinstance(beta, (int, float)) and beta == 0:   # the input is ignored
        return scale, factors, None
    found = alibi.additive_mask(c.input, nodes)
    if found is None:
        raise Decline(f"baddbmm adds {getattr(c.input, 'name', c.input)} to the scores: not where(causal mask, 0, "
                      "-inf) or an ALiBi bias (per-head slopes times key positions)")
    if softcap:
        raise Decline("a bias under the soft-cap")
    window, terms = found
    if window is not None:
        check_mask_shape(c.input, value(node).shape)
    if terms:
        biases.append((terms, value(c.input).shape, value(node).shape, True, bias_scale, tuple(bias_factors)))
    return scale, factors, window


_MATCHERS = {"scaled_dot_product_attention": _match_sdpa, "matmul": match_matmul, "bmm": match_matmul}


def _attention(node, q, k, v, *, causal, scale, nodes, q_factors, window_left=-1, softcap=0.0,
               sinks=None, alibi=None, merged=False, key_mask=None, decode=False) -> Attention | None:
    """Check what the op needs; strip K/V head repetition (GQA) when both carry the same one.
    With `decode`, only one query over many keys is a candidate (None for others), with no
    causal mask (aligned top-left, it would keep key 0 only); ALiBi needs none there: the op
    measures `|p - k|` from the last visible key, the query's position."""
    if not all(is_tensor(x) for x in (q, k, v)):
        raise Decline("query, key or value is not a tensor")
    (k_base, k_reps, k_nodes), (v_base, v_reps, v_nodes) = unrepeat(k), unrepeat(v)
    if known_equal(k_reps, v_reps):
        k, v = k_base, v_base
        nodes = nodes + k_nodes + v_nodes
    qv, kv, vv = value(q), value(k), value(v)
    if not qv.dim() == kv.dim() == vv.dim() == 4:
        raise Decline(f"query/key/value are {qv.dim()}/{kv.dim()}/{vv.dim()}-D, not [B, H, S, D]")
    if not qv.dtype == kv.dtype == vv.dtype or qv.dtype not in DTYPES:
        raise Decline(f"dtypes {qv.dtype}/{kv.dtype}/{vv.dtype} (served: one of fp16, bf16, fp32)")
    if qv.device.type not in DEVICES or not qv.device == kv.device == vv.device:
        raise Decline(f"devices {qv.device}/{kv.device}/{vv.device} (served: one CPU or CUDA device)")
    if value(node).requires_grad:
        raise Decline("autograd records it; attn ops are inference-only (run under torch.no_grad())")
    if not known_equal(qv.shape[3], kv.shape[3]):
        raise Decline(f"query and key head dims differ: query {qv.shape[3]}, key {kv.shape[3]}")
    if not known_equal(kv.shape[:3], vv.shape[:3]) or not known_equal(qv.shape[0], kv.shape[0]):
        raise Decline(f"shapes query {tuple(qv.shape)}, key {tuple(kv.shape)}, value {tuple(vv.shape)}: "
                      "need one batch size and key/value of one [B, Hkv, S]")
    is_decode = known_equal(qv.shape[2], 1) and not known_equal(kv.shape[2], 1)
    if decode:
        if not is_decode:
            return None
        if causal:
            raise Decline("a causal mask with one query: aligned top-left, it keeps key 0 only")
    elif is_decode:
        raise Decline(f"a decode step (one query over {kv.shape[2]} cached keys): packing [B, H, S, D] "
                      "keys for context_attention copies the whole cache every call, SDPA reads it in place")
    if causal and not known_equal(qv.shape[2], kv.shape[2]):
        raise Decline(f"causal with Sq={qv.shape[2]}, Sk={kv.shape[2]} not known equal: the source "
                      "aligns the mask top-left, context_attention bottom-right")
    if sinks is not None and not known_equal(value(sinks).shape, (qv.shape[1],)):
        raise Decline(f"sink logits of shape {tuple(value(sinks).shape)}, not one per query head ({qv.shape[1]})")
    if alibi and not causal and not decode and key_mask is None:
        raise Decline("an ALiBi bias without a causal mask: slope * k is the op's -slope * |q - k| (up to a "
                      "constant per row) only where k <= q")
    positions = {t.positions.node for t in alibi or () if t.positions is not None}
    if len(positions) > 1:
        raise Decline("ALiBi biases of two run-time position tensors")
    if positions and key_mask is None:
        raise Decline("ALiBi of run-time positions without a mask of the keys each query sees")
    return Attention(node, q, k, v, causal, scale, nodes, q_factors, window_left, softcap, sinks, alibi, merged,
                     key_mask, next(iter(positions), None))


def q_factor_value(attention: Attention):
    """The example value of the product of the attention's symbolic query factors, or None."""
    factor = None
    for node, divides in attention.q_factors:
        term = 1.0 / value(node) if divides else value(node)
        factor = term if factor is None else factor * term
    return factor


def _example_output(attention: Attention) -> torch.Tensor:
    """The replacement's output on the example values; the op's own checks run here."""
    a = attention
    args = (value(a.query), value(a.key), value(a.value))
    factor = q_factor_value(a)
    slopes = alibi.example_slopes(args[0], a.alibi)
    try:
        with args[0].fake_mode:
            out = context_attention_bhsd(*args, causal=a.causal, scale=a.scale, q_factor=factor,
                                         window_left=a.window_left, softcap=a.softcap, sinks=value(a.sinks),
                                         alibi_slopes=slopes)
            return out.flatten(0, 1) if a.merged else out
    except (TypeError, ValueError) as e:
        raise Decline(f"attn::context_attention rejects the inputs: {e}") from e


def q_factor_node(graph: fx.Graph, attention: Attention) -> fx.Node | None:
    """A node of the product of the attention's symbolic query factors (None if there are none)."""
    a, factor = attention, None
    for node, divides in a.q_factors:
        term = insert_call(graph, a.node, operator.truediv, (1.0, node)) if divides else node
        factor = term if factor is None else insert_call(graph, a.node, operator.mul, (factor, term))
    return factor


def slopes_node(graph: fx.Graph, attention: Attention) -> fx.Node | None:
    """A node of the attention's fp32 `[Hq]` ALiBi slopes (None without ALiBi)."""
    if not attention.alibi:
        return None
    q = value(attention.query)
    return alibi.slopes_node(graph, attention.node, attention.alibi, q.shape[1], q.device)


def key_mask_node(graph: fx.Graph, mask: fx.Node, before: fx.Node) -> fx.Node:
    """`mask` as the op's bool `key_mask`: itself if bool, else one `key_mask_of` node (its check
    included) per mask node, inserted before the first attention that uses it and shared by the
    later ones (the layers of a model share one mask)."""
    if value(mask).dtype == torch.bool:
        return mask
    shared = mask.meta.get("attn_key_mask")
    if shared is None or shared.graph is not graph:
        shared = mask.meta["attn_key_mask"] = insert_call(graph, before, key_mask_of, (mask,))
    return shared


def alibi_checked_before(graph: fx.Graph, key_mask: fx.Node, positions: fx.Node | None, shape: tuple) -> bool:
    """Whether an attention rewritten earlier in `graph` over the same `key_mask` node, ALiBi
    `positions` node and `shape` already checks its ALiBi on the device (`replacements.check_alibi`:
    the same check); if not, the caller's attention is recorded as the one that does."""
    seen = key_mask.meta.get("attn_alibi_checked")
    if seen is None or seen[0] is not graph:
        seen = key_mask.meta["attn_alibi_checked"] = (graph, set())
    key = (None if positions is None else positions.name, *map(str, shape))
    if key in seen[1]:
        return True
    seen[1].add(key)
    return False


def _replace(graph: fx.Graph, attention: Attention, example: torch.Tensor) -> None:
    a = attention
    factor, slopes = q_factor_node(graph, a), slopes_node(graph, a)
    key_mask = None if a.key_mask is None else key_mask_node(graph, a.key_mask, a.node)
    checked = key_mask is not None and slopes is not None and alibi_checked_before(
        graph, key_mask, a.positions, (*value(a.query).shape[:3], value(a.key).shape[2]))
    with graph.inserting_before(a.node):
        new = graph.call_function(context_attention_bhsd, (a.query, a.key, a.value),
                                  {"causal": a.causal, "scale": a.scale, "q_factor": factor,
                                   "window_left": a.window_left, "softcap": a.softcap, "sinks": a.sinks,
                                   "alibi_slopes": slopes, "key_mask": key_mask, "alibi_positions": a.positions,
                                   "alibi_checked": checked})
    new.meta.update(a.node.meta)
    new.meta["example_value"] = example.unflatten(0, value(a.query).shape[:2]) if a.merged else example
    out = insert_call(graph, a.node, "flatten", (new, 0, 1), method=True) if a.merged else new
    a.node.replace_all_uses_with(out)
    erase_unused(graph, a.nodes)


def _is_float_cast(x, c: Call) -> bool:
    return c.name in CASTS and is_tensor(x) and value(x).dtype.is_floating_point


def _check_eval_dropout(c: Call) -> None:
    if c.name != "dropout":
        return
    p, training = c.arg(1, "p", 0.5), c.arg(2, "training", c.kwargs.get("train", True))
    if training is not False and (not isinstance(p, (int, float)) or not isinstance(training, bool) or p != 0):
        raise Decline(f"dropout (p={p}, training={training}) on the attention probabilities")


def _scaling(c: Call) -> tuple[fx.Node, float | fx.Node]:
    """(scores, factor) of `scores * factor`, `factor * scores` or `scores / factor`; the factor
    is a number or a node of a symbolic number."""
    a, b = c.input, c.arg(1, "other")
    if _SCALINGS[c.name] == "mul" and not is_tensor(a):
        a, b = b, a
    if is_scalar_node(b) and c.kwargs.get("rounding_mode") is None:
        return a, b
    if c.kwargs.get("rounding_mode") is not None or isinstance(b, bool) or not isinstance(b, (int, float)):
        raise Decline(f"scores {c.name} by {getattr(b, 'name', b)}, not by a number")
    return a, float(b)


def is_scalar_node(x) -> bool:
    """A node computing a (symbolic) Python number, e.g. `t.item()` of a lifted float attribute."""
    return isinstance(x, fx.Node) and isinstance(value(x), (torch.SymFloat, torch.SymInt, float, int)) \
        and not isinstance(value(x), bool)


def _drops_last_key(c: Call) -> bool:
    """`probs[..., :-1]`: the probabilities without their last column (a sink's)."""
    index = c.args[1] if len(c.args) > 1 else None
    return (isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis
            and index[1] == slice(None, -1, None))


def _split_sinks(x, nodes: list) -> tuple[fx.Node, fx.Node]:
    """(scores, sinks [H]) of the softmax input `cat([scores, sinks.reshape(1, -1, 1, 1).expand(B,
    -1, Sq, -1)], -1)`, possibly minus its row max (the same softmax; gpt-oss's spelling);
    collects the nodes that go with the rewrite into `nodes`."""
    c = call(x)
    if c is not None and c.name == "sub":
        combined, row_max = c.input, c.arg(1, "other")
        if not _is_row_max(row_max, combined):
            raise Decline(f"the softmax input {x.name} subtracts {getattr(row_max, 'name', row_max)}, not its row max")
        nodes += [x, row_max, *([row_max.args[0]] if call(row_max).name == "getitem" else [])]
        x, c = combined, call(combined)
    if c is None or c.name != "cat" or c.arg(1, "dim", 0) not in (-1, 3) or len(c.input) != 2:
        raise Decline(f"the softmax input {x.name} is not cat([scores, sink logits], -1) (its last column is dropped)")
    scores, column = c.input
    nodes.append(x)
    while (cc := call(column)) is not None and cc.name in ("expand", "reshape", "view"):
        nodes.append(column)
        column = cc.input
    if not is_tensor(column) or value(column).dim() != 1 or not known_equal(value(x).shape[-1], value(scores).shape[-1] + 1):
        raise Decline(f"the column appended to the scores is not one sink logit per head: {column.name}")
    return scores, column


def _is_row_max(m, x) -> bool:
    """`m` is `x.max(-1, keepdim=True).values` or `x.amax(-1, keepdim=True)`."""
    c = call(m)
    if c is not None and c.name == "getitem" and c.args[1] == 0:
        c = call(c.input)
        if c is None or c.name != "max":
            return False
    elif c is None or c.name != "amax":
        return False
    return c.input is x and c.arg(1, "dim") in (-1, 3, [-1], [3], (-1,), (3,)) and c.arg(2, "keepdim", False) is True


def _untransposed(kt) -> fx.Node:
    """`k` of `k.transpose(-2, -1)` (any spelling of the last two dims) or `k.permute(0, 1, 3, 2)`,
    for a 4-D or 3-D `k`."""
    c = call(kt)
    n = value(c.input).dim() if c is not None and is_tensor(c.input) else 0
    if n in (3, 4):
        if c.name in ("transpose", "swapaxes", "swapdims"):
            dims, swapped = (c.arg(1, "dim0"), c.arg(2, "dim1")), ([n - 2, n - 1], [n - 1, n - 2])
        elif c.name == "permute":
            dims = c.args[1] if len(c.args) == 2 and isinstance(c.args[1], (tuple, list)) else c.args[1:]
            swapped = ([*range(n - 2), n - 1, n - 2],)
        else:
            dims, swapped = (), ()
        if all(isinstance(d, int) for d in dims) and [d % n for d in dims] in swapped:
            return c.input
    raise Decline("the keys in q @ k^T are not k transposed in the last two dims")


def _is_same_shape_view(x, c: Call) -> bool:
    """`view`/`reshape` to the shape the tensor has (Falcon's `scores.view(B, H, Sq, Sk)`)."""
    return c.name in ("view", "reshape") and is_tensor(c.input) and is_tensor(x) \
        and value(x).dtype == value(c.input).dtype and known_equal(value(x).shape, value(c.input).shape)


def _is_3d(x) -> bool:
    return is_tensor(x) and value(x).dim() == 3


def _unmerged(x) -> fx.Node | None:
    """`x4` if `x` is `x4 [B, H, S, T]` viewed as `[B*H, S, T]` (view, reshape, flatten(0, 1))."""
    c = call(x)
    if c is None or c.name not in ("view", "reshape", "flatten") or not _is_4d(c.input) or not _is_3d(x):
        return None
    b, h, s, t = value(c.input).shape
    if value(x).dtype != value(c.input).dtype or not known_equal(value(x).shape, (b * h, s, t)):
        return None
    return c.input


def _unsplit(x) -> fx.Node | None:
    """`x3` if `x` is `x3 [B*H, S, T]` viewed as `[B, H, S, T]`."""
    c = call(x)
    if c is None or c.name not in ("view", "reshape") or not _is_3d(c.input) or not _is_4d(x):
        return None
    b, h, s, t = value(x).shape
    if value(x).dtype != value(c.input).dtype or not known_equal(value(c.input).shape, (b * h, s, t)):
        return None
    return c.input


def _heads_of(*operands: tuple[fx.Node, bool], heads: list) -> list[fx.Node]:
    """q, k, v as `[B, H, S, D]` tensors: the merged ones (flag set) are `[B*H, S, D]` views of
    those; they and every view between the frames (`heads`: their [B, H]) must split B*H as the
    query's [B, H]."""
    out = [_unmerged(x) if merged else x for x, merged in operands]
    if any(x is None for x in out):
        raise Decline("the [B*H, S, D] operands are not views of [B, H, S, D] tensors")
    if not is_tensor(out[0]) or value(out[0]).dim() != 4:
        return out
    bh = value(out[0]).shape[:2]
    views = heads + [value(x).shape[:2] for x, (_, merged) in zip(out, operands) if merged]
    if not all(known_equal(s, bh) for s in views):
        raise Decline("the [B*H, ...] views do not all split B*H as the query's [B, H]")
    return out


def _frame_slopes(biases: list, q: torch.Tensor) -> list[alibi.Term]:
    """The ALiBi slope terms of `biases` (see `match_matmul`) for the query heads of `q [B, Hq, S, D]`."""
    if not biases:
        return []
    if q.dim() != 4:
        raise Decline(f"a {q.dim()}-D query, not [B, H, S, D]")
    if not isinstance(q.shape[1], int):
        raise Decline(f"ALiBi with a symbolic number of heads ({q.shape[1]})")
    terms = []
    for bias_terms, shape, scores_shape, merged, factor, scalars in biases:
        for t in alibi.frame_slopes(bias_terms, shape, scores_shape, 0 if merged else 1, q.shape[1]):
            terms.append(dataclasses.replace(t, coef=t.coef * factor, scalars=t.scalars + scalars))
    return terms


def unrepeat(x) -> tuple[fx.Node, int, list[fx.Node]]:
    """`(base, n, nodes)` if `x` repeats each head of `base [B, Hkv, S, D]` n times along dim 1
    (head h of `x` is head h // n of `base`), computed by `nodes`; else `(x, 1, [])`."""
    c = call(x)
    if c is None or not _is_4d(x):
        return x, 1, []
    out = value(x).shape
    if c.name == "repeat_interleave" and _is_4d(c.input) and c.arg(2, "dim") in (1, -3) \
            and isinstance(c.arg(1, "repeats"), int):
        return c.input, c.arg(1, "repeats"), [x]
    if c.name == "expand" and _is_4d(c.input):  # one KV head (MQA)
        b, h, s, d = value(c.input).shape
        if known_equal(h, 1) and known_equal(out, (b, out[1], s, d)):
            return c.input, out[1], [x]
    expand = call(c.input)
    if c.name in ("reshape", "view", "flatten") and expand is not None and expand.name == "expand" \
            and value(c.input).dim() == 5:  # Hugging Face's repeat_kv
        base = _unsqueezed_dim2(expand.input)
        if base is not None:
            b, h, s, d = value(base).shape
            n = value(c.input).shape[2]
            if known_equal(value(c.input).shape, (b, h, n, s, d)) and known_equal(out, (b, h * n, s, d)):
                return base, n, [x, c.input, expand.input]
    return x, 1, []


def _unsqueezed_dim2(x) -> fx.Node | None:
    """`k` of `k.unsqueeze(2)` or `k[:, :, None]` for a 4-D `k`, else None."""
    c = call(x)
    if c is None or not _is_4d(c.input):
        return None
    if c.name == "unsqueeze" and c.arg(1, "dim") in (2, -3):
        return c.input
    index = c.args[1] if c.name == "getitem" else None
    full = slice(None)
    if isinstance(index, tuple) and len(index) >= 3 and index[2] is None and index[0] == index[1] == full \
            and all(i == full or i is Ellipsis for i in index[3:]):
        return c.input
    return None


def _is_4d(x) -> bool:
    return is_tensor(x) and value(x).dim() == 4
