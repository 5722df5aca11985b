"""autotp: AutoTP's tensor-parallel collectives inserted in the graph around the split ``linear`` calls.

zero builds the simpler of the two natural designs, as DeepSpeed 0.19.8's autotp does (``init_autotp``,
``deepspeed/compile/passes/tp_compile.py``): AutoTP's eager split of the weights stays (each rank's column-parallel
``Linear`` holds its rows, each row-parallel one its columns), the layers are told to run a plain ``linear`` with
no collective (``collectives_in_graph``), and this pass puts the collectives back as graph operations
(``zero_compile.tp_ops``) so that the whole forward compiles with ``fullgraph=True`` and AOTAutograd derives the
backward's. It runs on Dynamo's graph (torch-level operations, before AOTAutograd), where a layer's product is one
``linear`` call whose weight is a graph input. The caller names the split weights (``layers``: the weight
``nn.Parameter`` -> :class:`SplitLinear`); the pass finds each by identity among the graph's example inputs and:

* column: ``tp_copy`` on the input before the ``linear`` (one per input shared by several column layers: the
  gradient of that input is summed over the group once), and ``tp_gather`` after it when the layer gathers its
  output;
* row: ``tp_reduce`` on the ``linear``'s output before its users (the bias is added after the sum, by the layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from zero_compile.passes.base import Pass, PassContext, PassError
from zero_compile.tp_ops import TP_COPY, TP_GATHER, TP_REDUCE

LINEAR_TARGETS = (F.linear, torch._C._nn.linear, torch.ops.aten.linear.default)
"""The call targets the pass recognises as a layer's product (Dynamo records ``torch._C._nn.linear``)."""


@dataclass(frozen=True)
class SplitLinear:
    """How one ``Linear`` is split over the tensor-parallel group.

    Attributes:
        name: the layer's name in the model (for errors and notes).
        kind: "column" (output features split) or "row" (input features split).
        widths: every rank's output features, in rank order, when a column layer gathers its output; else None.
    """

    name: str
    kind: str
    widths: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.kind not in ("column", "row"):
            raise ValueError(f"autotp: layer {self.name!r} has kind {self.kind!r}; expected 'column' or 'row'")
        if self.widths is not None and self.kind != "column":
            raise ValueError(f"autotp: layer {self.name!r} gathers its output but is {self.kind!r}; only a column "
                             "layer's output is gathered")  # fmt: skip


def _weight_input(node: fx.Node, inputs: dict[fx.Node, int], layers: dict[int, SplitLinear], example_inputs):
    weight = node.kwargs.get("weight", node.args[1] if len(node.args) > 1 else None)
    if not isinstance(weight, fx.Node) or weight not in inputs:
        return None
    return layers.get(id(example_inputs[inputs[weight]]))


def autotp(gm: fx.GraphModule, ctx: PassContext, group: int, world: int, layers: dict[int, SplitLinear],
           example_inputs) -> fx.GraphModule:  # fmt: skip
    """The autotp pass (see the module docstring) over the tensor-parallel group ``group`` (an id of
    ``zero_compile.sp_ops.register_sp_group``) of ``world`` ranks; ``layers`` maps ``id()`` of each split weight
    to its :class:`SplitLinear`; ``example_inputs`` are the graph's inputs (Dynamo's, in placeholder order).

    Raises:
        PassError: a split layer's weight is not the weight of a ``linear`` call of this graph (a graph break
            inside the model, a layer called through something other than ``F.linear``, or a weight that is not a
            graph input), named.
    """
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    inputs = {n: i for i, n in enumerate(placeholders)}
    copies: dict[fx.Node, fx.Node] = {}
    found: dict[str, int] = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in LINEAR_TARGETS:
            continue
        layer = _weight_input(node, inputs, layers, example_inputs)
        if layer is None:
            continue
        found[layer.name] = found.get(layer.name, 0) + 1
        if layer.kind == "column":
            x = node.args[0]
            if x not in copies:
                with graph.inserting_before(node):
                    copies[x] = graph.call_function(TP_COPY, (x, group, world))
            node.replace_input_with(x, copies[x])
            after = (TP_GATHER, (node, group, list(layer.widths))) if layer.widths is not None else None
        else:
            after = (TP_REDUCE, (node, group, world))
        if after is not None:
            users = list(node.users)
            with graph.inserting_after(node):
                out = graph.call_function(*after)
            for user in users:
                user.replace_input_with(node, out)
    missing = sorted({layer.name for layer in layers.values()} - set(found))
    if missing:
        raise PassError(f"autotp: graph {ctx.graph_id} has no linear call on the split weight of {missing}; the "
                        "pass needs each split layer's product in one graph (compile with fullgraph=True, and "
                        "call the layers' forward, which runs F.linear on the weight)")  # fmt: skip
    graph.lint()
    ctx.notes["autotp"] = {"copies": len(copies), "linears": sum(found.values())}
    return gm


def make_autotp(group: int, world: int, layers: dict[int, SplitLinear]) -> AutotpPass:
    """The autotp pass for Dynamo graphs: call ``.bind(example_inputs)`` for each graph to get its :class:`Pass`.

    Raises ValueError for a ``world`` below 1 or no ``layers``."""
    if world < 1:
        raise ValueError(f"autotp: the tensor-parallel size must be at least 1, got {world}")
    if not layers:
        raise ValueError("autotp: no split layers; the model was not split by AutoTP (tensor_parallel.autotp_size)")
    return AutotpPass(group, world, dict(layers))


class AutotpPass:
    """The autotp pass's arguments; :meth:`bind` gives the :class:`Pass` for one graph's example inputs."""

    def __init__(self, group: int, world: int, layers: dict[int, SplitLinear]):
        self.group, self.world, self.layers = group, world, layers

    def bind(self, example_inputs) -> Pass:
        """The :class:`Pass` rewriting a graph whose inputs are ``example_inputs``."""
        return Pass("autotp", lambda gm, ctx: autotp(gm, ctx, self.group, self.world, self.layers, example_inputs),
                    provides=frozenset({"autotp"}), conflicts=frozenset({"gather", "reduce"}),
                    graphs=frozenset({"dynamo"}))  # fmt: skip
