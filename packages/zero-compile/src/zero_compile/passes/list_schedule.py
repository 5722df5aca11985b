"""Memory-aware list scheduler: reorder a graph's nodes so the modelled live bytes stay lowest, or within a budget.

Live bytes are modelled from the tensors' fake values (``node.meta["val"]``): a node's output is allocated when it
runs and freed after the last reader of it and of its views; ``all_gather_start`` allocates each unit it gathers
(``UnitStore.unit_bytes``) and ``release`` frees it (units the plan keeps are resident and count for nothing); a
gathered buffer's wait and views allocate nothing. Inputs are alive at the start and freed after their last reader
(parameter inputs hold no storage); graph outputs stay alive. This is what the profiling interpreter measures.

Greedy list scheduling: at each step the ready nodes are those whose inputs ran and whose ordering predecessors
ran. Without a budget a gather starts only when nothing else is ready (gathers as late as possible; the prefetch
pass, which runs after this one, moves them earlier again within its budget), and among the other nodes the one
adding the fewest bytes net (allocated minus freed: a release first) runs next. With a budget the earliest node of
the original order that keeps the live bytes within it runs next, and only when none fits the rule above. The new
order is kept only if its modelled peak is not above the old one's (greedy is not optimal); ``ctx.notes`` gets both
peaks.

Ordering kept, so the graph still means the same on every rank:
* data dependencies, and a ``release`` after every reader of its buffer and of views of it;
* collectives (``all_gather_start``, ``all_gather_wait``, ``reduce_grads``) in their original relative order, so
  every rank issues the same collective sequence whatever order its sizes (per-rank shapes) lead to; releases are
  local and move freely, which is what lowers the peak;
* random operations in their original relative order (they consume the generator in sequence);
* other side-effecting operations (input mutations) stay where they are: every node before one runs before it.

Mirrors the role of DeepCompile's memory-aware list scheduling of gathers and releases (arXiv 2504.09983, section
3.3), written for this graph model.
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch
import torch.fx as fx

from zero_compile import ops
from zero_compile.passes.base import _VIEW_OPS, Pass, PassContext, _readers
from zero_compile.store import get_store

_COLLECTIVES = (ops.START, ops.WAIT, ops.REDUCE)


def _nbytes(val) -> int:
    if isinstance(val, torch.Tensor):
        n = val.numel()
        try:
            n = int(n)
        except (TypeError, ValueError, RuntimeError):  # an unbacked symbolic size: use its hint if it has one
            n = int(getattr(getattr(n, "node", None), "hint", None) or 0)
        return n * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(_nbytes(v) for v in val)
    return 0


def _is_alias(n: fx.Node) -> bool:
    return n.op == "call_function" and (n.target in _VIEW_OPS or n.target is operator.getitem or n.target is ops.WAIT)


class MemoryModel:
    """The live-bytes model of one graph (see the module docstring).

    Args:
        graph: the FX graph.
        unit_bytes: unit index -> bytes of its gathered buffer.
        keep: units kept gathered (resident: they count for nothing).
        empty: names of placeholders without storage (the model's parameters).
    """

    def __init__(self, graph: fx.Graph, unit_bytes, keep=frozenset(), empty=frozenset()):
        self.graph, self.unit_bytes, self.keep = graph, unit_bytes, keep
        self.root: dict[fx.Node, fx.Node] = {}
        for n in graph.nodes:
            self.root[n] = self.root[n.args[0]] if _is_alias(n) and n.target is not ops.WAIT else n
        self.size = {n: 0 if n.op == "output" or _is_alias(n) or n.name in empty else _nbytes(n.meta.get("val"))
                     for n in graph.nodes}  # fmt: skip
        self.inputs = sum(self.size[n] for n in graph.nodes if n.op == "placeholder")
        self.uses: dict[fx.Node, int] = defaultdict(int)  # readers of a root through it or its aliases
        out = next(n for n in reversed(graph.nodes) if n.op == "output")
        self.pinned = {self.root[a] for a in out.all_input_nodes}
        for n in graph.nodes:
            for r in {self.root[a] for a in n.all_input_nodes}:
                self.uses[r] += 1

    def start(self):
        """A fresh simulation state: (live bytes, remaining uses per root, gathered units)."""
        return [self.inputs, dict(self.uses), set()]

    def effect(self, state, n: fx.Node) -> tuple[int, int]:
        """(bytes allocated, bytes freed) if ``n`` ran now, without running it."""
        alloc, freed = self.size[n], 0
        if n.op == "call_function" and n.target is ops.START:
            alloc += sum(self.unit_bytes(u) for u in set(n.args[1]) if u not in self.keep and u not in state[2])
        if n.op == "call_function" and n.target is ops.RELEASE and n.args[1] in state[2]:
            freed += self.unit_bytes(n.args[1])
        for r in {self.root[a] for a in n.all_input_nodes}:
            if state[1][r] == 1 and r not in self.pinned:
                freed += self.size[r]
        if self.uses.get(n, 0) == 0 and n not in self.pinned:
            freed += self.size[n]  # nobody reads it: dropped as soon as it is made
        return alloc, freed

    def run(self, state, n: fx.Node) -> int:
        """Run ``n`` in the simulation; returns the live bytes while it runs (its output allocated, nothing freed)."""
        alloc, freed = self.effect(state, n)
        during = state[0] + alloc
        state[0] = during - freed
        for r in {self.root[a] for a in n.all_input_nodes}:
            state[1][r] -= 1
        if n.op == "call_function" and n.target is ops.START:
            state[2].update(u for u in n.args[1] if u not in self.keep)
        if n.op == "call_function" and n.target is ops.RELEASE:
            state[2].discard(n.args[1])
        return during

    def peak(self, order: list[fx.Node]) -> int:
        """Modelled peak live bytes of running ``order``."""
        state = self.start()
        return max((self.run(state, n) for n in order), default=0)


def _ordering_deps(body: list[fx.Node]) -> dict[fx.Node, set[fx.Node]]:
    """Every node's predecessors: its inputs plus the ordering rules of the module docstring."""
    inside = set(body)
    deps = {n: {a for a in n.all_input_nodes if a in inside} for n in body}
    last_collective = last_random = None
    before: list[fx.Node] = []
    barrier = None
    for n in body:
        if barrier is not None:
            deps[n].add(barrier)
        if n.target is ops.RELEASE:
            deps[n].update(r for r in _readers(n.args[2]) if r in inside and r is not n)
        elif n.target in _COLLECTIVES:
            if last_collective is not None:
                deps[n].add(last_collective)
            last_collective = n
        elif n.op == "call_function" and n.is_impure(impure_random=False):
            deps[n].update(before)
            barrier = n
        elif n.op == "call_function" and n.is_impure(impure_random=True):
            if last_random is not None:
                deps[n].add(last_random)
            last_random = n
        before.append(n)
    return deps


def list_order(model: MemoryModel, budget: int | None = None) -> list[fx.Node]:
    """The greedy order of the graph's non-placeholder, non-output nodes (see the module docstring)."""
    graph = model.graph
    body = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    index = {n: i for i, n in enumerate(body)}
    deps = _ordering_deps(body)
    waiting = {n: len(d) for n, d in deps.items()}
    users = defaultdict(list)
    for n, d in deps.items():
        for p in d:
            users[p].append(n)
    state = model.start()
    ready = {n for n in body if waiting[n] == 0}
    order = []
    while ready:
        effects = {n: model.effect(state, n) for n in ready}
        fits = [n for n in ready if budget is not None and state[0] + effects[n][0] <= budget]
        if fits:
            n = min(fits, key=index.__getitem__)
        else:
            n = min(ready, key=lambda m: (m.target is ops.START, effects[m][0] - effects[m][1], index[m]))  # noqa: B023
        ready.discard(n)
        model.run(state, n)
        order.append(n)
        for u in users[n]:
            waiting[u] -= 1
            if waiting[u] == 0:
                ready.add(u)
    if len(order) != len(body):
        raise RuntimeError("list_schedule: ordering rules form a cycle; graph left as it was")
    return order


def list_schedule(gm: fx.GraphModule, ctx: PassContext, budget: int | None = None) -> fx.GraphModule:
    """The list scheduler pass (see the module docstring); ``budget`` in bytes of modelled live memory, or None."""
    store = get_store(ctx.store)
    keep = ctx.plan.keep if ctx.plan is not None else frozenset()
    graph = gm.graph
    model = MemoryModel(graph, store.unit_bytes, keep, frozenset(ctx.params))
    old = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    new = list_order(model, budget)
    before, after = model.peak(old), model.peak(new)
    kept = after <= before and new != old
    if kept:
        out = next(n for n in reversed(graph.nodes) if n.op == "output")
        for n in new:
            out.prepend(n)  # moves n to just before the output: the body ends up in the new order
    ctx.notes["list_schedule"] = {"peak_before": before, "peak_after": after if kept else before,
                                  "reordered": kept, "budget": budget}  # fmt: skip
    return gm


def make_list_schedule(budget_bytes: int | None = None) -> Pass:
    """The list scheduler as a :class:`Pass`, with a budget in bytes of modelled live memory (None: lowest peak)."""
    return Pass("list_schedule", lambda gm, ctx: list_schedule(gm, ctx, budget_bytes),
                provides=frozenset({"schedule"}))  # fmt: skip


LIST_SCHEDULE = make_list_schedule()
