"""Proving that a boolean mask computed in the graph from indices is the plain causal mask.

Hugging Face's `create_causal_mask` (transformers 5) does not skip the mask under torch.compile
before torch 2.14 (Dynamo folded `torch.compiler.is_exporting()` to True), so every SDPA and
eager attention of a Llama, GPT-NeoX or GPT-J gets a materialized mask, built by index arithmetic:

    position_ids = (arange(S) + past).unsqueeze(0).expand(B, -1)
    packed = cumsum(diff(position_ids, prepend=position_ids[:, :1] - 1) != 1, -1)  # packed sequences
    b, q, kv = arange(B)[:, None, None, None], (arange(S) + past)[None, None, :, None], ...
    mask = ones((), bool) & (packed[b, q] == packed[b, kv]) & (position_ids[b, kv] <= position_ids[b, q])

`is_causal(mask)` decides, for every value of the symbolic sizes, whether such a mask is true
exactly where `key index <= query index` (top-left causal) and does not depend on the batch or
head index. `is_key_prefix(mask)` decides whether a one-query mask keeps the same prefix of the
keys in every row, of a length known only at run time: a decode step over a static cache,
`arange(S_max) <= arange(1) + cumulative_length`. It interprets the mask's producers abstractly,
over two kinds of value:

* `Affine`: an integer tensor whose element at index `i` is `const + sum(coef[d] * i[d])`;
* `Conj`: a bool tensor that is true at `i` iff `a(i) >= 0` for each `Affine` `a` of `ge`
  (the empty conjunction is true everywhere).

An integer tensor of one element that it cannot follow further (an input such as a static
cache's token count, or an op it does not understand) is a run-time constant: a term of `const`
whose value is unknown (`Affine.runtime`), so only `is_key_prefix` can use it. Any other op it
does not understand, or any other input (a user's padding mask, position ids passed in, a
buffer), makes the answer "not recognized". Integer arithmetic is exact (no
overflow at index magnitudes); tensor indices must be provably non-negative (a negative index
wraps around).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .torch_ir import call, is_tensor, known_equal, value


@dataclasses.dataclass(frozen=True)
class Affine:
    coef: tuple[int, ...]
    const: Any = 0  # int or SymInt
    runtime: tuple[tuple[fx.Node, int], ...] = ()  # + sum(k * value of node): one-element tensors

    def aligned(self, ndim: int) -> "Affine":
        return Affine((0,) * (ndim - len(self.coef)) + self.coef, self.const, self.runtime)

    def plus(self, other: "Affine", sign: int = 1) -> "Affine":
        n = max(len(self.coef), len(other.coef))
        a, b = self.aligned(n), other.aligned(n)
        runtime = dict(a.runtime)
        for node, k in b.runtime:
            runtime[node] = runtime.get(node, 0) + sign * k
        return Affine(tuple(x + sign * y for x, y in zip(a.coef, b.coef)), a.const + sign * b.const,
                      tuple(sorted(((n, k) for n, k in runtime.items() if k), key=lambda nk: nk[0].name)))

    def scaled(self, k: int) -> "Affine":
        return Affine(tuple(k * c for c in self.coef), k * self.const, tuple((n, k * c) for n, c in self.runtime))

    @property
    def is_constant(self) -> bool:
        """The same value at every index (possibly a run-time value)."""
        return not any(self.coef)

    @property
    def is_known(self) -> bool:
        """Constant and free of run-time values: decidable at compile time."""
        return self.is_constant and not self.runtime


@dataclasses.dataclass(frozen=True)
class Conj:
    ge: tuple[Affine, ...] = ()


TRUE, FALSE = Conj(), Conj((Affine((), -1),))
_COMPARE = {"le": (-1, 0), "lt": (-1, -1), "ge": (1, 0), "gt": (1, -1)}  # x op y  <=>  sign*(x-y) + off >= 0


def is_causal(mask: fx.Node, nodes: list | None = None) -> bool:
    """Whether bool `mask [..., Sq, Sk]` is true exactly where `k <= q`, whatever the leading
    indices; collects the nodes it read into `nodes`."""
    return causal_window(mask, nodes) == -1


def causal_window(mask: fx.Node, nodes: list | None = None) -> int | None:
    """For bool `mask [..., Sq, Sk]` true exactly where `q - w <= k <= q` whatever the leading
    indices (a sliding window: the query's own key and the `w` before it), `w`; -1 for the plain
    causal mask (`k <= q`); None for any other mask. Collects the nodes it read into `nodes`."""
    if not is_tensor(mask) or value(mask).dtype != torch.bool or value(mask).dim() < 2:
        return None
    result = analyze(mask, nodes if nodes is not None else [])
    if not isinstance(result, Conj):
        return None
    n = value(mask).dim()
    causal, window = (0,) * (n - 2) + (1, -1), (0,) * (n - 2) + (-1, 1)   # q - k + c >= 0, k - q + c >= 0
    left = _nontrivial(result, n)
    if any(a.runtime or a.coef not in (causal, window) or not isinstance(a.const, int) for a in left):
        return None
    upper = [a.const for a in left if a.coef == causal]
    lower = [a.const for a in left if a.coef == window]
    if not upper or min(upper) != 0 or (lower and min(lower) < 0):
        return None
    return min(lower) if lower else -1


def is_key_prefix(mask: fx.Node, nodes: list | None = None) -> bool:
    """Whether bool `mask [..., 1, Sk]` (one query) is true exactly at keys `k < n` for one
    count `n` (possibly a run-time value, e.g. a static cache's filled length) at every leading
    index: then `n` is the number of true keys in any row. Collects the nodes it read."""
    if not is_tensor(mask) or value(mask).dtype != torch.bool or value(mask).dim() < 2 \
            or not known_equal(value(mask).shape[-2], 1):
        return False
    result = analyze(mask, nodes if nodes is not None else [])
    if not isinstance(result, Conj):
        return False
    n = value(mask).dim()
    key_upper_bound = (0,) * (n - 1) + (-1,)  # k <= c  <=>  -k + c >= 0
    return all(a.coef == key_upper_bound for a in _nontrivial(result, n))


def _nontrivial(result: Conj, ndim: int) -> list[Affine]:
    """The conditions of `result` that are not known to hold everywhere."""
    return [a.aligned(ndim) for a in result.ge if not (a.is_known and statically_known_true(a.const >= 0))]


def analyze(x: Any, nodes: list) -> Affine | Conj | None:
    """The abstract value of `x` (a node, or a Python int/bool), or None if not understood."""
    if isinstance(x, bool):
        return TRUE if x else FALSE
    if isinstance(x, (int, torch.SymInt)):
        return Affine((), x)
    if not is_tensor(x):
        return None
    v = value(x)
    if v.dtype.is_floating_point or v.dtype.is_complex:
        return None
    c = call(x)
    result = _eval(c, v, nodes) if c is not None else None
    if result is None:
        if v.dtype == torch.bool or not all(known_equal(s, 1) for s in v.shape):
            return None
        result = Affine((0,) * v.dim(), 0, ((x, 1),))  # one integer of unknown value (an input, ...)
    nodes.append(x)
    return _normalized(result, v.shape)


def _normalized(r: Affine | Conj, shape) -> Affine | Conj:
    """Coefficients of size-1 dims are irrelevant (their index is 0): zero them."""
    def norm(a: Affine) -> Affine:
        a = a.aligned(len(shape))
        return Affine(tuple(0 if known_equal(s, 1) else k for k, s in zip(a.coef, shape)), a.const, a.runtime)

    return norm(r) if isinstance(r, Affine) else Conj(tuple(norm(a) for a in r.ge))


def _eval(c, v: torch.Tensor, nodes: list) -> Affine | Conj | None:
    name, args, is_bool = c.name, c.args, v.dtype == torch.bool
    if name == "arange":
        if c.kwargs.get("start") is not None or c.kwargs.get("end") is not None:
            return None
        bounds = list(args) + [None] * (3 - len(args))
        start, step = (0, 1) if len(args) == 1 else (args[0], bounds[2] if bounds[2] is not None else 1)
        step = c.kwargs.get("step", step)
        ok = all(isinstance(b, (int, torch.SymInt)) and not isinstance(b, bool) for b in (start, step))
        return Affine((step,), start) if ok and isinstance(step, int) else None
    if name in ("to", "contiguous", "clone", "long", "int", "bool"):
        inner = analyze(c.input, nodes)
        return inner if inner is not None and _same_kind(inner, is_bool) else None
    if name in ("ones", "new_ones", "ones_like", "zeros", "new_zeros", "zeros_like"):
        one = name in ("ones", "new_ones", "ones_like")
        return (TRUE if one else FALSE) if is_bool else Affine((), int(one))
    if name in ("add", "sub", "radd", "rsub", "neg"):
        a = analyze(c.input, nodes)
        b = analyze(c.arg(1, "other"), nodes) if name != "neg" else Affine((), 0)
        if not (isinstance(a, Affine) and isinstance(b, Affine)) or c.kwargs.get("alpha", 1) != 1:
            return None
        sign = -1 if name in ("sub", "neg") else 1
        return b.plus(a, -1) if name == "rsub" else (a.scaled(-1) if name == "neg" else a.plus(b, sign))
    if name in ("eq", "ne", *_COMPARE):
        a, b = analyze(c.input, nodes), analyze(c.arg(1, "other"), nodes)
        if not (isinstance(a, Affine) and isinstance(b, Affine)):
            return None
        d = a.plus(b, -1)
        if name in _COMPARE:
            sign, off = _COMPARE[name]
            return Conj((d.scaled(sign).plus(Affine((), off)),))
        if name == "eq":
            return Conj((d, d.scaled(-1)))
        if not d.is_known:
            return None  # `!=` of varying or run-time values is a disjunction
        return TRUE if statically_known_true(d.const != 0) else FALSE if known_equal(d.const, 0) else None
    if name == "mul" and not is_bool:  # by a known integer constant
        a, b = analyze(c.input, nodes), analyze(c.arg(1, "other"), nodes)
        if not (isinstance(a, Affine) and isinstance(b, Affine)):
            return None
        if b.is_known and isinstance(b.const, int):
            return a.scaled(b.const)
        return b.scaled(a.const) if a.is_known and isinstance(a.const, int) else None
    if name in ("and", "and_", "logical_and", "bitwise_and") or (name == "mul" and is_bool):
        a, b = analyze(c.input, nodes), analyze(c.arg(1, "other"), nodes)
        return Conj(a.ge + b.ge) if isinstance(a, Conj) and isinstance(b, Conj) else None
    if name in ("unsqueeze", "expand", "expand_as", "getitem", "cumsum", "diff"):
        return _eval_shape_op(c, v, nodes)
    return None


def _eval_shape_op(c, v: torch.Tensor, nodes: list) -> Affine | Conj | None:
    name, x = c.name, c.input
    a = analyze(x, nodes)
    if a is None or not is_tensor(x):
        return None
    ndim = value(x).dim()
    if name == "unsqueeze":
        d = c.arg(1, "dim")
        if not isinstance(d, int):
            return None
        d = d % (ndim + 1)
        return _map(a, lambda f: Affine(f.aligned(ndim).coef[:d] + (0,) + f.aligned(ndim).coef[d:], f.const,
                                        f.runtime))
    if name in ("expand", "expand_as"):
        return _map(a, lambda f: f.aligned(v.dim()))  # expanded dims have size 1: coefficient 0
    if name == "getitem":
        return _getitem(a, ndim, c.args[1], v, nodes)
    dim = c.arg(1, "dim") if name == "cumsum" else c.arg(2, "dim", -1)
    if not isinstance(dim, int):
        return None
    dim %= ndim
    if name == "cumsum":  # of a constant k: k * (i + 1)
        k = _constant(a)
        if not isinstance(k, int):
            return None
        return Affine(tuple(k if d == dim else 0 for d in range(ndim)), k)
    # diff(x, n=1, dim, prepend=p): constant coef[dim] if p continues x's progression backwards
    if c.arg(1, "n", 1) != 1 or c.kwargs.get("append") is not None or not isinstance(a, Affine):
        return None
    prepend = c.kwargs.get("prepend", c.args[3] if len(c.args) > 3 else None)
    a = a.aligned(ndim)
    if prepend is not None:
        p = analyze(prepend, nodes)
        if not isinstance(p, Affine) or not known_equal(value(prepend).shape[dim], 1):
            return None
        p = p.aligned(ndim)
        others = all(p.coef[d] == a.coef[d] for d in range(ndim) if d != dim)
        if not others or not known_equal(p.const, a.const - a.coef[dim]) or p.runtime != a.runtime:
            return None
    return Affine((0,) * ndim, a.coef[dim])


def _getitem(a, ndim: int, index, v: torch.Tensor, nodes: list) -> Affine | Conj | None:
    index = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, fx.Node) for i in index):
        return _advanced_index(a, ndim, index, v, nodes)
    return _map(a, lambda f: basic_index(f, ndim, index))


def basic_index(f: Affine, ndim: int, index) -> Affine | None:
    """`f` (of an `ndim`-D tensor) after `x[index]` with basic indices only: None, one Ellipsis,
    non-negative ints, slices with a non-negative start and a positive step; else None."""
    index = index if isinstance(index, tuple) else (index,)
    if sum(i is Ellipsis for i in index) > 1:
        return None
    explicit = sum(i is not None and i is not Ellipsis for i in index)
    if explicit > ndim:
        return None
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (ndim - explicit) + index[at + 1:]
    index = index + (slice(None),) * (ndim - sum(i is not None for i in index))
    f, coef, const, d = f.aligned(ndim), [], f.const, 0
    for i in index:
        if i is None:
            coef.append(0)
            continue
        k = f.coef[d]
        d += 1
        if isinstance(i, int) and not isinstance(i, bool) and i >= 0:
            const = const + k * i
        elif isinstance(i, slice):
            start, step = i.start or 0, i.step or 1
            if not (isinstance(start, int) and start >= 0 and isinstance(step, int) and step > 0):
                return None
            coef.append(k * step)
            const = const + k * start
        else:
            return None
    return Affine(tuple(coef), const, f.runtime)


def _advanced_index(a, ndim: int, index, v: torch.Tensor, nodes: list) -> Affine | None:
    """`x[i0, i1, ...]` with one integer index tensor per leading dim: `x` at those indices."""
    if not isinstance(a, Affine) or len(index) > ndim or not all(isinstance(i, fx.Node) for i in index):
        return None
    rest = ndim - len(index)
    out = v.dim()
    a = a.aligned(ndim)
    result = Affine((0,) * (out - rest) + a.coef[len(index):], a.const, a.runtime)
    for k, i in zip(a.coef, index):
        f = analyze(i, nodes)
        if not isinstance(f, Affine) or value(i).dtype not in (torch.int64, torch.int32):
            return None
        if any(c < 0 for c in f.coef) or f.runtime or not statically_known_true(f.const >= 0):
            return None  # a negative index would wrap around
        result = result.plus(Affine(f.aligned(out - rest).coef + (0,) * rest, f.const).scaled(k))
    return result


def _map(a: Affine | Conj, f) -> Affine | Conj | None:
    if isinstance(a, Affine):
        return f(a)
    mapped = [f(x) for x in a.ge]
    return None if any(m is None for m in mapped) else Conj(tuple(mapped))


def _constant(a: Affine | Conj) -> Any:
    """The value of a constant tensor (a bool as 0/1), else None."""
    if isinstance(a, Affine):
        return a.const if a.is_known else None
    if not all(f.is_known for f in a.ge):
        return None
    if all(statically_known_true(f.const >= 0) for f in a.ge):
        return 1
    return 0 if any(statically_known_true(f.const < 0) for f in a.ge) else None


def _same_kind(r: Affine | Conj, is_bool: bool) -> bool:
    return isinstance(r, Conj) == is_bool
