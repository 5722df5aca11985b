"""The autotp pass on Dynamo graphs, without ranks: where it puts the collectives around the split ``linear`` calls
(one ``tp_copy`` per input shared by column layers, ``tp_reduce`` after a row layer's product and before its bias,
``tp_gather`` after a gathering column layer), layers it leaves alone, and what it refuses. Training equality on 2
ranks is in tests-integration/test_compile_autotp.py."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F

from zero_compile.passes import PassContext, PassError, run_passes
from zero_compile.passes.autotp import LINEAR_TARGETS, SplitLinear, make_autotp
from zero_compile.tp_ops import TP_COPY, TP_GATHER, TP_REDUCE


class _Block(torch.nn.Module):
    """Two column layers reading the same input, a row layer whose bias is added after its product, a gathering
    column head and a layer that stays whole (as the split layers run while the graph is traced)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
        self.row = torch.nn.Linear(4, 8)
        self.head, self.whole = torch.nn.Linear(8, 3), torch.nn.Linear(3, 3)

    def forward(self, x):
        h = F.linear(x, self.a.weight, self.a.bias) * F.linear(x, self.b.weight, self.b.bias)
        y = F.linear(h, self.row.weight) + self.row.bias
        return self.whole(F.linear(y, self.head.weight, self.head.bias))


def _graph(module: torch.nn.Module):
    captured = []

    def backend(gm, example_inputs):
        captured.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(module, backend=backend, fullgraph=True)(torch.randn(2, 8))
    return captured[0]


def _layers(m: _Block, skip: str = "") -> dict:
    layers = {"a": SplitLinear("a", "column"), "b": SplitLinear("b", "column"), "row": SplitLinear("row", "row"),
              "head": SplitLinear("head", "column", (2, 1))}  # fmt: skip
    return {id(getattr(m, name).weight): layer for name, layer in layers.items() if name != skip}


def _autotp(gm, example_inputs, layers) -> PassContext:
    ctx = PassContext(kind="dynamo", graph_id=0, store=-1, params={}, inputs=[])
    run_passes(gm, ctx, [make_autotp(7, 2, layers).bind(example_inputs)])
    return ctx


def test_collectives_surround_the_split_linears():
    m = _Block()
    gm, inputs = _graph(m)
    ctx = _autotp(gm, inputs, _layers(m))
    assert ctx.notes["autotp"] == {"copies": 2, "linears": 4}  # x (a and b), the row layer's output (head)
    linears = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in LINEAR_TARGETS]
    a, b, row, head, whole = linears
    copy, head_copy = [n for n in gm.graph.nodes if n.target is TP_COPY]
    assert a.args[0] is copy and b.args[0] is copy and copy.args[1:] == (7, 2)  # one copy for the shared input
    assert row.args[0].target is not TP_COPY and whole.args[0].target is not TP_COPY  # row and unsplit layers
    [reduce] = row.users
    assert reduce.target is TP_REDUCE and reduce.args == (row, 7, 2)
    [bias_add] = reduce.users  # the bias is added to the sum, once
    assert bias_add.target is operator.add and list(bias_add.users) == [head_copy]
    assert head.args[0] is head_copy and head_copy.args == (bias_add, 7, 2)
    [gather] = head.users
    assert gather.target is TP_GATHER and gather.args == (head, 7, [2, 1]) and list(gather.users) == [whole]


def test_refusals_name_the_layer_or_argument():
    m = _Block()
    gm, inputs = _graph(m)
    layers = _layers(m)
    layers[id(torch.nn.Parameter(torch.zeros(1)))] = SplitLinear("lost.proj", "row")  # not in the graph
    with pytest.raises(PassError, match=r"graph 0 has no linear call on the split weight of \['lost.proj'\]"):
        _autotp(gm, inputs, layers)
    with pytest.raises(ValueError, match="layer 'x' has kind 'diagonal'; expected 'column' or 'row'"):
        SplitLinear("x", "diagonal")
    with pytest.raises(ValueError, match="layer 'x' gathers its output but is 'row'"):
        SplitLinear("x", "row", (1, 1))
    with pytest.raises(ValueError, match="at least 1"):
        make_autotp(0, 0, _layers(m))
    with pytest.raises(ValueError, match="no split layers"):
        make_autotp(0, 2, {})
