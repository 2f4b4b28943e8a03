"""Proving that a float attention bias is ALiBi: per-head slopes times key positions.

An additive bias on scores `[..., Sq, Sk]` is ALiBi if it equals `slope[h] * k + r` where `k` is
the key index and `r` does not depend on `k` (it may depend on the batch, head and query index).
Softmax is shift-invariant per row, so `r` drops out, and on causal rows (`k <= q`) the rest equals
the ops' `-slope[h] * |q - k|` up to a row term. So `slope * k` (BLOOM, Falcon) and the relative
`slope * (k - q)` are the same ALiBi; the op needs a causal mask, or a mask whose rows it checks
on the device (the caller sees to it).

Hugging Face builds the bias from the slopes (`pow` of `arange`, evaluated here at compile time)
and key positions (`arange(Sk)`, or `(ones.cumsum(-1) - 1) * ones` as Falcon writes it without
padding, `(m.cumsum(-1) - 1) * m` of a padding mask `m` known at run time only), reshapes it
through `[B*H, 1, Sk]` and back, scales it, and may fold it into a float causal mask:
`masked_fill(alibi / sqrt(D), where(m, 0, min) < -1, min)` (Falcon).

`bias(x)` interprets the producers of a float tensor abstractly as a sum of `Term`s, each
`base[i[head] % H] * coef * scalars * pos(i)` at index `i`, with `pos` an `index_mask.Affine`
(integer index arithmetic, see there) and `base` the `H` per-head slopes: a concrete vector
(a constant subgraph, evaluated on the CPU: casts such as Falcon's `.bfloat16()` round the slopes
as the model does) or a module buffer/parameter read at run time. `scalars` are symbolic numbers
(float module attributes that `dynamic=True` lifts to graph inputs) that multiply or divide.
Shape ops (unsqueeze, indexing, expand, repeat, view/reshape that merge or split dims, transpose)
move `head` and `pos`; a head dim merged with an outer dim (`[B, H] -> [B*H]`) keeps
`head index = i % H`. Positions of a padding mask (`padding_positions`) are a term whose `pos`
is the key index, with `Positions` saying where they are read: their row follows the batch dim
(`row = i // inner` once merged with inner dims), which the caller matches to the scores' batch
and hands to a device-side check that they are the key index up to a row constant.
`additive_mask(x)` splits a float mask into its causal part (a bool mask that
`index_mask.causal_window` proves) and its bias. `frame_slopes` reads the per-head slopes of a
bias added to scores and `slopes_node` builds them in the graph.

Exact in real arithmetic; not reproduced: roundings of the bias itself (Falcon rounds
`slope * position` to bfloat16, half-precision models round the bias to their dtype; the op
computes `slope * |q - k|` in fp32), and the CPU evaluation of a constant slope expression may
differ from the device's by an ulp.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx
from torch._dynamo.source import AttrSource, DictGetItemSource
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import index_mask
from .index_mask import Affine
from .torch_ir import Decline, call, graph_constant, insert_call, is_tensor, known_equal, value

_CASTS = {"to", "type", "type_as", "float", "half", "bfloat16", "double", "contiguous", "clone"}
# what a constant subgraph may compute (it is run on the CPU at compile time)
_CONSTANT_OPS = _CASTS | {
    "full", "tensor", "arange", "linspace", "ones", "zeros", "pow", "rpow", "exp", "exp2", "log", "log2", "sqrt",
    "rsqrt", "reciprocal", "mul", "div", "add", "sub", "rsub", "neg", "cat", "stack", "getitem", "unsqueeze",
    "view", "reshape", "flatten", "expand", "repeat"}
_SHAPE_OPS = {"unsqueeze", "getitem", "expand", "expand_as", "repeat", "transpose", "swapaxes", "swapdims", "permute",
              "view", "reshape", "flatten"}
_CONSTANT_NUMEL = 1 << 16
_MAX_TERMS = 16


@dataclasses.dataclass(frozen=True)
class Positions:
    """Run-time positions `node [B, S]` (see `padding_positions`) read at index `i` of a tensor as
    `node[i[batch] // inner, k]`, `k` the dim where the term's `pos` varies (`batch` None: one row)."""

    node: fx.Node
    batch: int | None
    inner: Any = 1


