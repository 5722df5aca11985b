"""Bucket planning and flat buffers: many tensors of uneven sizes packed into one buffer per dtype.

The design follows Megatron core's ``param_and_grad_buffer``: one contiguous buffer per dtype, buckets as views of
it, each tensor a view with its (start, end) element range, and each bucket padded so it shards evenly. Ranges
ignore tensor boundaries when a bucket is sharded (rank r owns ``bucket[r*s:(r+1)*s]``), so uneven tensor sizes
never need per-tensor padding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorSlot:
    """Where tensor ``index`` lives in the flat buffer: elements ``[start, end)``."""

    index: int
    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Bucket:
    """A contiguous range ``[start, end)`` of the flat buffer holding ``slots``; ``end - start`` is a multiple of
    the padding multiple, and ``end`` may exceed the last slot's end by the padding (zeros)."""

    index: int
    start: int
    end: int
    slots: tuple[TensorSlot, ...]

    @property
    def numel(self) -> int:
        """Padded size in elements."""
        return self.end - self.start

    def shard_range(self, rank: int, world: int) -> tuple[int, int]:
        """Buffer range ``[start, end)`` owned by ``rank`` when this bucket is split into ``world`` equal shards.

        Raises:
            ValueError: the bucket size is not divisible by ``world`` (plan with ``pad_to`` a multiple of it).
        """
        if self.numel % world:
            raise ValueError(f"bucket {self.index} has {self.numel} elements, not divisible by world size {world}")
        size = self.numel // world
        return self.start + rank * size, self.start + (rank + 1) * size


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def plan_buckets(numels: Sequence[int], bucket_numel: int, pad_to: int = 1) -> list[Bucket]:
    """Pack tensors, in order, into buckets of about ``bucket_numel`` elements.

    A bucket closes before a tensor that would push it past ``bucket_numel``; a tensor larger than ``bucket_numel``
    gets a bucket of its own. Each bucket is padded up to a multiple of ``pad_to`` (typically the data-parallel
    world size times an alignment), and buckets follow each other in one flat buffer.

    Args:
        numels: element count of each tensor (>= 0).
        bucket_numel: target bucket size in elements (>= 1).
        pad_to: every bucket's size is a multiple of this (>= 1).

    Returns:
        buckets in buffer order; ``buckets[-1].end`` is the buffer's total size in elements.

    Raises:
        ValueError: ``bucket_numel`` or ``pad_to`` is not an int >= 1, or a numel is negative or not an int.
    """
    _check_positive_int("bucket_numel", bucket_numel)
    _check_positive_int("pad_to", pad_to)
    buckets: list[Bucket] = []
    slots: list[TensorSlot] = []
    bucket_start = offset = 0

    def close() -> None:
        nonlocal bucket_start, offset, slots
        end = bucket_start + max(pad_to, math.ceil((offset - bucket_start) / pad_to) * pad_to)
        buckets.append(Bucket(len(buckets), bucket_start, end, tuple(slots)))
        bucket_start = offset = end
        slots = []

    for i, n in enumerate(numels):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"numels[{i}] must be an int >= 0, got {n!r}")
        if slots and offset - bucket_start + n > bucket_numel:
            close()
        slots.append(TensorSlot(i, offset, offset + n))
        offset += n
    if slots:
        close()
    return buckets


class FlatBuffer:
    """One contiguous 1-D buffer of ``dtype`` holding many tensors as views, split into padded buckets.

    Attributes:
        data: the flat buffer, ``buckets[-1].end`` elements (padding is zero).
        buckets: the plan from :func:`plan_buckets`.
        shapes: the shape of each tensor.
    Raises (constructor): ValueError as :func:`plan_buckets`.
    """

    def __init__(
        self,
        shapes: Sequence[torch.Size | tuple[int, ...]],
        dtype: torch.dtype,
        *,
        bucket_numel: int,
        pad_to: int = 1,
        device: torch.device | str = "cpu",
    ):
        self.shapes = [torch.Size(s) for s in shapes]
        self.dtype = dtype
        self.buckets = plan_buckets([s.numel() for s in self.shapes], bucket_numel, pad_to)
        total = self.buckets[-1].end if self.buckets else 0
        self.data = torch.zeros(total, dtype=dtype, device=device)
        self._slots = {slot.index: slot for b in self.buckets for slot in b.slots}

    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor], *, bucket_numel: int, pad_to: int = 1) -> FlatBuffer:
        """A buffer shaped for ``tensors`` (same dtype and device, checked) holding a copy of their values."""
        if not tensors:
            raise ValueError("tensors must not be empty")
        dtype, device = tensors[0].dtype, tensors[0].device
        for i, t in enumerate(tensors):
            if t.dtype != dtype or t.device != device:
                raise ValueError(
                    f"tensors[{i}] is {t.dtype} on {t.device}, expected {dtype} on {device} like tensors[0]; "
                    "use group_by_dtype() to make one buffer per dtype"
                )
        buf = cls([t.shape for t in tensors], dtype, bucket_numel=bucket_numel, pad_to=pad_to, device=device)
        for i, t in enumerate(tensors):
            buf.view(i).copy_(t)
        return buf

    def view(self, index: int) -> torch.Tensor:
        """Tensor ``index`` as a view of the buffer, in its own shape (writes go to the buffer)."""
        slot = self._slots[index]
        return self.data[slot.start : slot.end].view(self.shapes[index])

    def views(self) -> list[torch.Tensor]:
        """Every tensor as a view, in input order."""
        return [self.view(i) for i in range(len(self.shapes))]

    def bucket_view(self, bucket: int) -> torch.Tensor:
        """Bucket ``bucket`` (padded) as a flat view."""
        b = self.buckets[bucket]
        return self.data[b.start : b.end]

    def shard_view(self, bucket: int, rank: int, world: int) -> torch.Tensor:
        """The part of bucket ``bucket`` owned by ``rank`` of ``world`` (a flat view)."""
        start, end = self.buckets[bucket].shard_range(rank, world)
        return self.data[start:end]


def group_by_dtype(tensors: Sequence[torch.Tensor]) -> dict[torch.dtype, list[int]]:
    """Indices of ``tensors`` per dtype, in order of first appearance (one :class:`FlatBuffer` per dtype)."""
    out: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        out.setdefault(t.dtype, []).append(i)
    return out
