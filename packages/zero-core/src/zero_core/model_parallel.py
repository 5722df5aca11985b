"""What the runtime asks of a model-parallel split (tensor parallelism) for the global gradient norm.

zero_core knows groups, not strategies: the meta-package passes an object of this shape (zero_parallel's
``TensorParallelLayout``) when the model's layers are split over a tensor-parallel group and ZeRO shards each
split over its data-parallel group only.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from zero_core.grad_norm import sq_norm
from zero_core.layout import FlatGroup


@runtime_checkable
class ModelParallel(Protocol):
    """``group``: the model-parallel ``ProcessGroup``; ``is_sharded(param)``: whether ``param`` holds this rank's
    part of a split parameter (True) or a replica that every model-parallel rank holds whole (False);
    ``is_duplicate(param)``: a copy that another model-parallel rank counts in the norm, left out here (a weight
    tied across pipeline stages, held equal by each of them)."""

    group: object

    def is_sharded(self, param: torch.nn.Parameter) -> bool: ...

    def is_duplicate(self, param: torch.nn.Parameter) -> bool: ...


def split_sq_norms(groups: list[FlatGroup], shards: list[torch.Tensor], mp: ModelParallel) -> torch.Tensor:
    """``[replicated, split]``: squared L2 norms (fp64) of this rank's gradient shards, cut by parameter (the
    duplicates left out).

    Each parameter's piece is squared-normed by ``grad_norm.sq_norm`` (fp32 rows, fp64 sum), the pieces summed in
    fp64. ``groups[i]``'s gradient shard is ``shards[i]``."""
    parts: tuple[list, list] = ([], [])
    for g, shard in zip(groups, shards):
        flat = shard.reshape(-1)
        for i, a, b in g.slot_pieces():
            param = g.slots[i].param
            if not mp.is_duplicate(param):
                parts[1 if mp.is_sharded(param) else 0].append(sq_norm(flat[a:b]))
    device = shards[0].device if shards else torch.device("cpu")
    return torch.stack([torch.stack(p).sum() if p else torch.zeros((), dtype=torch.float64,
                        device=device) for p in parts])  # fmt: skip