@dataclasses.dataclass(frozen=True)
class Term:
    """`base[i[head] % H] * coef * scalars * pos(i)` at index `i` of a tensor. With `positions`,
    `pos(i)` stands for the positions' value there, which differs from it by a run-time term
    (`padding_positions`): the rewrite checks on the device that this term is constant over the
    keys each query sees."""

    base: Any           # float64 tensor [H] (concrete), or a node of a buffer/parameter with H elements
    head: int | None    # the dim whose index picks the slope; None: H == 1
    pos: Affine         # aligned to the tensor's dims
    coef: float = 1.0
    scalars: tuple = ()  # ((node of a symbolic number, divides), ...)
    positions: Positions | None = None

    @property
    def heads(self) -> int:
        return self.base.numel() if isinstance(self.base, torch.Tensor) else value(self.base).numel()

    @property
    def is_constant(self) -> bool:
        """The same known number at every index (up to `base`, `coef` and `scalars`)."""
        return self.positions is None and self.pos.is_known and isinstance(self.pos.const, int)

    def aligned(self, ndim: int) -> "Term":
        shift = ndim - len(self.pos.coef)
        return self.moved(lambda d: d + shift, pos=self.pos.aligned(ndim))

    def moved(self, dim, **changes) -> "Term | None":
        """The term with its head and batch dims `d` at `dim(d)` (None: not kept whole) and `changes`."""
        head = None if self.head is None else dim(self.head)
        positions = self.positions
        if positions is not None and positions.batch is not None:
            batch = dim(positions.batch)
            if batch is None:
                return None
            positions = dataclasses.replace(positions, batch=batch)
        if self.head is not None and head is None:
            return None
        return dataclasses.replace(self, head=head, positions=positions, **changes)


def _constant_term(x: float) -> Term:
    return Term(torch.tensor([float(x)], dtype=torch.float64), None, Affine((), 1))


