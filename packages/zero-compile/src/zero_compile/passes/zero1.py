"""ZeRO-1/2 pass: reduce-scatter gradient buckets inside the backward graph.

Parameters stay dense between steps (the core's buckets, refreshed by its post-step all-gather), so the forward
graph is untouched. In the backward graph each bucket's gradients go to ``reduce_grads(store, bucket, slots,
grads)`` right after the last of them is computed, and the graph returns None for them. Mirrors DeepCompile's
``zero1_compile`` pass (arXiv 2504.09983, section 3.2; DeepSpeed ``deepspeed/compile/passes/zero1_compile.py``).
"""

from __future__ import annotations

import torch.fx as fx

from zero_compile.passes.base import Pass, PassContext
from zero_compile.passes.zero3 import insert_reduces


def zero1(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """The ZeRO-1 pass (see the module docstring)."""
    ctx.notes["zero1"] = {"reduces": insert_reduces(gm, ctx)}
    return gm


ZERO1 = Pass("zero1", zero1, provides=frozenset({"zero1", "reduce"}), conflicts=frozenset({"gather"}),
             graphs=frozenset({"backward"}))  # fmt: skip
