"""One stage-3 unit's runtime state: its full buffer, whether it is gathered, the gather in flight, where its stored
chunk lives, and who holds it gathered.

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
    same way).

    Args:
        bucket: the unit.
        full: its full buffer.
        storage: the ``zero_core.shard_storage.ShardStorage`` holding its stored chunk.
        stored: that chunk itself on the compute device (a view of the stored shard, sent as it is), or None: the
            storage gives it at each gather (``source``).
        shared: its flat group's shard lives in a shared window: a gather copies the peers' chunks on the calling
            thread (no collective), so it is never prefetched nor kept for a reuse.
        packed: its chunk is held as int8 blocks, which its storage gathers itself (``gather_unit``).

    Attributes:
        state: SHARDED (released), GATHERING (``inflight`` is the gather's ``(handle, out, event)``) or GATHERED.
        held: ``GatheredParameters`` / ``gathered_for_compute`` blocks holding it (module forwards leave it alone).
        pinned: holds that forbid its release: the blocks above, and the forwards of modules reading it as an
            external parameter while they run.
        kept: gathered past its module's forward for a near reuse (released first when room is needed).
    """

    __slots__ = ("bucket", "full", "storage", "stored", "shared", "packed", "state", "inflight", "held", "pinned",
                 "kept")  # fmt: skip

    def __init__(self, bucket: Bucket, full: torch.Tensor, storage, stored: torch.Tensor | None, *,
                 shared: bool = False, packed: bool = False) -> None:  # fmt: skip
        self.bucket = bucket
        self.full: torch.Tensor | None = full
        self.storage = storage
        self.stored = stored
        self.shared = shared
        self.packed = packed
        self.state = ShardState.SHARDED
        self.inflight: tuple | None = None
        self.held = 0
        self.pinned = 0
        self.kept = False

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
