"""Move rotary position embedding (RoPE) of q and k into the op that consumes them.

Recognized rotations of `x [..., D]` by tables `cos`, `sin` (broadcastable to `x`, last dim R):

    NeoX:  x * cos + cat((-x2, x1), -1) * sin                    x1, x2 = x[..., :R/2], x[..., R/2:]
    GPT-J: x * cos + stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2) * sin
    partial rotary (R < D): cat([rotate(x[..., :R]), x[..., R:]], -1)

with the products and the sum in either order (Hugging Face Llama/GPT-NeoX `rotate_half`,
GPT-J `rotate_every_two`). The ops take one cos and one sin per rotated pair, so the tables must
provably repeat each value for both elements of a pair: `cos` is `cat([c, c], -1)` (NeoX) or
`repeat_interleave(c, 2, -1)` (GPT-J) followed only by ops that act on each element alike
(casts, `cos`/`sin`, scaling by a number, unsqueeze/indexing/expand of other dims). Then:

* `context_attention_bhsd(q, k, v)` (from `sdpa_to_attn`) whose q and k are rotations with the
  same tables, seen through permutes, transposes and casts, gets the unrotated q and k and the
  tables: `attn::context_attention` rotates them (`positions`, `cos_sin_cache`).
* `attn::kv_cache_write(k, ...)` with a rotated key gets the unrotated key and the RoPE
  arguments; the query of the next `paged_decode`/`paged_prefill` on the same cache, if it is
  rotated with the same tables, is rotated by that same launch (`query=`) and taken from its
  result.

The tables become `cos_sin_cache [tokens, R]` with `positions = arange(tokens)`
(`replacements.rope_table`): per-token rows, so any position computation upstream is kept as
the model wrote it. Declined with a logged reason: tables that are not provably pair-repeated,
q and k with different tables or styles, tables that differ per head, Sq != Sk.
"""

from __future__ import annotations

import dataclasses
import logging
import operator

import torch
import torch.fx as fx
from torch._dynamo.utils import counters

from .replacements import context_attention_bhsd, rope_table
from .torch_ir import Decline, call, declined, erase_unused, fake_eval, insert_call, is_tensor, known_equal, value

log = logging.getLogger(__name__)

NAME = "rope_fusion"
_CASTS = {"to", "type", "type_as", "float", "half", "bfloat16", "contiguous"}
_ELEMENTWISE = _CASTS | {"cos", "sin", "neg", "clone"}
_SCALAR_OPS = {"mul", "div", "add", "sub", "rmul", "radd", "rsub", "rtruediv"}
_PAGED_ATTENTION = (torch.ops.attn.paged_decode, torch.ops.attn.paged_decode.default,
                    torch.ops.attn.paged_prefill, torch.ops.attn.paged_prefill.default)


@dataclasses.dataclass
class Rope:
    """`node` is `input` rotated by `cos`/`sin` (full-width tables, last dim R); `nodes` compute
    it from `input` (dead once `node` is no longer used)."""

    node: fx.Node
    input: fx.Node
    cos: fx.Node
    sin: fx.Node
    neox: bool
    nodes: list[fx.Node]


def apply(graph: fx.Graph) -> int:
    """Fuse every RoPE the consuming op can take; returns how many ops took one."""
    fused = 0
    for node in list(graph.nodes):
        try:
            if node.target is context_attention_bhsd and node.kwargs.get("cos") is None:
                fused += _into_context_attention(graph, node)
            elif node.target in (torch.ops.attn.kv_cache_write, torch.ops.attn.kv_cache_write.default) \
                    and node.kwargs.get("positions") is None:
                fused += _into_kv_cache_write(graph, node)
        except Decline as reason:
            declined(log, NAME, node, reason)
    return fused


# ---- consumers ---------------------------------------------------------------------------------


