"""Fuse static FP8 quantization of an attention's output into the op's `out_scale` epilogue.

    o = attention(...)                                   # [B, H, S, D] or [T, H, D]
    y = (layout(o) / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    ->  o8 = attention(..., out_scale=scale);  y = layout(o8)

`attention` is `context_attention_bhsd` (from `sdpa_to_attn`), `paged_decode_bhsd` (from
`decode_to_paged`) or the `out` of an explicit
`attn::context_attention`/`paged_prefill`/`paged_decode` call without `out_scale`. `layout` is any
chain of transposes, permutes, views, reshapes, flattens and `contiguous` (they move FP8 bytes
as well as bf16 ones). `scale` is a one-element fp32 tensor (a buffer or input: static
quantization) or a number; a number or `torch.tensor(number)` becomes one graph constant shared
by every layer. Spellings: `clamp(min=, max=)`, `clip`, `clamp_min` + `clamp_max` in
either order, bounds `+-448` (`torch.finfo(torch.float8_e4m3fn).max`); the cast by `.to(...)`
or `.to(dtype=...)`. The op divides in fp32 (no rounding to the attention dtype first).

Declined with a logged reason: any other user of the attention output or of the chain, a scale
that is not a one-element fp32 tensor or number, bounds other than 448, other FP8 formats.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from .replacements import context_attention_bhsd, paged_decode_bhsd
from .torch_ir import Decline, call, declined, erase_unused, fake_eval, graph_constant, is_tensor, value

log = logging.getLogger(__name__)

NAME = "fp8_output"
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
_LAYOUT = {"transpose", "permute", "view", "reshape", "flatten", "contiguous", "swapaxes", "swapdims",
           "unflatten"}
_OPS = (torch.ops.attn.context_attention, torch.ops.attn.paged_prefill, torch.ops.attn.paged_decode)


def apply(graph: fx.Graph) -> int:
    """Fuse every static FP8 output quantization the attention can take; returns how many."""
    fused = 0
    for node in list(graph.nodes):
        c = call(node)
        if c is None or c.name != "to" or c.arg(1, "dtype") is not torch.float8_e4m3fn:
            continue
        try:
            fused += _fuse(graph, node, c)
        except Decline as reason:
            declined(log, NAME, node, reason)
    return fused


def _fuse(graph: fx.Graph, cast: fx.Node, c) -> int:
    if len(c.args) > 2 or set(c.kwargs) - {"dtype"}:
        raise Decline("the cast has arguments besides the dtype (device, copy, non_blocking)")
    clamped = c.input
    divided, clamps = _clamped_input(clamped)
    if divided is None:
        return 0
    d = call(divided)
    if d is None or d.name != "div" or d.kwargs.get("rounding_mode") is not None:
        raise Decline(f"the clamped value {divided.name} is not x / scale")
    x, scale = d.input, d.arg(1, "other")
    chain, attention = _layout_chain(x)
    if attention is None:
        return 0
    for n in chain + [divided, *clamps]:
        if len(n.users) != 1:
            raise Decline(f"{n.name} is also used outside the quantization")
    op, out_node = attention
    if op.kwargs.get("out_scale") is not None:
        return 0
    scale_node = _scale_tensor(graph, op, scale)
    old_kwargs = op.kwargs
    op.kwargs = {**op.kwargs, "out_scale": scale_node}
    try:
        op.meta["example_value"] = fake_eval(op)
    except (TypeError, ValueError) as e:
        op.kwargs = old_kwargs
        erase_unused(graph, [scale_node])
        raise Decline(f"the attention op rejects out_scale: {e}") from e
    for n in ([out_node] if out_node is not op else []) + list(reversed(chain)):
        n.meta["example_value"] = fake_eval(n)
    cast.replace_all_uses_with(x)
    erase_unused(graph, [cast, *clamps, divided])
    return 1


def _clamped_input(x: fx.Node) -> tuple[fx.Node | None, list[fx.Node]]:
    """`(y, clamp nodes)` for `x = y.clamp(-448, 448)` in its spellings; `(None, [])` if `x` is
    not such a clamp."""
    c = call(x)
    if c is None:
        return None, []
    if c.name in ("clamp", "clip"):
        lo, hi = c.arg(1, "min"), c.arg(2, "max")
        y, clamps = c.input, [x]
    elif c.name in ("clamp_min", "clamp_max"):
        inner = call(c.input)
        if inner is None or {c.name, inner.name} != {"clamp_min", "clamp_max"}:
            return None, []
        bounds = {c.name: c.arg(1, c.name[-3:]), inner.name: inner.arg(1, inner.name[-3:])}
        lo, hi, y, clamps = bounds["clamp_min"], bounds["clamp_max"], inner.input, [x, c.input]
    else:
        return None, []
    if lo != -FP8_MAX or hi != FP8_MAX:
        raise Decline(f"clamp bounds ({lo}, {hi}) are not the e4m3 range (-448, 448)")
    return y, clamps


def _layout_chain(x) -> tuple[list[fx.Node], tuple[fx.Node, fx.Node] | None]:
    """`(chain, (op node, output node))` if `x` is an attention's output passed through layout ops
    (`chain`, from `x` back), else `(chain, None)`."""
    chain = []
    while (c := call(x)) is not None and c.name in _LAYOUT:
        chain.append(x)
        x = c.input
    if isinstance(x, fx.Node) and x.target in (context_attention_bhsd, paged_decode_bhsd):
        return chain, (x, x)
    if isinstance(x, fx.Node) and call(x) is not None and call(x).name == "getitem" and x.args[1] == 0:
        op = x.args[0]
        if isinstance(op, fx.Node) and op.target in _OPS + tuple(o.default for o in _OPS):
            return chain, (op, x)
    return chain, None


def _scale_tensor(graph: fx.Graph, op: fx.Node, scale) -> fx.Node:
    """`scale` as the op's `out_scale`: a one-element fp32 tensor node; a graph constant when the
    scale is a number or `torch.tensor(number)`."""
    device = value(op.args[0]).device
    if isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0:
        return graph_constant(graph, float(scale), torch.float32, device)
    if not is_tensor(scale):
        raise Decline(f"scale {getattr(scale, 'name', scale)} is not a tensor or a positive number")
    s = value(scale)
    if s.dtype != torch.float32 or s.numel() != 1 or s.dim() > 1 or s.device != device:
        raise Decline(f"scale {scale.name} is {s.dtype} {tuple(s.shape)} on {s.device}, not one fp32 "
                      f"element on {device}")
    literal = call(scale)
    if literal is not None and literal.name == "tensor" and type(literal.input) in (int, float, list):
        return graph_constant(graph, literal.input, torch.float32, device)
    order = {n: i for i, n in enumerate(graph.nodes)}
    if order[scale] > order[op]:
        if any(order[i] > order[op] for i in scale.all_input_nodes):
            raise Decline(f"scale {scale.name} is computed from values made after the attention")
        op.prepend(scale)  # a get_attr or constant Dynamo placed at its first use
    return scale
