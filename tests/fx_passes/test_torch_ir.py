"""`torch_ir.call` folds the spellings of one operation into one name and argument list."""

import operator

import torch
import torch.fx as fx

from fx_passes.torch_ir import call


def test_call_normalizes_functions_methods_and_operators():
    graph = fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    nodes = {
        "operator": graph.call_function(operator.matmul, (x, y)),
        "function": graph.call_function(torch.matmul, (x,), {"other": y}),
        "method": graph.call_method("matmul", (x, y)),
        "dunder": graph.call_method("__matmul__", (x, y)),
    }
    for spelling, node in nodes.items():
        c = call(node)
        assert (c.name, c.input, c.arg(1, "other")) == ("matmul", x, y), spelling
    assert call(graph.call_method("__eq__", (x, 0))).name == "eq"
    assert call(graph.call_function(operator.truediv, (x, 2))).name == "div"
    assert call(graph.call_method("__rtruediv__", (x, 2))).name == "rtruediv"
    assert call(graph.call_function(len, (x,))) is None
    assert call(x) is None
