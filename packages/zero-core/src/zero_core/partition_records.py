"""The partitions of parameters partitioned at construction (``zero_core.zero_init``) or deferred
(``zero_core.deferred_init``): what each one really is (shape, dtype, this rank's shard, its group), read by the
layout, the ``ds_*`` properties and ``GatheredParameters``. Each lives in its parameter's
``zero_core.param_record.ParamRecord`` until a runtime takes the parameter's storage over (:func:`forget`).
"""

from __future__ import annotations

import torch

from zero_comm import all_gather_into_tensor
from zero_core.param_record import PartitionedParam, record_for, record_of

__all__ = [
    "PartitionedParam",
    "forget",
    "gather_partitioned",
    "logical_shape",
    "partitioned_record",
    "record",
    "register_copy",
]


def partitioned_record(p: torch.Tensor) -> PartitionedParam | None:
    """The partition of a parameter partitioned by ``zero_init`` or deferred (None if it is neither)."""
    rec = record_of(p)
    return None if rec is None else rec.partition


def logical_shape(p: torch.Tensor) -> torch.Size:
    """The parameter's real shape (its partition's for a partitioned parameter)."""
    rec = partitioned_record(p)
    return rec.shape if rec is not None else p.shape


def record(p: torch.Tensor, rec: PartitionedParam) -> None:
    """Make ``rec`` the partition of ``p`` (``zero_init`` partitioning it, ``zero_core.deferred_init`` deferring it)."""
    record_for(p).partition = rec


def register_copy(p: torch.nn.Parameter, rec: PartitionedParam) -> None:
    """Make ``p`` (an empty parameter) partitioned like ``rec``: this rank's partition cloned, no communication
    (``copy.deepcopy`` of a partitioned parameter)."""
    shard = rec.shard.clone() if rec.shard is not None else None
    record_for(p).partition = PartitionedParam(
        rec.shape, rec.numel, rec.dtype, shard, rec.group, rec.partitions, rec.init, rec.built_dtype
    )


@torch.no_grad()
def gather_partitioned(p: torch.Tensor, group=None) -> torch.Tensor:
    """The full value of ``p`` (collective when ``p`` is partitioned; else ``p`` itself, detached)."""
    rec = partitioned_record(p)
    if rec is None:
        return p.detach()
    if rec.init is not None:  # deferred: the same value on every rank by construction (no collective)
        return rec.init().reshape(rec.shape)
    world = rec.group.size()
    out = torch.empty(rec.shard.numel() * world, dtype=rec.dtype, device=rec.shard.device)
    all_gather_into_tensor(out, rec.shard, rec.group)
    return out[: rec.numel].view(rec.shape)


def forget(p: torch.Tensor) -> None:
    """Drop ``p``'s partition (a runtime now owns its storage)."""
    rec = record_of(p)
    if rec is not None:
        rec.partition = None
