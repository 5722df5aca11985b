"""Selective unsharding pass: units the plan keeps stay gathered until the optimizer step.

The pass removes the ``release`` of every kept unit, so its gathered buffer stays in the store across the forward,
the backward and the following accumulation micro-steps; the store's ``all_gather_start``/``wait`` then find it
gathered and issue no collective. The store drops kept buffers at the optimizer step (parameters changed), so the
next step gathers them once again. With gradient accumulation ``k`` this turns ``2k`` gathers of a kept unit per
optimizer step into one. Mirrors DeepCompile's selective unsharding (arXiv 2504.09983, section 3.4).
"""

from __future__ import annotations

import torch.fx as fx

from zero_compile import ops
from zero_compile.passes.base import Pass, PassContext


def selective_unshard(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """The selective unsharding pass (see the module docstring)."""
    keep = ctx.plan.keep if ctx.plan is not None else frozenset()
    removed = 0
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is ops.RELEASE and n.args[1] in keep:
            gm.graph.erase_node(n)
            removed += 1
    ctx.notes["selective_unshard"] = {"kept_releases_removed": removed}
    return gm


SELECTIVE_UNSHARD = Pass("selective_unshard", selective_unshard, provides=frozenset({"unshard"}),
                         requires=frozenset({"gather"}))  # fmt: skip