def bias(x: Any, nodes: list) -> tuple[Term, ...] | None:
    """The terms of float tensor (or number) `x`, or None if not understood; collects the nodes it
    read into `nodes`."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return (_constant_term(x),)
    if not is_tensor(x):
        return None
    v = value(x)
    c = call(x)
    if not v.dtype.is_floating_point:
        a = index_mask.analyze(x, nodes)
        if isinstance(a, Affine):
            return (Term(torch.ones(1, dtype=torch.float64), None, a),)
        result = padding_positions(x)
        if result is None and c is not None and c.name in _SHAPE_OPS:
            result = _eval(c, x, v, nodes)
        return None if result is None else _normalized(result, v.shape)
    result = _eval(c, x, v, nodes) if c is not None else None
    if result is None:
        result = _per_head(x, v)
    if result is None or len(result) > _MAX_TERMS:
        return None
    nodes.append(x)
    return _normalized(result, v.shape)


def padding_positions(x: Any) -> tuple[Term] | None:
    """`x` as one term with run-time positions if it is `(cumsum(m, -1) - 1) * m` (either order)
    of a 2-D integer or bool `m [B, S]`: Hugging Face's positions of a padded attention mask
    (BLOOM's and Falcon's ALiBi). Where `m` is 0/1 with its ones in one run from `c_b`, they are
    `k - c_b` on the ones: the key index up to a per-row term, not on the zeros."""
    c = call(x)
    if c is None or c.name != "mul" or value(x).dim() != 2 or c.kwargs:
        return None
    for left, m in ((c.input, c.arg(1, "other")), (c.arg(1, "other"), c.input)):
        sub, one, cumsum = call(left), None, None
        if sub is not None and sub.name == "sub" and not sub.kwargs:
            one, cumsum = sub.arg(1, "other"), call(sub.input)
        if one == 1 and not isinstance(one, bool) and cumsum is not None and cumsum.name == "cumsum" \
                and cumsum.input is m and cumsum.arg(1, "dim") in (-1, 1) and is_tensor(m) \
                and not value(m).dtype.is_floating_point and known_equal(value(m).shape, value(x).shape):
            batch = None if known_equal(value(x).shape[0], 1) else 0
            return (Term(torch.ones(1, dtype=torch.float64), None, Affine((0, 1)), positions=Positions(x, batch)),)
    return None


def _per_head(x: fx.Node, v: torch.Tensor) -> tuple[Term, ...] | None:
    """`x` as one term if it is a constant or a buffer that varies along at most one dim."""
    varying = [d for d, s in enumerate(v.shape) if not known_equal(s, 1)]
    if len(varying) > 1:
        return None
    head = varying[0] if varying else None
    pos = Affine((0,) * v.dim(), 1)
    if is_buffer(x) and all(isinstance(s, int) for s in v.shape):
        return (Term(x, head, pos),)
    t = constant_value(x)
    if t is None:
        return None
    return (Term(t.detach().double().reshape(-1), head, pos),)


def is_buffer(x: Any) -> bool:
    """A module buffer or parameter: an attribute of the graph, or an input Dynamo took from one."""
    if not isinstance(x, fx.Node):
        return False
    if x.op == "get_attr":
        return True
    source = getattr(x.meta.get("grapharg"), "source", None)
    return x.op == "placeholder" and isinstance(source, DictGetItemSource) \
        and isinstance(source.base, AttrSource) and source.base.member in ("_buffers", "_parameters")


def constant_value(x: Any, memo: dict | None = None) -> torch.Tensor | None:
    """The value of `x` (on the CPU) if a small subgraph of constants computes it, else None."""
    memo = {} if memo is None else memo
    if not isinstance(x, fx.Node):
        return None
    if x in memo:
        return memo[x]
    memo[x] = None
    c, v = call(x), value(x)
    if c is None or c.name not in _CONSTANT_OPS or not isinstance(v, torch.Tensor) \
            or not all(isinstance(s, int) for s in v.shape) or v.numel() > _CONSTANT_NUMEL:
        return None
    ok = True

    def concrete(a):
        nonlocal ok
        if isinstance(a, fx.Node):
            t = constant_value(a, memo)
            ok = ok and t is not None
            return t
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            ok = False
        return torch.device("cpu") if isinstance(a, torch.device) else a

    args, kwargs = torch.utils._pytree.tree_map(concrete, (x.args, x.kwargs))
    if not ok:
        return None
    try:
        with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.no_grad():
            if x.op == "call_method":
                t = getattr(args[0], x.target)(*args[1:], **kwargs)
            else:
                t = x.target(*args, **kwargs)
    except Exception:  # an argument this evaluation cannot reproduce: not a constant
        return None
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.dtype != v.dtype \
            or tuple(t.shape) != tuple(v.shape):
        return None
    memo[x] = t
    return t


def _eval(c, x: fx.Node, v: torch.Tensor, nodes: list) -> tuple[Term, ...] | None:
    name, n = c.name, v.dim()
    if name in _CASTS:
        terms = bias(c.input, nodes)
        return None if terms is None else tuple(_rounded(t, v.dtype) for t in terms)
    if name in ("mul", "div") and c.kwargs.get("rounding_mode") is None:
        a, other = c.input, c.arg(1, "other")
        if name == "mul" and _is_scalar(a):
            a, other = other, a
        terms = bias(a, nodes)
        if terms is None:
            return None
        if _is_scalar(other):
            return tuple(dataclasses.replace(t, scalars=t.scalars + ((other, name == "div"),)) for t in terms)
        if name == "div":
            if isinstance(other, bool) or not isinstance(other, (int, float)) or other == 0:
                return None
            return _scaled(terms, 1.0 / other)
        return _times(terms, bias(other, nodes), n)
    if name in ("add", "sub") and c.kwargs.get("alpha", 1) == 1:
        a, b = bias(c.input, nodes), bias(c.arg(1, "other"), nodes)
        if a is None or b is None:
            return None
        return _plus(a, _scaled(b, -1.0) if name == "sub" else b, n)
    if name == "neg":
        a = bias(c.input, nodes)
        return None if a is None else _scaled(a, -1.0)
    if name not in _SHAPE_OPS or not is_tensor(c.input) or value(c.input).dtype != v.dtype:
        return None
    a = bias(c.input, nodes)
    return None if a is None else _shape_op(c, a, value(c.input).shape, v.shape)


def _rounded(t: Term, dtype: torch.dtype) -> Term:
    """`t` cast to `dtype`: a constant per-head value is rounded as the model rounds it (e.g.
    Falcon's bfloat16 slopes); the rounding of a product with positions is not modelled."""
    if not (isinstance(t.base, torch.Tensor) and t.is_constant and not t.scalars):
        return t
    rounded = (t.base * (t.coef * t.pos.const)).to(dtype).double()
    return Term(rounded, t.head, Affine((0,) * len(t.pos.coef), 1))


def _is_scalar(x) -> bool:
    """A node of a symbolic number (e.g. `t.item()` of a lifted float attribute)."""
    return isinstance(x, fx.Node) and isinstance(value(x), (torch.SymFloat, torch.SymInt, float, int)) \
        and not isinstance(value(x), bool)


def _scaled(terms, k: float) -> tuple[Term, ...]:
    return tuple(dataclasses.replace(t, coef=t.coef * k) for t in terms)


def _plus(a, b, ndim: int) -> tuple[Term, ...]:
    return tuple(t.aligned(ndim) for t in a) + tuple(t.aligned(ndim) for t in b)


def _times(a, b, ndim: int) -> tuple[Term, ...] | None:
    if a is None or b is None:
        return None
    products = [_product(s.aligned(ndim), t.aligned(ndim)) for s in a for t in b]
    return None if any(p is None for p in products) else tuple(products)


def _product(s: Term, t: Term) -> Term | None:
    """`s * t` if it is a term: one factor has a constant position and one is one number or both
    bases are concrete vectors along the same dim."""
    if s.is_constant:
        pos, positions = t.pos.scaled(s.pos.const), t.positions
    elif t.is_constant:
        pos, positions = s.pos.scaled(t.pos.const), s.positions
    else:
        return None
    coef, scalars = s.coef * t.coef, s.scalars + t.scalars
    if isinstance(t.base, torch.Tensor) and t.head is None:
        s, t = t, s
    if isinstance(s.base, torch.Tensor) and s.head is None:
        return Term(t.base, t.head, pos, coef * float(s.base[0]), scalars, positions)
    if isinstance(s.base, torch.Tensor) and isinstance(t.base, torch.Tensor) and s.head == t.head \
            and s.heads == t.heads:
        return Term(s.base * t.base, s.head, pos, coef, scalars, positions)
    return None


def _normalized(terms, shape) -> tuple[Term, ...] | None:
    """Size-1 dims have index 0: no position coefficient there, and a head dim of size 1 picks the
    first slope. A head dim's size is a multiple of H (so that `i % H` is the head). A batch dim
    of size 1 reads the positions' first row: they must have one."""
    out = []
    for t in terms:
        t = t.aligned(len(shape))
        pos = Affine(tuple(0 if known_equal(s, 1) else k for k, s in zip(t.pos.coef, shape)), t.pos.const,
                     t.pos.runtime)
        head, base, positions = t.head, t.base, t.positions
        if head is not None and known_equal(shape[head], 1):
            if not isinstance(base, torch.Tensor):
                return None
            head, base = None, base[:1]
        if head is None and t.heads != 1:
            return None
        if head is not None and not statically_known_true(shape[head] % t.heads == 0):
            return None
        if positions is not None and positions.batch is not None and known_equal(shape[positions.batch], 1):
            if not known_equal(value(positions.node).shape[0], 1):
                return None
            positions = Positions(positions.node, None)
        out.append(Term(base, head, pos, t.coef, t.scalars, positions))
    return tuple(out)


def _shape_op(c, terms, src, dst) -> tuple[Term, ...] | None:
    """The terms after a shape op from shape `src` to shape `dst`."""
    name, n = c.name, len(src)
    if name == "unsqueeze":
        d = c.arg(1, "dim")
        if not isinstance(d, int):
            return None
        d %= n + 1
        return _all(t.moved(lambda e: e + (e >= d), pos=Affine(t.pos.coef[:d] + (0,) + t.pos.coef[d:], t.pos.const,
                                                               t.pos.runtime)) for t in terms)
    if name == "getitem":
        return _getitem(terms, n, c.args[1])
    if name in ("expand", "expand_as"):
        return tuple(t.aligned(len(dst)) for t in terms)  # expanded dims have size 1: nothing varies there
    if name == "repeat":
        reps = c.args[1] if len(c.args) == 2 and isinstance(c.args[1], (tuple, list)) else c.args[1:]
        reps = [value(r) for r in reps]
        out = [t.aligned(len(dst)) for t in terms]
        if any(k and not known_equal(r, 1) for t in out for k, r in zip(t.pos.coef, reps)):
            return None  # a repeated dim's index wraps around: not affine
        if any(t.positions is not None and t.positions.batch is not None and not known_equal(reps[t.positions.batch], 1)
               for t in out):
            return None  # nor is the row of the positions
        return tuple(out)
    if name in ("transpose", "swapaxes", "swapdims", "permute"):
        if name == "permute":
            order = c.args[1] if len(c.args) == 2 and isinstance(c.args[1], (tuple, list)) else c.args[1:]
        else:
            d0, d1 = c.arg(1, "dim0"), c.arg(2, "dim1")
            if not (isinstance(d0, int) and isinstance(d1, int)):
                return None
            order = list(range(n))
            order[d0 % n], order[d1 % n] = order[d1 % n], order[d0 % n]
        if not all(isinstance(d, int) for d in order):
            return None
        order = [d % n for d in order]
        return _all(t.moved(order.index, pos=Affine(tuple(t.pos.coef[d] for d in order), t.pos.const, t.pos.runtime))
                    for t in terms)
    if name in ("view", "reshape", "flatten"):
        return _reshaped(terms, src, dst)
    return None


def _all(terms) -> tuple[Term, ...] | None:
    terms = tuple(terms)
    return None if any(t is None for t in terms) else terms


def _getitem(terms, ndim: int, index) -> tuple[Term, ...] | None:
    """Basic indexing; the head and batch dims must be kept whole (a full slice), and so must the
    keys of run-time positions if they stay."""
    index = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, fx.Node) for i in index):
        return None

    def kept(d: int) -> int | None:
        marker = index_mask.basic_index(Affine(tuple(int(e == d) for e in range(ndim))), ndim, index)
        if marker is None or marker.const != 0 or sorted(marker.coef) != [0] * (len(marker.coef) - 1) + [1]:
            return None
        return marker.coef.index(1)

    out = []
    for t in terms:
        pos = index_mask.basic_index(t.pos, ndim, index)
        if pos is None:
            return None
        if t.positions is not None and any(pos.coef) and (
                pos.const != t.pos.const or sorted(filter(None, pos.coef)) != sorted(filter(None, t.pos.coef))):
            return None  # the positions read from an offset or with a step
        out.append(t.moved(kept, pos=pos))
    return _all(out)


