"""What the autosp and autotp Dynamo backends share: one collective group registered for the graph operations,
every captured graph run through the pass, then handed to the inner compiler (aot_eager or inductor)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.fx as fx

from zero_compile.backend import INNER
from zero_compile.passes.base import Pass, PassContext, run_passes
from zero_compile.sp_ops import register_sp_group


class GraphPassBackend:
    """A Dynamo backend: a pass on every captured graph, then ``inner``.

    Args:
        group: the process group the pass's graph operations communicate over (None: the default group).
        make_pass: ``(group_id, world) -> (example_inputs -> Pass)``: builds, once, what gives each graph its pass.
        inner: "aot_eager" or "inductor".
        debug_dir: where the graph before and after the pass is written (``run_passes``' dumps), or None.

    Attributes:
        world: the group's size; group_id: its id for the graph operations; graphs: graphs compiled so far;
        notes: each graph's pass notes.

    Raises:
        ValueError: ``inner`` is not one of ``zero_compile.backend.INNER``.
    """

    def __init__(self, group, make_pass: Callable[[int, int], Callable[[list], Pass]], *, inner: str = "inductor",
                 debug_dir: str | None = None):  # fmt: skip
        if inner not in INNER:
            raise ValueError(f"compile backend must be one of {INNER}, got {inner!r}")
        self.world = dist.get_world_size(group)
        self.group_id = register_sp_group(group)
        self.inner, self.debug_dir = inner, debug_dir
        self.pass_for = make_pass(self.group_id, self.world)
        self.graphs = 0
        self.notes: list[dict] = []

    def __call__(self, gm: fx.GraphModule, example_inputs):
        graph_id = self.graphs
        self.graphs += 1
        inputs = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        ctx = PassContext(kind="dynamo", graph_id=graph_id, store=-1, params={}, inputs=inputs,
                          debug_dir=self.debug_dir)  # fmt: skip
        gm = run_passes(gm, ctx, [self.pass_for(example_inputs)])
        self.notes.append(ctx.notes)
        return torch._dynamo.lookup_backend(self.inner)(gm, example_inputs)
