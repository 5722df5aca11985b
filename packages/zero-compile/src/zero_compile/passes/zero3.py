"""ZeRO-3 pass: gather each unit before its parameters' first use, release it after the last, reduce-scatter grads.

In a forward or backward graph, every placeholder that is a model parameter (its storage empty between uses) is
replaced, at each use, by a view of its unit's gathered flat buffer:
``all_gather_start(store, [u])`` and ``all_gather_wait(store, u, dtype, numel)`` right before the first node that reads
any parameter of unit ``u``, then ``slice``+``view`` per parameter, and ``release(store, u, full)`` right after the
last reader. A parameter that the forward saves for the backward stays the (empty) placeholder, so the gathered
buffer is not kept alive between forward and backward; the backward graph gathers it again. In the backward
graph, the gradients that the graph returns for parameters are handed to
``reduce_grads(store, u, slots, grads, params)`` right after the last of the unit's gradients is computed, and the
graph returns None for them, so autograd never writes ``param.grad``. Mirrors DeepCompile's ``zero3_compile`` pass
(arXiv 2504.09983, section 3.2).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.fx as fx

from zero_compile import ops
from zero_compile.passes.base import Pass, PassContext

aten = torch.ops.aten


_ZERO_OPS = (ops.START, ops.WAIT, ops.RELEASE, ops.REDUCE, ops.GRAD_ANCHOR)


def _reads(user: fx.Node) -> bool:
    """A node that reads a parameter's values (not the output, not our own operations)."""
    return user.op != "output" and user.target not in _ZERO_OPS


def insert_gathers(gm: fx.GraphModule, ctx: PassContext) -> dict[int, fx.Node]:
    """Gather/view/release around every parameter placeholder's uses; returns unit -> its wait node."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    by_unit: dict[int, list[tuple[fx.Node, int]]] = defaultdict(list)
    for n in graph.nodes:
        if n.op == "placeholder" and n.name in ctx.params:
            unit, slot = ctx.params[n.name]
            if any(_reads(u) for u in n.users):
                by_unit[unit].append((n, slot))
    waits: dict[int, fx.Node] = {}
    anchors: dict[int, fx.Node] = {}
    layout = _layout(ctx)
    for unit, members in sorted(by_unit.items()):
        readers = [u for p, _ in members for u in p.users if _reads(u)]
        first = min(readers, key=order.__getitem__)
        anchor = members[0][0]
        dtype = anchor.meta["val"].dtype
        with graph.inserting_before(first):
            start = graph.call_function(ops.START, (ctx.store, [unit], [anchor]))
            numel = layout.units[unit].padded_numel
            wait = graph.call_function(ops.WAIT, (ctx.store, unit, dtype, numel, anchor))
            start.meta["zero_unit"] = wait.meta["zero_unit"] = unit
            for p, slot in members:
                s = layout.units[unit].slots[slot]
                flat = graph.call_function(aten.slice.Tensor, (wait, 0, s.bucket_offset, s.bucket_offset + s.numel))
                view = graph.call_function(aten.view.default, (flat, list(s.shape)))
                view.meta["val"] = p.meta["val"]
                p.replace_all_uses_with(view, delete_user_cb=_reads)
        waits[unit], anchors[unit] = wait, anchor
    order = {n: i for i, n in enumerate(graph.nodes)}
    for unit, wait in waits.items():
        last = max(_deep_readers(wait), key=order.__getitem__)
        if last.op == "output":
            continue  # a gathered view escapes as an output: the caller keeps it; nothing to release here
        with graph.inserting_after(last):
            rel = graph.call_function(ops.RELEASE, (ctx.store, unit, wait, anchors[unit]))
            rel.meta["zero_unit"] = unit
    return waits


def insert_reduces(gm: fx.GraphModule, ctx: PassContext, piece_bytes: int | None = None) -> int:
    """Backward: replace the ``grad_anchor(grad, param)`` nodes by ``reduce_grads`` right after the last of their
    gradients is computed (one per unit, or with ``piece_bytes`` one per run of consecutive slots of at most that
    many bytes, so the first pieces reduce while the backward still computes the rest); the graph returns None for
    those gradients. Returns the reduces inserted."""
    graph = gm.graph
    by_unit: dict[int, list[fx.Node]] = defaultdict(list)
    for n in graph.nodes:
        if n.op == "call_function" and n.target is ops.GRAD_ANCHOR and n.args[1].name in ctx.params:
            by_unit[ctx.params[n.args[1].name][0]].append(n)
    order = {n: i for i, n in enumerate(graph.nodes)}
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    anchors = {a for members in by_unit.values() for a in members}
    count = 0
    for unit, members in sorted(by_unit.items()):
        members.sort(key=lambda a: ctx.params[a.args[1].name][1])
        for piece in _pieces(members, piece_bytes):
            last = max((a.args[0] for a in piece), key=order.__getitem__)
            with graph.inserting_after(last):
                slots = [ctx.params[a.args[1].name][1] for a in piece]
                red = graph.call_function(ops.REDUCE, (ctx.store, unit, slots, [a.args[0] for a in piece],
                                                       [a.args[1] for a in piece]))  # fmt: skip
                red.meta["zero_unit"] = unit
            count += 1
    out.args = (tuple(None if g in anchors else g for g in out.args[0]),) + tuple(out.args[1:])
    for a in anchors:
        graph.erase_node(a)
    return count


def _pieces(members: list[fx.Node], piece_bytes: int | None) -> list[list[fx.Node]]:
    """Consecutive runs of ``members`` (slot order) of at most ``piece_bytes`` (a single larger gradient is a
    piece of its own); None: one piece. The cut depends on shapes only, so every rank cuts alike."""
    if piece_bytes is None:
        return [members]
    pieces: list[list[fx.Node]] = [[]]
    size = 0
    for a in members:
        val = a.meta.get("val")
        n = val.numel() * val.element_size() if val is not None else 0
        if pieces[-1] and size + n > piece_bytes:
            pieces.append([])
            size = 0
        pieces[-1].append(a)
        size += n
    return pieces


def _deep_readers(buf: fx.Node) -> list[fx.Node]:
    from zero_compile.passes.base import _readers

    return _readers(buf)


def _layout(ctx: PassContext):
    from zero_compile.store import get_store

    return get_store(ctx.store).layout


def zero3(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """The ZeRO-3 pass (see the module docstring)."""
    waits = insert_gathers(gm, ctx)
    note = {"gathers": len(waits), "releases": sum(1 for n in gm.graph.nodes if n.target is ops.RELEASE)}
    if ctx.kind == "backward":
        note["reduces"] = insert_reduces(gm, ctx)
    ctx.notes["zero3"] = note
    return gm


ZERO3 = Pass("zero3", zero3, provides=frozenset({"gather", "release", "reduce"}), conflicts=frozenset({"zero1"}))
