"""The torch.compile backend of the autosp pass: Dynamo graph -> autosp -> inner compiler (aot_eager or inductor).

``torch.compile(model, backend=SequenceParallelBackend(group), fullgraph=True)`` compiles a model whose attention
is ``scaled_dot_product_attention`` so that every rank of the sequence-parallel ``group`` feeds its shard of each
sequence and attention sees the whole sequence (Ulysses; ``zero_compile.passes.autosp``). Parameters and gradients
are left to the caller (the engine's eager ZeRO stage 0 or 1, as DeepSpeed's AutoSP composes with ZeRO stages 0 and
1 only). Mirrors DeepSpeed 0.19.8's ``init_autosp`` (``deepspeed/compile/init_sp.py``), which compiles with
``fullgraph=True`` too.
"""

from __future__ import annotations

import torch

from zero_compile.graph_backend import GraphPassBackend
from zero_compile.passes.autosp import make_autosp
from zero_compile.passes.base import Pass


class SequenceParallelBackend(GraphPassBackend):
    """A Dynamo backend running the autosp pass on every captured graph, then ``inner``.

    Args:
        group: the sequence-parallel process group (None: the default group); its size is the sequence-parallel
            size ``sp``.
        inner: "aot_eager" or "inductor".
        debug_dir: where the graph before and after the pass is written (``run_passes``' dumps), or None.

    Attributes:
        world: ``sp``; graphs: graphs compiled so far; notes: each graph's pass notes (attention nodes rewritten).

    Raises:
        ValueError: ``inner`` is not one of ``zero_compile.backend.INNER``.
    """

    def __init__(self, group=None, *, inner: str = "inductor", debug_dir: str | None = None):
        super().__init__(group, lambda gid, world: _always(make_autosp(gid, world)), inner=inner, debug_dir=debug_dir)


def _always(pass_: Pass):
    """The same pass for every graph (autosp needs nothing of the example inputs)."""
    return lambda example_inputs: pass_


def compile_sequence_parallel(module: torch.nn.Module, group=None, *, inner: str = "inductor",
                              debug_dir: str | None = None):  # fmt: skip
    """``torch.compile(module, backend=SequenceParallelBackend(group, ...), fullgraph=True)``: see the class."""
    return torch.compile(module, backend=SequenceParallelBackend(group, inner=inner, debug_dir=debug_dir),
                         fullgraph=True)  # fmt: skip