def _reshaped(terms, src, dst) -> tuple[Term, ...] | None:
    """A view from `src` to `dst`: positions may vary only along dims the view keeps; the head dim
    may be the innermost of dims merged into one, or split with an innermost dim that H divides."""
    groups = _dim_groups(src, dst)
    if groups is None:
        return None
    out = []
    for t in terms:
        coef, head = [0] * len(dst), None
        for into, outof in groups:
            varying = [d for d in into if t.pos.coef[d]]
            if varying and not (len(into) == 1 and len(outof) == 1):
                return None
            if varying:
                coef[outof[0]] = t.pos.coef[into[0]]
            if t.head in into:
                if len(outof) == 1 and t.head == into[-1]:
                    head = outof[0]
                elif len(into) == 1 and statically_known_true(dst[outof[-1]] % t.heads == 0):
                    head = outof[-1]
                else:
                    return None
        if t.head is not None and head is None:
            return None
        positions = t.positions
        if positions is not None and positions.batch is not None:
            positions = _batch_reshaped(positions, groups, src, dst)
            if positions is None:
                return None
        out.append(Term(t.base, head, Affine(tuple(coef), t.pos.const, t.pos.runtime), t.coef, t.scalars, positions))
    return tuple(out)


def _batch_reshaped(p: Positions, groups, src, dst) -> Positions | None:
    """`p` after a view: its batch dim may be the outermost of dims merged into one (the row is
    the index // the inner dims' size), or split from one whose inner dims are those of a merge."""
    for into, outof in groups:
        if p.batch not in into:
            continue
        if len(outof) == 1 and p.batch == into[0]:
            inner = p.inner
            for d in into[1:]:
                inner = inner * src[d]
            return Positions(p.node, outof[0], inner)
        rest = 1
        for d in outof[1:]:
            rest = rest * dst[d]
        return Positions(p.node, outof[0], 1) if len(into) == 1 and known_equal(p.inner, rest) else None
    return None


