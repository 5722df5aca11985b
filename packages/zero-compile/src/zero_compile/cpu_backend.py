"""The torch.compile backend zero's engines compile a CPU model with: Dynamo graph -> the cpu_attention pass ->
inductor (or aot_eager). ``torch.compile(model, backend=CpuAttentionBackend())`` equals ``backend="inductor"``
except that a bf16 or fp16 attention call runs in fp32 where that is faster on this CPU
(:mod:`zero_compile.passes.cpu_attention`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx

from zero_compile.backend import INNER
from zero_compile.passes.base import Pass, PassContext, run_passes
from zero_compile.passes.cpu_attention import AttentionShape, cpu_attention, fp32_is_faster


class CpuAttentionBackend:
    """A Dynamo backend running the cpu_attention pass on every captured graph, then ``inner``.

    Args:
        inner: "aot_eager" or "inductor".
        choose: ``AttentionShape -> bool``, whether a call runs in fp32 (default: timed once per process and
            shapes, :func:`~zero_compile.passes.cpu_attention.fp32_is_faster`).

    Attributes:
        graphs: graphs compiled so far; notes: each graph's pass notes (``{"cpu_attention": {"fp32": n, "kept":
        m}}``: attention calls moved to fp32 and kept).

    Raises:
        ValueError: ``inner`` is not one of ``zero_compile.backend.INNER``.
    """

    def __init__(self, inner: str = "inductor", choose: Callable[[AttentionShape], bool] = fp32_is_faster):
        if inner not in INNER:
            raise ValueError(f"compile backend must be one of {INNER}, got {inner!r}")
        self.inner = inner
        self.graphs = 0
        self.notes: list[dict] = []
        self._pass = Pass("cpu_attention", lambda gm, ctx: cpu_attention(gm, ctx, choose),
                          graphs=frozenset({"dynamo"}))  # fmt: skip

    def __call__(self, gm: fx.GraphModule, example_inputs):
        inputs = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        ctx = PassContext(kind="dynamo", graph_id=self.graphs, store=-1, params={}, inputs=inputs, debug_dir=None)
        self.graphs += 1
        gm = run_passes(gm, ctx, [self._pass])
        self.notes.append(ctx.notes)
        return torch._dynamo.lookup_backend(self.inner)(gm, example_inputs)
