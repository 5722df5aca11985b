"""The pass machinery: one pass signature, declared contracts, one runner that lints after each pass, a schedule.

Every pass is a function ``(gm, ctx) -> gm`` over an AOTAutograd forward or backward ``torch.fx.GraphModule``,
wrapped in a :class:`Pass` that declares what it ``provides``, ``requires`` (provided by an earlier pass of the
same run) and ``conflicts`` with. :func:`run_passes` checks the contracts before touching the graph, runs the
passes in order, lints the graph after each (FX's own lint plus :func:`lint_zero`), and with ``ctx.debug_dir``
writes each pass's graph to ``<debug_dir>/<graph>_<kind>_<NN>_<pass>.py``. A :data:`Schedule` picks the pass list
by optimizer step, as DeepCompile's ``schedule = [(0, [...]), (WARMUP, [...])]``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from zero_compile import ops


class PassError(RuntimeError):
    """A pass contract is broken (missing requirement, conflict) or a pass left an invalid graph."""


@dataclass(frozen=True)
class Pass:
    """A graph pass with its contract.

    Attributes:
        name: short stable name (used in schedules and debug dumps).
        fn: ``(gm, ctx) -> gm``; may edit ``gm`` in place and return it.
        provides / requires / conflicts: capability names ("gather", "release", "reduce", "prefetch", ...).
        graphs: which graphs it runs on: "forward", "backward" or both.
    """

    name: str
    fn: Callable[[fx.GraphModule, PassContext], fx.GraphModule]
    provides: frozenset[str] = frozenset()
    requires: frozenset[str] = frozenset()
    conflicts: frozenset[str] = frozenset()
    graphs: frozenset[str] = frozenset({"forward", "backward"})


@dataclass
class PassContext:
    """What a pass may read about the graph it rewrites.

    Attributes:
        kind: "forward" or "backward" (AOTAutograd graphs), or "dynamo" (Dynamo's graph, before AOTAutograd: autosp).
        graph_id: index of the captured graph (one per Dynamo graph; graph breaks make several).
        store: the :class:`~zero_compile.store.UnitStore` id baked into inserted operations.
        params: forward placeholder name -> (unit index, slot index) for the model's parameters (AOTAutograd
            keeps the names of saved forward inputs in the backward graph).
        inputs: the forward graph's placeholder names in order (the backward returns one gradient per input).
        step: the optimizer step the passes are applied for.
        plan: decisions of the profile-guided loop (``zero_compile.profile.Plan``) or None before the first.
        debug_dir: folder for per-pass graph dumps, or None.
        notes: what each pass did (counts), for tests and debug logs.
    """

    kind: str
    graph_id: int
    store: int
    params: dict[str, tuple[int, int]]
    inputs: list[str]
    step: int = 0
    plan: object = None
    debug_dir: str | None = None
    notes: dict[str, dict] = field(default_factory=dict)


Schedule = Sequence[tuple[int, Sequence[Pass]]]


def passes_for_step(schedule: Schedule, step: int) -> list[Pass]:
    """The pass list of the last schedule entry whose start step is <= ``step`` (empty before the first)."""
    chosen: Sequence[Pass] = ()
    for start, passes in sorted(schedule, key=lambda e: e[0]):
        if start <= step:
            chosen = passes
    return list(chosen)


def check_contracts(passes: Sequence[Pass], kind: str) -> list[Pass]:
    """The passes that run on ``kind`` graphs, after checking requires/conflicts in order.

    Raises:
        PassError: a pass requires a capability no earlier pass provides, or conflicts with an earlier one.
    """
    provided: dict[str, str] = {}
    out = []
    for p in passes:
        missing = sorted(p.requires - provided.keys())
        if missing:
            raise PassError(f"pass {p.name!r} requires {missing}, which no earlier pass provides "
                            f"(earlier: {sorted(set(provided.values()))})")  # fmt: skip
        clash = sorted(p.conflicts & provided.keys())
        if clash:
            raise PassError(f"pass {p.name!r} conflicts with {clash} provided by pass {provided[clash[0]]!r}")
        for cap in p.provides:
            provided[cap] = p.name
        if kind in p.graphs:
            out.append(p)
    return out


def run_passes(gm: fx.GraphModule, ctx: PassContext, passes: Sequence[Pass]) -> fx.GraphModule:
    """Run ``passes`` (those that apply to ``ctx.kind``) in order, linting after each; dump graphs when asked."""
    todo = check_contracts(passes, ctx.kind)
    _dump(gm, ctx, 0, "captured")
    for i, p in enumerate(todo, 1):
        gm = p.fn(gm, ctx)
        gm.graph.eliminate_dead_code()
        try:
            gm.graph.lint()
            lint_zero(gm.graph)
        except Exception as exc:
            raise PassError(f"pass {p.name!r} left an invalid {ctx.kind} graph {ctx.graph_id}: {exc}") from exc
        gm.recompile()
        _dump(gm, ctx, i, p.name)
    return gm


def lint_zero(graph: fx.Graph) -> None:
    """Check the ZeRO operations of a graph: every wait's buffer is released at most once and after its last
    reader; no gathered buffer is read after its release; every start is followed by a wait of each unit.

    Raises:
        PassError: naming the node that breaks the rule.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    started: dict[int, int] = {}
    released: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is ops.START:
            for u in n.args[1]:
                started[u] = order[n]
        elif n.target is ops.WAIT:
            started.pop(n.args[1], None)
        elif n.target is ops.RELEASE:
            buf = n.args[2]
            if buf in released:
                raise PassError(f"{n.name}: unit {n.args[1]} released twice")
            released.add(buf)
            late = [u for u in _readers(buf) if order[u] > order[n] and u is not n]
            if late:
                raise PassError(f"{n.name}: unit {n.args[1]} released before its reader {late[0].name}")
    if started:
        u = next(iter(started))
        raise PassError(f"unit {u}: all-gather started but never waited")


def _readers(buf: fx.Node) -> list[fx.Node]:
    """Nodes reading ``buf`` directly or through views of it."""
    out, todo = [], list(buf.users)
    while todo:
        n = todo.pop()
        out.append(n)
        if n.op == "call_function" and n.target in _VIEW_OPS:
            todo.extend(n.users)
    return out


_VIEW_OPS = {
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.view.default,
    torch.ops.aten.t.default,
    torch.ops.aten.permute.default,
    torch.ops.aten.transpose.int,
    torch.ops.aten.expand.default,
    torch.ops.aten.unsqueeze.default,
    torch.ops.aten.squeeze.dim,
    torch.ops.aten.reshape.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.select.int,
    torch.ops.aten.as_strided.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.detach.default,
}


def _dump(gm: fx.GraphModule, ctx: PassContext, index: int, name: str) -> None:
    if not ctx.debug_dir:
        return
    os.makedirs(ctx.debug_dir, exist_ok=True)
    path = os.path.join(ctx.debug_dir, f"graph{ctx.graph_id}_{ctx.kind}_step{ctx.step}_{index:02d}_{name}.py")
    with open(path, "w") as f:
        f.write(gm.code)