def _dim_groups(src, dst) -> list[tuple[list[int], list[int]]] | None:
    """The dims of size other than 1 of `src` and `dst` in consecutive groups of equal size, e.g.
    `[B, H, S] -> [B*H, 1, S]`: `([0, 1], [0]), ([2], [2])`; None if the sizes do not line up."""
    a = [d for d, s in enumerate(src) if not known_equal(s, 1)]
    b = [d for d, s in enumerate(dst) if not known_equal(s, 1)]
    groups, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        into, outof = [a[i]], [b[j]]
        p, q = src[a[i]], dst[b[j]]
        i, j = i + 1, j + 1
        while not known_equal(p, q):
            if i < len(a) and statically_known_true(q % p == 0):
                p, i = p * src[a[i]], i + 1
                into.append(a[i - 1])
            elif j < len(b) and statically_known_true(p % q == 0):
                q, j = q * dst[b[j]], j + 1
                outof.append(b[j - 1])
            else:
                return None
        groups.append((into, outof))
    return groups if i == len(a) and j == len(b) else None


def additive_mask(x: Any, nodes: list) -> tuple[int | None, tuple[Term, ...] | None] | None:
    """`(window, terms)` of a float additive mask: `window` is the causal part's (see
    `index_mask.causal_window`; None: no causal part), `terms` the bias (None: none). Understood:
    `where(m, 0 or b, min)`, `masked_fill(b, not m, min)` (`not m` also as `where(m, 0, min) < c`
    for a `c` between), sums of those and of biases `b`. None if not understood."""
    if not is_tensor(x) or not value(x).dtype.is_floating_point:
        return None
    c = call(x)
    if c is None:
        terms = bias(x, nodes)
        return None if terms is None else (None, terms)
    if c.name in _CASTS:
        return additive_mask(c.input, nodes)
    if c.name == "where" and _is_bool(c.input) and _is_fill(c.arg(2, "other"), value(x).dtype):
        return _masked(c.input, c.arg(1, "input"), x, nodes)
    if c.name == "masked_fill" and _is_fill(c.arg(2, "value"), value(x).dtype):
        keep = _negation(c.arg(1, "mask"), nodes)
        return None if keep is None else _masked(keep, c.input, x, nodes)
    if c.name == "add" and c.kwargs.get("alpha", 1) == 1:
        a, b = additive_mask(c.input, nodes), additive_mask(c.arg(1, "other"), nodes)
        if a is None or b is None or (a[0] is not None and b[0] is not None):
            return None
        window = a[0] if a[0] is not None else b[0]
        terms = [t for t in (a[1], b[1]) if t is not None]
        nodes.append(x)
        return window, (_plus(*terms, value(x).dim()) if len(terms) == 2 else terms[0] if terms else None)
    terms = bias(x, nodes)
    return None if terms is None else (None, terms)


