"""Fuse the q, k and v projections of one input into one GEMM and a split.

    q, k, v = F.linear(x, Wq, bq), F.linear(x, Wk, bk), F.linear(x, Wv, bv)
    ->  q, k, v = F.linear(x, cat([Wq, Wk, Wv]), cat([bq, bk, bv])).split([Nq, Nk, Nv], -1)

Exactly three `F.linear`/`nn.Linear` calls on one input node, all with or all without bias,
weights `[N_i, K]` of one dtype and device (GQA's narrower K/V are fine), each weight and bias a
parameter or constant of the model (a graph input that is an `nn.Parameter`, or a `get_attr`).

Only under `torch._inductor.config.freezing = True` (inference, under `torch.no_grad()`):
freezing turns the parameters into constants after this pass and constant-folds the two `cat`s
once, at compile time, so each call runs one GEMM and no concatenation (checked on the generated
code in the tests). Without freezing the parameters are graph inputs, so the `cat` would run on
every call, reading and writing all three weights: more memory traffic than the two GEMM
launches it saves. The pass then declines. (A load-time module transform would avoid the
freezing requirement but changes the user's model; Inductor's own freezing concat-linear
pattern does the same fusion only on CPU behind `cpp.enable_concat_linear`, and after
AOTAutograd, where the projections are `mm`/`addmm`s the other passes do not read.)

It leaves q, k, v as views of one GEMM output, the graph shape of vLLM's fused `qkv_proj` and
a split, which the RoPE and attention rewrites read through.
"""

from __future__ import annotations

import logging
import operator
from collections import defaultdict

import torch
import torch._inductor.config as inductor_config
import torch.fx as fx
import torch.nn.functional as F

from .torch_ir import call, declined, is_tensor, value

log = logging.getLogger(__name__)

NAME = "qkv_fusion"


def apply(graph: fx.Graph) -> int:
    """Fuse every q/k/v projection triple in `graph`; returns how many."""
    groups: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        c = call(node)
        if c is not None and c.name == "linear" and isinstance(c.input, fx.Node):
            groups[c.input].append(node)
    fused = 0
    for x, linears in groups.items():
        if len(linears) != 3:
            continue
        reason = _decline_reason(x, linears)
        if reason is not None:
            declined(log, NAME, linears[0], reason)
            continue
        _fuse(graph, x, linears)
        fused += 1
    return fused


def _weights(node: fx.Node) -> tuple:
    c = call(node)
    return c.arg(1, "weight"), c.arg(2, "bias")


def _decline_reason(x: fx.Node, linears: list[fx.Node]) -> str | None:
    if not inductor_config.freezing:
        return ("torch._inductor.config.freezing is off: the weights are graph inputs and their "
                "concatenation would run on every call")
    params = [(w, b) for w, b in map(_weights, linears)]
    if len({b is None for _, b in params}) != 1:
        return "some projections have a bias and some do not"
    for w, b in params:
        for t in (w, b) if b is not None else (w,):
            if not _is_parameter(t):
                return f"{getattr(t, 'name', t)} is not a parameter or constant of the model"
    ws = [value(w) for w, _ in params]
    if not all(w.dim() == 2 for w in ws) or len({(w.shape[1], w.dtype, w.device) for w in ws}) != 1:
        return "weights are not [N, K] of one K, dtype and device"
    if not is_tensor(x) or value(x).dtype != ws[0].dtype:
        return "the input's dtype is not the weights'"
    return None


def _is_parameter(t) -> bool:
    if not isinstance(t, fx.Node):
        return False
    return t.op == "get_attr" or (t.op == "placeholder" and isinstance(value(t), torch.nn.Parameter))


def _fuse(graph: fx.Graph, x: fx.Node, linears: list[fx.Node]) -> None:
    params = [_weights(n) for n in linears]
    sizes = [int(value(w).shape[0]) for w, _ in params]
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min(linears, key=order.__getitem__)
    for t in [t for pair in params for t in pair if t is not None]:
        if t.op == "get_attr" and order[t] > order[first]:  # Dynamo puts get_attr at its first use
            first.prepend(t)
    with graph.inserting_before(first):
        weight = graph.call_function(torch.cat, ([w for w, _ in params],), {"dim": 0})
        bias = None if params[0][1] is None else graph.call_function(torch.cat, ([b for _, b in params],), {"dim": 0})
        out = graph.call_function(F.linear, (x, weight, bias))
        split = graph.call_function(torch.split, (out, sizes), {"dim": -1})
        parts = [graph.call_function(operator.getitem, (split, i)) for i in range(3)]
    with value(x).fake_mode:
        examples = {weight: torch.cat([value(w) for w, _ in params])}
        if bias is not None:
            examples[bias] = torch.cat([value(b) for _, b in params])
        examples[out] = F.linear(value(x), examples[weight], examples.get(bias))
        examples[split] = torch.split(examples[out], sizes, dim=-1)
        examples.update({p: examples[split][i] for i, p in enumerate(parts)})
    for node, example in examples.items():
        node.meta.update({k: v for k, v in first.meta.items() if k in ("stack_trace", "nn_module_stack", "source_fn_stack")})
        node.meta["example_value"] = example
    for linear, part in zip(linears, parts):
        linear.replace_all_uses_with(part)
        graph.erase_node(linear)

