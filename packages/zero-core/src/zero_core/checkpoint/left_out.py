"""Frozen parameters a DeepSpeed checkpoint left out (``save_checkpoint(..., exclude_frozen_parameters=True)``).

DeepSpeed's files do not name what they left out: its model files then hold no ``frozen_param_shapes`` /
``frozen_param_fragments`` and no module entry for the frozen parameters. DeepSpeed's load (its module
``load_state_dict`` with ``load_module_strict=False``, what Hugging Face's Trainer passes for PEFT models) keeps the
values the module holds for them. The same here: the parameters of this model that the checkpoint lacks and that are
frozen now (``requires_grad`` False) are added to the saved layout as a one-shard frozen group (``left_out``, read as
zeros, so they get no optimizer state) and, once the shards are built, their elements are taken from this rank's
current shards. A trainable parameter the checkpoint lacks is still refused by the layout check.
"""

from __future__ import annotations

import dataclasses

import torch

from zero_core.checkpoint.layout import CheckpointLayout
from zero_core.checkpoint.reshard import master_key
from zero_core.layout import FlatGroup

LEFT_OUT = "left_out"
# meta key a reader of DeepSpeed's files sets: parameters missing from them may be frozen ones it left out
MAY_LEAVE_OUT = "frozen_may_be_left_out"


class _ZerosFor:
    """A ShardSource: ``inner``'s shards, plus shard 0 of the ``left_out`` group read as zeros of ``dtype``."""

    def __init__(self, inner, numel: int, dtype: torch.dtype):
        self.inner, self.numel, self.dtype = inner, numel, dtype
        self.key = master_key(LEFT_OUT)

    def keys(self, rank: int) -> list[str]:
        return [*self.inner.keys(rank), *([self.key] if rank == 0 else [])]

    def shape(self, rank: int, key: str) -> tuple[int, ...]:
        return (self.numel,) if key == self.key else self.inner.shape(rank, key)

    def get(self, rank: int, key: str) -> torch.Tensor:
        return torch.zeros(1, dtype=self.dtype).expand(self.numel) if key == self.key else self.inner.get(rank, key)

    def read(self, rank: int, key: str, start: int, end: int) -> torch.Tensor:
        return torch.zeros(end - start, dtype=self.dtype) if key == self.key else self.inner.read(rank, key, start, end)


def with_left_out(ckpt, current: CheckpointLayout, module: torch.nn.Module):
    """``(ckpt, names)``: the :class:`SavedCheckpoint` ``ckpt`` with the frozen parameters it left out added (as the
    module docstring says) and their names; ``ckpt`` unchanged and no names unless its meta says
    :data:`MAY_LEAVE_OUT`."""
    if not ckpt.meta.get(MAY_LEAVE_OUT):
        return ckpt, set()
    have = ckpt.layout.param_index()
    frozen = {n: p for n, p in module.named_parameters() if not p.requires_grad}
    slots = [p for g in current.groups for p in g.slots if p.name not in have and p.name in frozen]
    if not slots:
        return ckpt, set()
    group = FlatGroup.of(LEFT_OUT, None, 1, [[(p.name, tuple(p.shape)) for p in slots]])
    layout = dataclasses.replace(ckpt.layout, groups=(*ckpt.layout.groups, group))
    source = _ZerosFor(ckpt.source, group.shard_numel, frozen[slots[0].name].dtype)
    return dataclasses.replace(ckpt, layout=layout, source=source), {p.name for p in slots}


def keep_current(g: FlatGroup, index: int, built: torch.Tensor, current: torch.Tensor, names: set[str]) -> None:
    """Copy into ``built`` (shard ``index`` of ``g``) the elements of parameters ``names`` from ``current`` (this
    rank's shard of ``g`` before the load, laid out the same)."""
    for bucket in g.buckets:
        lo, hi = bucket.chunk_range(index)
        for p in bucket.slots:
            a, b = max(lo, p.bucket_offset), min(hi, p.bucket_offset + p.numel)
            if p.name in names and a < b:
                at = bucket.shard_offset + a - lo
                built[at : at + b - a] = current[at : at + b - a].to(built.dtype)