def kept_keys(x: Any, nodes: list) -> fx.Node | None:
    """`m` if float mask `x` is `where(m, 0, -inf or finfo.min)` of a bool `m` (any pattern: the
    keys each query sees); collects the nodes it read into `nodes`."""
    c = call(x)
    if c is None or c.name != "where" or not _is_bool(c.input) or not _is_fill(c.arg(2, "other"), value(x).dtype) \
            or not _is_zero(c.arg(1, "input")):
        return None
    nodes += [x, *([c.arg(1, "input")] if isinstance(c.arg(1, "input"), fx.Node) else [])]
    return c.input


def masked_bias(x: Any, nodes: list) -> tuple[fx.Node, tuple[Term, ...]] | None:
    """`(m, terms)` if float mask `x` is `where(m, b, min)` or `masked_fill(b, not m, min)` of a
    bool `m` of any pattern (e.g. causal and padding) and a bias `b` that is not zero (Falcon's
    ALiBi folded into a padded mask); collects the nodes it read into `nodes`."""
    c = call(x)
    if c is None or not value(x).dtype.is_floating_point:
        return None
    if c.name in _CASTS:
        return masked_bias(c.input, nodes)
    read = []
    if c.name == "where" and _is_bool(c.input) and _is_fill(c.arg(2, "other"), value(x).dtype):
        keep, kept = c.input, c.arg(1, "input")
    elif c.name == "masked_fill" and _is_fill(c.arg(2, "value"), value(x).dtype):
        keep, kept = _negation(c.arg(1, "mask"), read), c.input
    else:
        return None
    terms = None if keep is None or _is_zero(kept) else bias(kept, read)
    if terms is None:
        return None
    nodes += [*read, x]
    return keep, terms