def _into_context_attention(graph: fx.Graph, node: fx.Node) -> int:
    (q_rope, q_chain, q_perm), (k_rope, k_chain, k_perm) = (_rope_under_layout(x) for x in node.args[:2])
    if q_rope is None and k_rope is None:
        return 0
    rope = _same_rotation(q_rope, k_rope, "query and key")
    if q_perm != k_perm:
        raise Decline(f"query and key reach the attention through different permutations {q_perm}, {k_perm}")
    q, k = (value(x) for x in node.args[:2])
    if not known_equal(q.shape[2], k.shape[2]):
        raise Decline(f"RoPE in the op needs Sq == Sk, got {q.shape[2]} and {k.shape[2]}")
    tables = []
    for table in (rope.cos, rope.sin):
        bhsd = insert_call(graph, node, _table_to_bhsd, (table, q_perm), meta_from=node)
        if not known_equal(value(bhsd).shape[1], 1):
            erase_unused(graph, [bhsd])
            raise Decline(f"the RoPE table {table.name} differs per head (shape {tuple(value(table).shape)})")
        tables.append(bhsd)
    new_q, new_k = _replay(graph, node, q_chain, q_rope.input), _replay(graph, node, k_chain, k_rope.input)
    _rewire(graph, node, (new_q, new_k, *node.args[2:]),
            {**node.kwargs, "cos": tables[0], "sin": tables[1], "rope_neox": rope.neox})
    erase_unused(graph, q_chain + k_chain + q_rope.nodes + k_rope.nodes)
    counters["attn"]["rope_into_context_attention"] += 1
    return 1


def _into_kv_cache_write(graph: fx.Graph, node: fx.Node) -> int:
    k_rope = _rope(_arg(node, 0, "key"))
    if k_rope is None:
        return 0
    table = value(k_rope.cos)
    if table.dim() >= 2 and not known_equal(table.shape[-2], 1):
        raise Decline(f"the RoPE table {k_rope.cos.name} differs per head (shape {tuple(table.shape)})")
    attention, q_rope = _next_paged_attention(node)
    if q_rope is not None and not _same_tables(q_rope, k_rope):
        declined(log, NAME, attention, "its query is rotated with other tables than the key written before it")
        q_rope = None
    order = {n: i for i, n in enumerate(graph.nodes)}
    if q_rope is not None and order[q_rope.input] > order[node]:
        declined(log, NAME, attention, "its unrotated query is computed after the cache write")
        q_rope = None
    pair = insert_call(graph, node, _token_rope_table, (k_rope.input, k_rope.cos, k_rope.sin, k_rope.neox))
    rope = {"positions": insert_call(graph, node, operator.getitem, (pair, 0)),
            "cos_sin_cache": insert_call(graph, node, operator.getitem, (pair, 1)), "rope_neox": k_rope.neox}
    if q_rope is not None:
        rope["query"] = q_rope.input
    args = tuple(k_rope.input if a is k_rope.node else a for a in node.args)
    kwargs = {k: k_rope.input if a is k_rope.node else a for k, a in node.kwargs.items()}
    _rewire(graph, node, args, {**kwargs, **rope})
    dead = list(k_rope.nodes)
    if q_rope is not None:
        attention.replace_input_with(q_rope.node, node)
        dead += q_rope.nodes
        counters["attn"]["rope_query_into_kv_cache_write"] += 1
    erase_unused(graph, dead)
    counters["attn"]["rope_into_kv_cache_write"] += 1
    return 1


def _rewire(graph: fx.Graph, node: fx.Node, args: tuple, kwargs: dict) -> None:
    """Give `node` new arguments if the op accepts them on the example values (its checks run
    on the fake tensors); else leave it as it was, drop the nodes made for it, and decline."""
    old = node.args, node.kwargs
    node.args, node.kwargs = args, kwargs
    try:
        node.meta["example_value"] = fake_eval(node)
    except (TypeError, ValueError) as e:
        new_inputs = set(node.all_input_nodes)
        node.args, node.kwargs = old
        erase_unused(graph, new_inputs - set(node.all_input_nodes))
        raise Decline(f"the op rejects the fused RoPE arguments: {e}") from e


