"""The torch.compile backend of the autotp pass: Dynamo graph -> autotp -> inner compiler (aot_eager or inductor).

``torch.compile(model, backend=TensorParallelBackend(group, layers), fullgraph=True)`` compiles a model that
AutoTP split (zero_parallel's eager split, its layers' ``collectives_in_graph`` set by the caller) so that the
tensor-parallel collectives are graph operations (``zero_compile.passes.autotp``). Parameters and gradients are
left to the caller (the engine's eager ZeRO optimizer over the data-parallel group). Mirrors DeepSpeed 0.19.8's
``init_autotp`` (``deepspeed/compile/init_tp.py``).
"""

from __future__ import annotations

import torch

from zero_compile.graph_backend import GraphPassBackend
from zero_compile.passes.autotp import SplitLinear, make_autotp


class TensorParallelBackend(GraphPassBackend):
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
        super().__init__(group, lambda gid, world: make_autotp(gid, world, layers).bind, inner=inner,
                         debug_dir=debug_dir)  # fmt: skip


def compile_tensor_parallel(module: torch.nn.Module, group, layers: dict[int, SplitLinear], *,
                            inner: str = "inductor", debug_dir: str | None = None):  # fmt: skip
    """``torch.compile(module, backend=TensorParallelBackend(group, layers, ...), fullgraph=True)``: see the
    class."""
    return torch.compile(module, backend=TensorParallelBackend(group, layers, inner=inner, debug_dir=debug_dir),
                         fullgraph=True)  # fmt: skip