def _masked(keep, kept: Any, x: fx.Node, nodes: list) -> tuple[int, tuple[Term, ...] | None] | None:
    """`kept` where bool `keep` holds, the fill elsewhere."""
    window = index_mask.causal_window(keep, nodes)
    if window is None:
        return None
    nodes.append(x)
    if _is_zero(kept):
        if isinstance(kept, fx.Node):
            nodes.append(kept)
        return window, None
    terms = bias(kept, nodes)
    return None if terms is None else (window, terms)


def _negation(mask, nodes: list) -> fx.Node | None:
    """`m` if bool `mask` is `not m`: `~m`, `logical_not(m)`, `m == 0`, or `where(m, a, f) < c`
    (or `<=`) with `a >= c > f` (`a > c >= f`), all numbers."""
    c = call(mask)
    if c is None or not _is_bool(mask):
        return None
    if c.name in ("logical_not", "invert") or (c.name == "eq" and c.arg(1, "other") in (0, False)):
        if _is_bool(c.input):
            nodes.append(mask)
            return c.input
        return None
    if c.name in ("lt", "le") and isinstance(c.arg(1, "other"), (int, float)):
        w, bound = call(c.input), c.arg(1, "other")
        if w is None or w.name != "where" or not _is_bool(w.input):
            return None
        kept, fill = _number(w.arg(1, "input")), _number(w.arg(2, "other"))
        if kept is None or fill is None:
            return None
        below = operator.lt if c.name == "lt" else operator.le
        if below(fill, bound) and not below(kept, bound):
            nodes += [mask, c.input]
            return w.input
    return None


