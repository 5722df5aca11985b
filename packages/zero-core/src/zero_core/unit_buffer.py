"""One stage-3 unit's runtime state: its full buffer, whether it is gathered, and the gather in flight.

The layout (``zero_core.layout.Bucket``) is frozen; what changes while training lives here, one object per unit,
held by the stage-3 store in a list indexed by ``Bucket.index``.
"""

from __future__ import annotations

import torch

from zero_core.layout import Bucket
from zero_core.partitioned_param import mark_gathered, mark_released
from zero_core.shard_state import ShardState

__all__ = ["UnitBuffer"]


class UnitBuffer:
    """Unit ``bucket``'s full buffer (``padded_numel`` elements, compute dtype) that its parameters view while
    gathered; its storage is freed (``resize_(0)``) while released and re-allocated in place by the next gather, so
    views autograd saved in forward see the re-gathered values in backward (PyTorch FSDP1 frees flat parameters the
    same way). ``inflight`` is the gather's ``(handle, out, event)`` while ``state`` is GATHERING."""

    __slots__ = ("bucket", "full", "state", "inflight")

    def __init__(self, bucket: Bucket, full: torch.Tensor) -> None:
        self.bucket = bucket
        self.full: torch.Tensor | None = full
        self.state = ShardState.SHARDED
        self.inflight: tuple | None = None

    def allocate(self) -> None:
        """Give the full buffer its storage back (its values are undefined until a gather fills it)."""
        self.full.untyped_storage().resize_(self.bucket.padded_numel * self.full.element_size())

    def point_params(self) -> None:
        """Make each parameter's ``.data`` a view of its slot in the full buffer."""
        full = self.full
        mark_gathered(self.bucket.slots)  # before the swaps: no Python on them, nor on the forward's ops
        for s in self.bucket.slots:
            s.param.data = full[s.bucket_offset : s.bucket_offset + s.numel].view(s.shape)

    def free(self) -> None:
        """Free the full buffer's storage; each parameter's ``.data`` becomes an empty tensor, so reading a released
        parameter gives ``numel() == 0``, never freed memory."""
        self.full.untyped_storage().resize_(0)
        empty = self.full.new_empty(0)
        for s in self.bucket.slots:
            s.param.data = empty
        mark_released(self.bucket.slots)  # in-place writes into the placeholders raise

    def detach_params(self) -> None:
        """Give each parameter its own dense storage holding its current (gathered) values; the buffer is dropped."""
        full = self.full
        for s in self.bucket.slots:
            s.param.data = full[s.bucket_offset : s.bucket_offset + s.numel].view(s.shape).clone()
        self.full = None
