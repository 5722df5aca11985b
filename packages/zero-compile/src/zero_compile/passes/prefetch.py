"""Prefetch pass: start each unit's all-gather earlier, within the memory budget, fusing small neighbours.

For each ``all_gather_start`` of unit ``u`` the plan gives a distance ``d`` (units): the start moves to right after
the wait of the unit gathered ``d`` waits earlier in this graph. The pass simulates the bytes of gathered buffers
alive at every node (a unit is alive from its start to its release; kept units always) and shortens the distance
until the moved interval stays within ``plan.budget_bytes``. Starts that end up at the same place and are smaller
than ``plan.fuse_below_bytes`` become one ``all_gather_start(store, [u1, u2, ...])``: one collective. The decision
uses only the rank-agreed plan and the graph, so every rank issues its collectives in the same order. Mirrors
DeepCompile's proactive prefetching (arXiv 2504.09983, section 3.3).
"""

from __future__ import annotations

import torch.fx as fx

from zero_compile import ops
from zero_compile.passes.base import Pass, PassContext
from zero_compile.store import get_store


def _live_curve(nodes: list[fx.Node], unit_bytes, keep) -> list[int]:
    live, cur, curve = set(), 0, []
    base = sum(unit_bytes(u) for u in keep)
    for n in nodes:
        if n.op == "call_function" and n.target is ops.START:
            for u in n.args[1]:
                if u not in live and u not in keep:
                    live.add(u)
                    cur += unit_bytes(u)
        curve.append(cur + base)
        if n.op == "call_function" and n.target is ops.RELEASE and n.args[1] in live:
            live.discard(n.args[1])
            cur -= unit_bytes(n.args[1])
    return curve


def prefetch(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """The prefetch pass (see the module docstring)."""
    plan = ctx.plan
    store = get_store(ctx.store)
    graph = gm.graph
    keep = plan.keep if plan is not None else frozenset()
    budget = plan.budget_bytes if plan is not None else None
    moved = 0
    starts = [n for n in graph.nodes if n.op == "call_function" and n.target is ops.START]
    for s in starts:
        (unit,) = s.args[1]
        d = plan.prefetch.get(unit, 0) if plan is not None else 0
        while d > 0:
            nodes = list(graph.nodes)
            waits = [n for n in nodes[: nodes.index(s)] if n.op == "call_function" and n.target is ops.WAIT]
            if len(waits) < d:
                d = len(waits)
                continue
            anchor = waits[-d]
            lo, hi = nodes.index(anchor) + 1, nodes.index(s)
            curve = _live_curve(nodes, store.unit_bytes, keep)
            size = store.unit_bytes(unit)
            if budget is None or max(curve[lo:hi], default=0) + size <= budget:
                anchor.append(s)
                moved += 1
                break
            d -= 1
    fused = _fuse(graph, store, plan.fuse_below_bytes if plan is not None else 0)
    ctx.notes["prefetch"] = {"moved": moved, "fused": fused}
    return gm


def _fuse(graph: fx.Graph, store, below: int) -> int:
    """Merge runs of adjacent single-unit starts smaller than ``below`` bytes into one start; returns merges."""
    merges = 0
    run: list[fx.Node] = []
    for n in list(graph.nodes) + [None]:
        small = (n is not None and n.op == "call_function" and n.target is ops.START
                 and all(store.unit_bytes(u) < below for u in n.args[1]))  # fmt: skip
        if small:
            run.append(n)
            continue
        if len(run) > 1:
            units = [u for r in run for u in r.args[1]]
            anchors = [a for r in run for a in r.args[2]]
            run[0].args = (run[0].args[0], units, anchors)
            for r in run[1:]:
                graph.erase_node(r)
            merges += len(run) - 1
        run = []
    return merges


PREFETCH = Pass("prefetch", prefetch, provides=frozenset({"prefetch"}), requires=frozenset({"gather"}))
