"""Recognizing the masks on attention scores `[B, H, Sq, Sk]` for `sdpa_to_attn` and
`decode_to_paged`: their shape, causal `masked_fill` masks (`triu`/`tril` of `ones`, negated, or
provably causal by `index_mask`), additive masks (`where(causal, 0, -inf)` with an ALiBi bias or
not, `alibi.additive_mask`), and key masks (any pattern the heads share, bool or a float graph
input, served row by row by the op's `key_mask`)."""

from __future__ import annotations

import torch
import torch.fx as fx

from . import alibi, index_mask
from .torch_ir import Call, Decline, call, is_tensor, known_equal, value

CASTS = {"to", "type", "type_as", "float", "half", "bfloat16", "contiguous"}


def check_mask_shape(mask, scores_shape) -> None:
    """A mask of shape `[..., Sq, Sk]` broadcasting to the scores `[B, H, Sq, Sk]`."""
    mask_shape = value(mask).shape
    if len(mask_shape) > len(scores_shape) or not known_equal(mask_shape[-2:], scores_shape[-2:]) or not all(
            known_equal(m, 1) or known_equal(m, s) for m, s in zip(mask_shape[:-2], scores_shape[-len(mask_shape):-2])):
        raise Decline(f"mask shape {tuple(mask_shape)} does not broadcast as [..., Sq, Sk] to "
                      f"the scores {tuple(scores_shape)}")


def is_head_shared_bool(mask) -> bool:
    """Whether `mask` (broadcasting to scores `[B, H, Sq, Sk]`) is bool and the same for every head:
    the op's `key_mask`, row by row."""
    shape = value(mask).shape
    return value(mask).dtype == torch.bool and (len(shape) < 3 or known_equal(shape[-3], 1))


def is_input_mask(mask) -> bool:
    """A float mask shared by the heads that is a graph input, or a slice of one (Hugging Face's
    eager masks, built outside a compiled forward by `generate()`). Its values cannot be proven
    0 or -inf at compile time: `replacements.key_mask_of` checks them on the device."""
    x = mask
    while (c := call(x)) is not None and c.name == "getitem" and is_tensor(c.input) \
            and not any(isinstance(i, fx.Node) for i in torch.utils._pytree.tree_leaves(c.args[1])):
        x = c.input
    return isinstance(x, fx.Node) and x.op == "placeholder" and is_tensor(mask) \
        and value(mask).dtype.is_floating_point and (value(mask).dim() < 3 or known_equal(value(mask).shape[-3], 1))


def causal_fill(c: Call, nodes: list) -> fx.Node:
    """The scores of `scores.masked_fill(mask, -inf)` whose mask is true exactly above the
    diagonal; collects the mask's nodes into `nodes`."""
    scores, mask, fill = c.input, c.arg(1, "mask"), c.arg(2, "value")
    if not isinstance(fill, (int, float)) or not fill <= torch.finfo(value(scores).dtype).min:
        raise Decline(f"masked_fill with {getattr(fill, 'name', fill)}, not -inf")
    if not is_tensor(mask):
        raise Decline("the masked_fill mask is not a tensor")
    check_mask_shape(mask, value(scores).shape)
    if _triangle(mask, nodes) != ("triu", 1) and not _is_causal_complement(mask, nodes):
        raise Decline(f"mask {mask.name} is not recognized as causal (triu(ones, 1) or its complement)")
    return scores


def _is_causal_complement(mask, nodes: list) -> bool:
    """`mask` is true exactly above the diagonal: `~m` or `m == 0` of a provably causal `m`."""
    c = call(mask)
    negated = c is not None and (c.name == "logical_not" or (c.name == "invert" and value(mask).dtype == torch.bool)
                                 or (c.name == "eq" and c.arg(1, "other") in (0, False)))
    if negated and index_mask.is_causal(c.input, nodes):
        nodes.append(mask)
        return True
    return False


def _triangle(x, nodes: list) -> tuple[str, int] | None:
    """`("triu", d)` if `x` is nonzero exactly where `col - row >= d`, `("tril", d)` where
    `col - row <= d`; None if not recognized. Collects the nodes read into `nodes`."""
    c = call(x)
    if c is None:
        return None
    nodes.append(x)
    if c.name in ("triu", "tril"):
        diagonal = c.arg(1, "diagonal", 0)
        return (c.name, diagonal) if isinstance(diagonal, int) and _all_ones(c.input, nodes) else None
    if c.name in CASTS or c.name == "bool":
        return _triangle(c.input, nodes)
    negated = (c.name == "logical_not" or (c.name == "invert" and value(x).dtype == torch.bool)
               or (c.name == "eq" and c.arg(1, "other") in (0, False)))
    inner = _triangle(c.input, nodes) if negated else None
    if inner is None:
        return None
    kind, d = inner
    return ("tril", d - 1) if kind == "triu" else ("triu", d + 1)


def _all_ones(x, nodes: list) -> bool:
    c = call(x)
    if c is None or c.name not in CASTS | {"bool", "ones", "ones_like", "new_ones"}:
        return False
    nodes.append(x)
    return c.name in ("ones", "ones_like", "new_ones") or _all_ones(c.input, nodes)


def added_mask(c: Call, nodes: list) -> tuple[fx.Node, fx.Node, int | None, tuple | None]:
    """(scores, mask, window, ALiBi terms) of `scores + mask` (either order), where `mask` is
    `where(causal, 0, -inf)`, an ALiBi bias, or both (`alibi.additive_mask`); collects the mask's
    nodes into `nodes`."""
    a, b = c.input, c.arg(1, "other")
    if c.kwargs.get("alpha", 1) == 1 and is_tensor(a) and is_tensor(b):
        for scores, mask in ((a, b), (b, a)):
            read = []
            found = alibi.additive_mask(mask, read)
            if found is not None:
                nodes += read
                return scores, mask, *found
    raise Decline(f"the scores pass through add of {getattr(b, 'name', b)}, not of where(causal mask, 0, -inf) "
                  "or of an ALiBi bias (per-head slopes times key positions)")


def key_mask_added(c: Call, nodes: list) -> tuple[fx.Node, fx.Node] | None:
    """(scores, key mask) of `scores + mask` (either order) where `mask` is a float mask from a
    graph input (`is_input_mask`; the key mask is the mask), or `where(m, 0, -inf)` of a bool `m`
    shared by the heads that is not a causal mask (`alibi.additive_mask`: the op's causal flag
    serves those; the key mask is `m`); else None. Collects the nodes it makes dead into `nodes`."""
    a, b = c.input, c.arg(1, "other")
    if c.kwargs.get("alpha", 1) != 1:
        return None
    for scores, mask in ((a, b), (b, a)):
        if not is_tensor(scores) or not is_tensor(mask):
            continue
        if is_input_mask(mask):
            return scores, mask
        read = []
        if (m := alibi.kept_keys(mask, read)) is not None and is_head_shared_bool(m) \
                and alibi.additive_mask(mask, []) is None:
            nodes += read
            return scores, m
    return None