def _number(x) -> float | None:
    """A Python number, or the value of a one-element constant tensor."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    t = constant_value(x)
    return float(t) if t is not None and t.numel() == 1 else None


def _is_zero(x) -> bool:
    if isinstance(x, bool) or not isinstance(x, (int, float, fx.Node)):
        return False
    if isinstance(x, (int, float)):
        return x == 0
    t = constant_value(x)
    return t is not None and not t.any()


def _is_fill(fill, dtype: torch.dtype) -> bool:
    return isinstance(fill, (int, float)) and not isinstance(fill, bool) and fill <= torch.finfo(dtype).min


def _is_bool(x) -> bool:
    return is_tensor(x) and value(x).dtype == torch.bool


def frame_slopes(terms, shape, scores_shape, head_dim: int, num_heads: int) -> list[Term]:
    """The per-head slopes of `terms` (of a bias of `shape`) added to scores of `scores_shape`
    whose dim `head_dim` indexes the heads (`[B, H, Sq, Sk]`: 1) or batch and heads with the head
    innermost (`[B*H, Sq, Sk]`: 0), keys last: terms `base [H] * coef * scalars` (position dropped,
    its key coefficient in `coef`; terms constant along the keys drop out of the softmax), with
    their run-time positions if they read some along the keys: those must be `[B, Sk]` (or one
    row), row b for batch b of the scores. Raises Decline if a term does not vary as per-head
    slopes times the key index."""
    n = len(scores_shape)
    if len(shape) > n or not all(known_equal(s, 1) or known_equal(s, f)
                                 for s, f in zip(shape, scores_shape[n - len(shape):])):
        raise Decline(f"bias of shape {tuple(shape)} does not broadcast to the scores {tuple(scores_shape)}")
    out = []
    for t in terms:
        t = t.aligned(n)
        if t.head is not None and t.head != head_dim:
            raise Decline(f"the bias has a per-head factor along dim {t.head} of {tuple(shape)}, not along the heads")
        if t.heads != 1 and num_heads % t.heads:
            raise Decline(f"{t.heads} slopes for {num_heads} heads")
        if t.heads not in (1, num_heads) and not isinstance(t.base, torch.Tensor):
            raise Decline(f"a slope buffer of {t.heads} values for {num_heads} heads")
        k = t.pos.coef[-1]
        if k and t.positions is not None:
            _check_positions(t.positions, scores_shape, head_dim, num_heads)
        if k:
            out.append(Term(t.base, t.head, Affine(()), t.coef * k, t.scalars, t.positions))
    return out


def _check_positions(p: Positions, scores_shape, head_dim: int, num_heads: int) -> None:
    """Positions `[B, Sk]` read at the scores' keys, row b at batch b: `[B, H, Sq, Sk]` scores
    (`head_dim` 1) from their dim 0, `[B*H, Sq, Sk]` ones (`head_dim` 0) from dim 0 // H."""
    rows, keys = value(p.node).shape
    per_row = num_heads if head_dim == 0 else 1
    if not known_equal(keys, scores_shape[-1]):
        raise Decline(f"positions of {keys} keys for scores over {scores_shape[-1]} keys")
    if p.batch is None:
        return
    if p.batch != 0 or not known_equal(p.inner, per_row) or not known_equal(rows * per_row, scores_shape[0]):
        raise Decline(f"the rows of the positions {p.node.name} are not the batch of the scores")


def example_slopes(q: torch.Tensor, present) -> torch.Tensor | None:
    """Fake float32 slopes `[Hq]` for a replacement's example output, None without ALiBi; `q`:
    the fake query `[B, Hq, S, D]`."""
    if not present:
        return None
    with q.fake_mode:
        return torch.zeros(q.shape[1], dtype=torch.float32, device=q.device)


def slopes_node(graph: fx.Graph, before: fx.Node, terms: list[Term], num_heads: int, device) -> fx.Node:
    """A node computing the fp32 `[num_heads]` slopes that `terms` sum to (from `frame_slopes`):
    constant terms fold into one graph constant; buffers and symbolic factors are read at run time."""
    fixed = [t for t in terms if isinstance(t.base, torch.Tensor) and not t.scalars]
    rest = [t for t in terms if not (isinstance(t.base, torch.Tensor) and not t.scalars)]
    total = None
    if fixed:
        values = sum(_per_query_head(t.base, num_heads) * t.coef for t in fixed)
        total = graph_constant(graph, values.float().tolist(), torch.float32, device)
    for t in rest:
        if isinstance(t.base, torch.Tensor):
            x = graph_constant(graph, (_per_query_head(t.base, num_heads) * t.coef).float().tolist(), torch.float32,
                               device)
        else:
            x = insert_call(graph, before, "float", (insert_call(graph, before, "reshape", (t.base, -1), method=True),),
                            method=True)
            if t.heads != num_heads:
                x = insert_call(graph, before, "repeat", (x, num_heads), method=True)
            if t.coef != 1.0:
                x = insert_call(graph, before, operator.mul, (x, t.coef))
        for s, divides in t.scalars:
            x = insert_call(graph, before, operator.truediv if divides else operator.mul, (x, s))
        total = x if total is None else insert_call(graph, before, operator.add, (total, x))
    return total


def _per_query_head(base: torch.Tensor, num_heads: int) -> torch.Tensor:
    return base.repeat(num_heads // base.numel())
