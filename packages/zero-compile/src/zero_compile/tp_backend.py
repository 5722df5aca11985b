"""The torch.compile backend of the autotp pass: Dynamo graph -> autotp -> inner compiler (aot_eager or inductor).

``torch.compile(model, backend=TensorParallelBackend(group, layers), fullgraph=True)`` compiles a model that
AutoTP split (zero_parallel's eager split, its layers' ``collectives_in_graph`` set by the caller) so that the
tensor-parallel collectives are graph operations (``zero_compile.passes.autotp``). Parameters and gradients are
left to the caller (the engine's eager ZeRO optimizer over the data-parallel group). Mirrors DeepSpeed 0.19.8's
``init_autotp`` (``deepspeed/compile/init_tp.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx

from zero_compile.backend import INNER
from zero_compile.passes.autotp import SplitLinear, make_autotp
from zero_compile.passes.base import PassContext, run_passes
from zero_compile.sp_ops import register_sp_group


class TensorParallelBackend:
    """A Dynamo backend running the autotp pass on every captured graph, then ``inner``.

    Args:
        group: the tensor-parallel process group (None: the default group); its size is ``tp``.
        layers: ``id()`` of each split weight ``nn.Parameter`` -> its :class:`SplitLinear`.
        inner: "aot_eager" or "inductor".
        debug_dir: where the graph before and after the pass is written (``run_passes``' dumps), or None.

    Attributes:
        world: ``tp``; graphs: graphs compiled so far; notes: each graph's pass notes (copies and linears rewritten).

    Raises:
        ValueError: ``inner`` is not one of ``zero_compile.backend.INNER``; no ``layers``.
    """

    def __init__(self, group, layers: dict[int, SplitLinear], *, inner: str = "inductor",
                 debug_dir: str | None = None):  # fmt: skip
        if inner not in INNER:
            raise ValueError(f"compile backend must be one of {INNER}, got {inner!r}")
        self.world = dist.get_world_size(group)
        self.group_id = register_sp_group(group)
        self.inner, self.debug_dir = inner, debug_dir
        self.pass_ = make_autotp(self.group_id, self.world, layers)
        self.graphs = 0
        self.notes: list[dict] = []

    def __call__(self, gm: fx.GraphModule, example_inputs):
        graph_id = self.graphs
        self.graphs += 1
        inputs = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        ctx = PassContext(kind="dynamo", graph_id=graph_id, store=-1, params={}, inputs=inputs,
                          debug_dir=self.debug_dir)  # fmt: skip
        gm = run_passes(gm, ctx, [self.pass_.bind(example_inputs)])
        self.notes.append(ctx.notes)
        return torch._dynamo.lookup_backend(self.inner)(gm, example_inputs)


def compile_tensor_parallel(module: torch.nn.Module, group, layers: dict[int, SplitLinear], *,
                            inner: str = "inductor", debug_dir: str | None = None):  # fmt: skip
    """``torch.compile(module, backend=TensorParallelBackend(group, layers, ...), fullgraph=True)``: see the
    class."""
    return torch.compile(module, backend=TensorParallelBackend(group, layers, inner=inner, debug_dir=debug_dir),
                         fullgraph=True)  # fmt: skip
