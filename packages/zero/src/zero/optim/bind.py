"""Tell layout-aware optimizers where parameters lie in zero_core's flat master shards.

LAMB's trust ratio is per parameter; under ZeRO the optimizer steps one flat shard per param group holding pieces
of many parameters. :func:`bind_runtime` derives, from each flat group's layout (``FlatGroup.slots`` and
``shard_from_full``), the runs of this rank's shard that belong to each parameter and hands them to the optimizer.
"""

from __future__ import annotations

import torch

from zero.optim.lamb import Lamb, Segments


def shard_runs(group) -> tuple[tuple[int, int, int], ...]:
    """``(start, end, slot_index)`` runs covering this rank's shard of flat group ``group`` (-1: padding)."""
    ids = torch.zeros(group.numel, dtype=torch.int32)
    for i, s in enumerate(group.slots):
        ids[s.offset : s.offset + s.numel] = i + 1
    shard = group.shard_from_full(ids) - 1  # zero padding -> -1
    if shard.numel() == 0:
        return ()
    change = torch.nonzero(shard[1:] != shard[:-1]).reshape(-1) + 1
    starts = [0] + change.tolist()
    ends = change.tolist() + [shard.numel()]
    return tuple((s, e, int(shard[s])) for s, e in zip(starts, ends))


def bind_runtime(optimizer: torch.optim.Optimizer, runtime) -> None:
    """Bind a :class:`~zero.optim.lamb.Lamb` to ``runtime``'s flat groups (no-op for other optimizers).

    zero_core's DeviceMaster hands the optimizer one view per parameter piece (``runtime.master.pieces``: ``(slot,
    start, end, view)``); older layouts one flat master per group. Either way each bound tensor learns which
    parameter ids it holds, and each flat group is one key whose sums are all-reduced over the group."""
    if not isinstance(optimizer, Lamb):
        return
    pieces = getattr(getattr(runtime, "master", None), "pieces", None)
    for g in getattr(runtime, "flat_groups", ()):
        if g.group_index is None:
            continue
        optimizer.bind_key(g.index, len(g.slots), runtime.group if g.partitions > 1 else None)
        if pieces is not None:
            for slot, _, _, piece in pieces.get(g.index, []):
                optimizer.bind_segments(piece, Segments(((0, piece.numel(), slot),), g.index))
        elif (master := runtime.master.master_shard(g)) is not None:
            optimizer.bind_segments(master, Segments(shard_runs(g), g.index))
