"""Reading Dynamo's torch-level FX graph, the IR that Inductor's pre-grad hook hands to passes.

That IR is not normalized: `x @ y`, `torch.matmul(x, y)` and `x.matmul(y)` are three kinds of
node, and arguments are positional or keyword as the user wrote them. `call(node)` folds them
into one form; a dunder method goes by its bare name (`x.__eq__(0)`, which torch 2.11 records
for `x == 0`, is `eq`; `__rtruediv__` is `rtruediv`, not `div`). `value(node)` is the fake
tensor (or SymInt) Dynamo recorded for a node, with symbolic sizes under dynamic shapes, which
`known_equal` compares without adding guards.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any, Iterable

import torch
import torch.fx as fx
from torch._dynamo.utils import counters
from torch.fx.experimental.symbolic_shapes import statically_known_true

_NAMESPACES = (torch, torch.nn.functional, torch.Tensor, operator)
_ALIASES = {"truediv": "div", "bitwise_not": "invert"}


@dataclasses.dataclass(frozen=True)
class Call:
    """A call in normalized form: `name` is the torch function or method name (`matmul` for
    `@`, `div` for `/`); for methods the tensor is `args[0]`."""

    name: str
    args: tuple
    kwargs: dict

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        """The argument at `index` if given positionally, else keyword `name`, else `default`."""
        return self.args[index] if len(self.args) > index else self.kwargs.get(name, default)

    @property
    def input(self) -> Any:
        """What the call works on: `self` of a method, the first argument of a function."""
        return self.arg(0, "input")


def call(node: Any) -> Call | None:
    """`node` as a `Call`, or None if it is not a call of a torch function, method or operator."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_method":
        name = node.target
        if name.startswith("__") and name.endswith("__"):  # `x == 0` is `x.__eq__(0)` on torch 2.11
            name = name[2:-2]
    elif node.op == "call_function":
        name = getattr(node.target, "__name__", None)
        if name is None or not any(getattr(ns, name, None) is node.target for ns in _NAMESPACES):
            return None
    else:
        return None
    return Call(_ALIASES.get(name, name), tuple(node.args), dict(node.kwargs))


def value(x: Any) -> Any:
    """The example value of a node (a fake tensor, SymInt, ...), or `x` itself if not a node."""
    return x.meta.get("example_value") if isinstance(x, fx.Node) else x


def is_tensor(x: Any) -> bool:
    return isinstance(value(x), torch.Tensor)


def known_equal(a: Any, b: Any) -> bool:
    """Whether two sizes (ints or SymInts) or shapes are equal for every value of their symbols."""
    if isinstance(a, (tuple, list, torch.Size)) or isinstance(b, (tuple, list, torch.Size)):
        return len(a) == len(b) and all(known_equal(x, y) for x, y in zip(a, b))
    return statically_known_true(a == b)


class Decline(Exception):
    """A candidate a pass cannot rewrite exactly; the message is the reason."""


def declined(log: logging.Logger, pass_name: str, node: fx.Node, reason: Any) -> None:
    """Log why `pass_name` left the candidate at `node` alone (DEBUG) and count it in
    `counters["attn"]["<pass>_declined"]`."""
    counters["attn"][f"{pass_name}_declined"] += 1
    log.debug("%s declined %s at %s: %s", pass_name, node.name, source_line(node), reason)


def source_line(node: fx.Node) -> str:
    """Where the user's code made `node` (`File "model.py", line 12, in forward`), for logs."""
    frames = [line.strip() for line in (node.meta.get("stack_trace") or "").splitlines()
              if line.strip().startswith("File ")]
    return frames[-1] if frames else node.name


def erase_unused(graph: fx.Graph, nodes: Iterable[fx.Node]) -> None:
    """Erase those of `nodes` that no node uses any more, users before producers."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(set(nodes), key=order.__getitem__, reverse=True):
        if not node.users:
            graph.erase_node(node)


def insert_call(graph: fx.Graph, before: fx.Node, target: Any, args: tuple = (), kwargs: dict | None = None,
                *, method: bool = False, meta_from: fx.Node | None = None) -> fx.Node:
    """A new `call_function` (or `call_method` if `method`) node before `before`, with the
    example value its target computes on the arguments' example values (so later passes and
    Dynamo's metadata see its fake tensor) and the user-code location of `meta_from`."""
    kwargs = kwargs or {}
    with graph.inserting_before(before):
        node = (graph.call_method if method else graph.call_function)(target, args, kwargs)
    node.meta["example_value"] = fake_eval(node)
    source = meta_from if meta_from is not None else before
    node.meta.update({k: v for k, v in source.meta.items() if k in ("stack_trace", "nn_module_stack", "source_fn_stack")})
    return node


def fake_eval(node: fx.Node) -> Any:
    """Run `node`'s call on its arguments' example values (fake tensors): its example value."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), value)
    leaves = torch.utils._pytree.tree_leaves((args, kwargs)) + [value(n) for n in node.graph.nodes]
    fake_mode = next(x.fake_mode for x in leaves if hasattr(x, "fake_mode"))  # the graph's, if no argument has one
    with fake_mode:
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        return node.target(*args, **kwargs)


def shared_node(graph: fx.Graph, target: Any, args: tuple, kwargs: dict | None = None, *,
                method: bool = False) -> fx.Node:
    """The node `target(*args, **kwargs)` (a method call if `method`), made once, at the start of
    the graph or right after the node it takes, and shared by every caller asking for the same
    call."""
    kwargs = kwargs or {}
    op = "call_method" if method else "call_function"
    node = next((n for n in graph.nodes if n.op == op and n.target == target and n.args == args
                 and n.kwargs == kwargs), None)
    if node is not None:
        return node
    inputs = [a for a in args if isinstance(a, fx.Node)]
    place = graph.inserting_after(inputs[-1]) if inputs else \
        graph.inserting_before(next(n for n in graph.nodes if n.op != "placeholder"))
    with place:
        node = graph.create_node(op, target, args, kwargs)
    node.meta["example_value"] = fake_eval(node)
    return node


def graph_constant(graph: fx.Graph, data: list | float | int, dtype: torch.dtype, device: torch.device) -> fx.Node:
    """A node whose value is `torch.tensor(data, dtype=dtype, device=device)` (`data`: a number
    or a non-empty, possibly nested list), made once at the start of the graph and shared by
    every node that asks for the same constant.

    Inductor keeps one constant buffer for it; the copies `torch.tensor` implies for each
    consumer read that buffer and fuse into neighbouring kernels where the scheduler can (a
    module buffer would need no copy, but AOTAutograd takes only buffers that Dynamo recorded).
    Short 1-D constants are made 2-D and viewed back: Inductor would inline them as literals
    into a kernel per consumer."""
    as_list = isinstance(data, list) and not isinstance(data[0], list)
    node = shared_node(graph, torch.tensor, ([data] if as_list else data,), {"dtype": dtype, "device": device})
    return shared_node(graph, "view", (node, (len(data),)), method=True) if as_list else node