def _next_paged_attention(write: fx.Node) -> tuple[fx.Node | None, Rope | None]:
    """The first paged attention after `write` that reads the cache it wrote, and its query's
    rotation (None if not rotated or not understood)."""
    k_cache, order = _arg(write, 2, "k_cache"), {n: i for i, n in enumerate(write.graph.nodes)}
    readers = [n for n in k_cache.users if n.target in _PAGED_ATTENTION and order[n] > order[write]]
    if not readers:
        return None, None
    attention = min(readers, key=order.__getitem__)
    try:
        return attention, _rope(_arg(attention, 0, "query"))
    except Decline as reason:
        declined(log, NAME, attention, reason)
        return attention, None


def _token_rope_table(key, cos, sin, neox: bool):
    """`rope_table` for rotations of `key [T, H, D]` by tables broadcastable to `[T, 1, R]`."""
    return rope_table(cos, sin, (key.shape[0], 1), neox)


def _table_to_bhsd(table, perm):
    """A table broadcastable to the rotated tensor, made 4-D and permuted as the tensor is on its
    way to the attention's `[B, H, S, D]`."""
    while table.dim() < 4:
        table = table.unsqueeze(0)
    return table.permute(perm)


# ---- matching ----------------------------------------------------------------------------------


def _arg(node: fx.Node, index: int, name: str):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


def _same_tables(a: Rope, b: Rope) -> bool:
    return a.neox == b.neox and _same_value(a.cos, b.cos) and _same_value(a.sin, b.sin) \
        and known_equal(value(a.cos).shape[-1], value(b.cos).shape[-1])


def _same_rotation(q: Rope | None, k: Rope | None, what: str) -> Rope:
    if q is None or k is None:
        raise Decline(f"only one of {what} is rotated (or its rotation is not recognized)")
    if not _same_tables(q, k):
        raise Decline(f"{what} are rotated with different tables or styles")
    return q


def _same_value(a, b, depth: int = 24) -> bool:
    """`a` and `b` are the same node, or the same call on the same values (Dynamo does not
    deduplicate GPT-J's two `repeat_interleave(sin[:, :, None, :], 2, 3)` per layer)."""
    if a is b:
        return True
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
            return len(a) == len(b) and all(_same_value(x, y, depth) for x, y in zip(a, b))
        return not isinstance(a, fx.Node) and not isinstance(b, fx.Node) and type(a) is type(b) and a == b
    if depth == 0 or a.op not in ("call_function", "call_method") or (a.op, a.target) != (b.op, b.target):
        return False
    return _same_value(a.args, b.args, depth - 1) and a.kwargs.keys() == b.kwargs.keys() \
        and all(_same_value(a.kwargs[key], b.kwargs[key], depth - 1) for key in a.kwargs)


def _rope_under_layout(x) -> tuple[Rope | None, list[fx.Node], tuple[int, ...]]:
    """`(rope, chain, perm)`: `x` is `rope.node` passed through `chain` (permutes, transposes,
    casts; `x`'s dim i is the rotated tensor's dim perm[i])."""
    chain, perm = [], (0, 1, 2, 3)
    while (c := call(x)) is not None and is_tensor(c.input) and value(c.input).dim() == 4:
        if c.name in _CASTS:
            step = (0, 1, 2, 3)
        elif c.name == "permute":
            dims = c.args[1] if len(c.args) == 2 and isinstance(c.args[1], (tuple, list)) else c.args[1:]
            if not all(isinstance(d, int) for d in dims):
                break
            step = tuple(d % 4 for d in dims)
        elif c.name in ("transpose", "swapaxes", "swapdims") and all(isinstance(d, int) for d in c.args[1:3]):
            a, b = (d % 4 for d in c.args[1:3])
            step = tuple(b if i == a else a if i == b else i for i in range(4))
        else:
            break
        if step[3] != 3:
            break
        perm = tuple(step[p] for p in perm)
        chain.append(x)
        x = c.input
    return _rope(x), chain, perm


def _replay(graph: fx.Graph, before: fx.Node, chain: list[fx.Node], start: fx.Node) -> fx.Node:
    """The ops of `chain` (last applied first in the list) applied again to `start`."""
    x = start
    for node in reversed(chain):
        args = (x, *node.args[1:])
        x = insert_call(graph, before, node.target, args, node.kwargs, method=node.op == "call_method",
                        meta_from=node)
    return x


def _rope(x) -> Rope | None:
    """The rotation that computes `x`, or None if `x` is not one."""
    c = call(x)
    if c is None or not is_tensor(x):
        return None
    if c.name == "cat":
        return _partial_rope(x, c)
    if c.name == "add" and c.kwargs.get("alpha", 1) == 1:
        return _full_rope(x, c)
    return None


def _full_rope(x: fx.Node, c) -> Rope | None:
    """`x * cos + rotate(x) * sin`, any operand order."""
    a, b = c.input, c.arg(1, "other")
    for straight, rotated in ((a, b), (b, a)):
        pr, sin = _product_with(rotated, _rotation)
        if pr is None:
            continue
        base, neox, rot_nodes = pr
        ps, cos = _product_with(straight, lambda n: n if _same_value(n, base) else None)
        if ps is None:
            continue
        _check_pair_repeated(cos, neox)
        _check_pair_repeated(sin, neox)
        return Rope(x, base, cos, sin, neox, [x, straight, rotated, ps, *rot_nodes])
    return None


def _partial_rope(x: fx.Node, c) -> Rope | None:
    """`cat([rotate(x[..., :R]), x[..., R:]], -1)`."""
    parts, dim = c.arg(0, "tensors"), c.arg(1, "dim", 0)
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or not is_tensor(x) \
            or dim not in (-1, value(x).dim() - 1):
        return None
    inner = _rope(parts[0])
    if inner is None or call(parts[0]).name != "add":
        return None
    rot_in, rest = _last_dim_slice(inner.input), _last_dim_slice(parts[1])
    if rot_in is None or rest is None or not _same_value(rot_in[0], rest[0]):
        return None
    base, (start, stop, step), (r_start, r_stop, r_step) = rot_in[0], rot_in[1], rest[1]
    r = value(inner.input).shape[-1]
    if not (start in (None, 0) and step in (None, 1) and r_stop is None and r_step in (None, 1)
            and known_equal(value(stop), r) and known_equal(value(r_start), r)):
        return None
    return Rope(x, base, inner.cos, inner.sin, inner.neox, [x, parts[0], parts[1], inner.input, *inner.nodes])


def _product_with(x, match):
    """`(match(f), other)` for `x = f * other` or `other * f` with `match(f)` not None."""
    c = call(x)
    if c is None or c.name != "mul":
        return None, None
    a, b = c.input, c.arg(1, "other")
    for f, other in ((a, b), (b, a)):
        if is_tensor(f) and is_tensor(other) and (m := match(f)) is not None:
            return m, other
    return None, None


def _rotation(x) -> tuple[fx.Node, bool, list[fx.Node]] | None:
    """`(base, neox, nodes)` for `cat((-x2, x1), -1)` (NeoX: x1, x2 the halves of base) or
    `stack((-base[..., 1::2], base[..., ::2]), -1).flatten(-2)` (GPT-J)."""
    c = call(x)
    if c is None:
        return None
    if c.name == "cat":
        parts, dim = c.arg(0, "tensors"), c.arg(1, "dim", 0)
        neox, nodes = True, [x]
    elif c.name == "flatten" and c.arg(1, "start_dim", 0) in (-2, value(x).dim() - 1) \
            and c.arg(2, "end_dim", -1) in (-1, value(x).dim() - 1):
        s = call(c.input)
        if s is None or s.name != "stack":
            return None
        parts, dim = s.arg(0, "tensors"), s.arg(1, "dim", 0)
        neox, nodes = False, [x, c.input]
        if dim not in (-1, value(c.input).dim() - 1):
            return None
    else:
        return None
    if not isinstance(parts, (list, tuple)) or len(parts) != 2:
        return None
    if neox and dim not in (-1, value(x).dim() - 1):
        return None
    neg = call(parts[0])
    if neg is None or neg.name != "neg":
        return None
    second, first = _last_dim_slice(neg.input), _last_dim_slice(parts[1])
    if second is None or first is None or not _same_value(second[0], first[0]):
        return None
    base = first[0]
    d = value(base).shape[-1]
    (s0, e0, st0), (s1, e1, st1) = first[1], second[1]
    if neox:
        ok = s0 in (None, 0) and st0 in (None, 1) and e1 is None and st1 in (None, 1) \
            and known_equal(2 * value(e0), d) and known_equal(value(s1), value(e0))
    else:
        ok = s0 in (None, 0) and e0 is None and st0 == 2 and s1 == 1 and e1 is None and st1 == 2
    return (base, neox, nodes + [parts[0], neg.input, parts[1]]) if ok else None


def _last_dim_slice(x) -> tuple[fx.Node, tuple] | None:
    """`(base, (start, stop, step))` for `base[..., start:stop:step]` (any spelling that indexes
    only the last dim)."""
    c = call(x)
    if c is None or c.name != "getitem" or not is_tensor(c.input):
        return None
    index = c.args[1] if isinstance(c.args[1], tuple) else (c.args[1],)
    ndim = value(c.input).dim()
    if not index or not isinstance(index[-1], slice):
        return None
    lead = index[:-1]
    full = slice(None)
    if lead == (Ellipsis,) or (len(lead) == ndim - 1 and all(i == full for i in lead)):
        last = index[-1]
        return c.input, (last.start, last.stop, last.step)
    return None


def _check_pair_repeated(table, neox: bool) -> None:
    """Raise unless every value of `table` is provably repeated for both elements of its pair:
    `cat([c, c], -1)` (NeoX) or `repeat_interleave(c, 2, -1)` (GPT-J), then per-element ops."""
    x = table
    while (c := call(x)) is not None and is_tensor(x):
        last = value(x).dim() - 1
        if neox and c.name == "cat":
            parts, dim = c.arg(0, "tensors"), c.arg(1, "dim", 0)
            if isinstance(parts, (list, tuple)) and len(parts) == 2 and parts[0] is parts[1] and dim in (-1, last):
                return
            break
        if not neox and c.name == "repeat_interleave":
            if c.arg(1, "repeats") == 2 and c.arg(2, "dim") in (-1, last):
                return
            break
        if c.name in _ELEMENTWISE:
            x = c.input
        elif c.name in _SCALAR_OPS:
            a, b = c.input, c.arg(1, "other")
            if is_tensor(a) == is_tensor(b):
                break
            x = a if is_tensor(a) else b
        elif c.name == "unsqueeze" and isinstance(c.arg(1, "dim"), int) and c.arg(1, "dim") not in (-1, last):
            x = c.input
        elif c.name == "expand" and is_tensor(c.input) and known_equal(value(c.input).shape[-1], value(x).shape[-1]):
            x = c.input
        elif c.name == "getitem" and _keeps_last_dim(c.args[1], value(c.input).dim()):
            x = c.input
        else:
            break
    style = "cat([c, c], -1)" if neox else "repeat_interleave(c, 2, -1)"
    raise Decline(f"RoPE table {table.name} is not provably pair-repeated ({style} then per-element ops), "
                  f"stopped at {getattr(x, 'name', x)}")


def _keeps_last_dim(index, ndim: int) -> bool:
    """Basic indexing that leaves the last dim whole (every element keeps its last-dim index)."""
    index = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, fx.Node) for i in index):
        return False
    consuming = [i for i in index if i is not None]
    if Ellipsis in consuming:
        after = consuming[consuming.index(Ellipsis) + 1:]
        return not after or after[-1] == slice(None)
    return len(consuming) < ndim or consuming[-1] == slice(None)
