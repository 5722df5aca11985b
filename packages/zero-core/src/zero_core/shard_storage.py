"""Where stage 3 keeps this rank's stored chunk of each unit between gathers: the storage policy ``Stage3`` is given.

A unit's *stored chunk* is this rank's ``b.chunk`` elements of bucket ``b`` in the storage dtype
(``PrecisionPolicy.param_dtype``): what its all-gather sends, what a step writes, what a checkpoint reads.
:class:`ShardStorage` is what the stage-3 store asks of the place the chunks live in; the store itself (units,
hooks, gathers, prefetch, reuse) is the same whatever the policy:

* :class:`DeviceShards`, the default: one tensor per flat group on the compute device, each chunk a view of it,
  sent as it is (several adjacent units by one batched all-gather). With ``stage3_shared_shards`` a flat group's
  tensor lives in a ``zero_comm`` shared-memory window the peers map, and a gather copies every rank's chunk
  straight from its shard (:meth:`DeviceShards.gather_unit`, no collective);
* ``zero_core.frozen_quant.QuantizedFrozenChunks`` (``zero_quantized_nontrainable_weights``): the frozen flat
  groups' chunks as int8 blocks, gathered as such and dequantized;
* zero_offload's host memory and NVMe policies (``zero_offload.param_store.HostShards``,
  ``zero_offload.param_nvme.NVMeShards``): a chunk off the device is copied to a device buffer when its gather is
  issued (:meth:`ShardStorage.source`, on the gather stream), one unit per all-gather.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import torch
from torch.profiler import record_function

from zero_comm.window import SharedWindow, shared_window
from zero_core.layout import Bucket, FlatGroup

__all__ = ["DeviceShards", "ShardStorage", "UnitSchedule"]


class UnitSchedule(Protocol):
    """What a storage that reads ahead (NVMe) may ask the stage-3 store while it issues a gather."""

    def units_after(self, b: Bucket) -> Iterator[Bucket]:
        """The released units gathered after ``b`` in the recorded order of this phase (forward: later ones;
        backward: earlier ones), nearest first; empty while no order is recorded."""
        ...

    def finish_gather(self, b: Bucket) -> None:
        """Wait for unit ``b``'s gather in flight, if any: what it sends is free afterwards."""
        ...


@runtime_checkable
class ShardStorage(Protocol):
    """Where this rank's stored chunk of each unit lives (see the module docstring). Chunks are ``b.chunk``
    elements in the storage dtype; the stage-3 store calls :meth:`allocate` once, then writes every unit's
    starting chunk (``open_chunk``/``close_chunk``, in flat order, so a policy can stream units to their storage
    one at a time), then :meth:`flush`."""

    offloaded: bool
    """True when the chunks live off the compute device (host memory, NVMe): a master store may then take gradient
    shards without a device copy of the parameters, and memory comes first (one unit per all-gather)."""

    batches: bool
    """True when several units' chunks may be sent by one all-gather (their chunks are views of one device tensor
    per flat group, side by side in unit order)."""

    def allocate(self, groups: list[FlatGroup]) -> None:
        """Make room for the stored shards of ``groups`` (each ``shard_numel`` elements; collective where the
        storage is shared between ranks)."""
        ...

    def shard(self, g: FlatGroup) -> torch.Tensor | None:
        """Flat group ``g``'s stored shard as one tensor on the compute device that *is* the storage (writes are
        stored), or None where it lives elsewhere; each unit's chunk is then ``shard[b.shard_slice()]``, sent by its
        all-gather as it is."""
        ...

    def source(self, b: Bucket, ahead: bool, schedule: UnitSchedule) -> torch.Tensor:
        """Unit ``b``'s chunk on the compute device, for its all-gather (asked only where :meth:`shard` is None);
        called on the gather stream when the gather is issued (``ahead``: by a prefetch), and kept alive until
        :meth:`gathered`."""
        ...

    def gathered(self, b: Bucket) -> None:
        """Unit ``b``'s all-gather from :meth:`source` completed: what it staged may go."""
        ...

    def read_chunk(self, b: Bucket) -> torch.Tensor:
        """Unit ``b``'s stored chunk wherever it lives (storage dtype; may be a view valid until the next read)."""
        ...

    def open_chunk(self, b: Bucket, keep: bool) -> torch.Tensor:
        """A tensor of ``b.chunk`` elements to fill with unit ``b``'s new values, stored by :meth:`close_chunk`;
        ``keep``: it starts with the stored values (else its contents are undefined)."""
        ...

    def close_chunk(self, b: Bucket) -> None:
        """Store the chunk :meth:`open_chunk` gave for ``b`` (:meth:`flush` waits until it is stored)."""
        ...

    def flush(self) -> None:
        """Wait until every chunk closed so far is stored."""
        ...

    def resident(self) -> list[torch.Tensor]:
        """The tensors this storage keeps on the compute device (``zero_core.memory``)."""
        ...

    def close(self) -> None:
        """Free the storage (the store has given every parameter its own values first)."""
        ...


class DeviceShards:
    """The default :class:`ShardStorage`: one tensor per flat group on the compute device (in a shared-memory
    window with ``stage3_shared_shards``).

    Args:
        group / world: the data-parallel process group and its size.
        dtype: the storage dtype.
        shared: ``stage3_shared_shards`` (True, False or ``"auto"``) as it applies here: callers pass False where
            the shards must stay in their own storage (ZeRO++ qwZ/hpZ, offload), with ``refused`` saying why.
        refused: why shared windows are off although asked for (warned when ``shared`` is True), or None.

    Attributes:
        windows: per flat group (``FlatGroup.index``), the shared window holding its shard, or None.
    """

    offloaded = False
    batches = True

    def __init__(self, *, group, world: int, dtype: torch.dtype, shared: bool | str = False,
                 refused: str | None = None):  # fmt: skip
        self.group, self.world, self.dtype = group, world, dtype
        self.shared, self.refused = shared, refused
        self.shards: dict[int, torch.Tensor] = {}  # FlatGroup.index -> its stored shard
        self.windows: dict[int, SharedWindow] = {}

    def allocate(self, groups: list[FlatGroup]) -> None:
        for g in groups:
            window = self._window(g)
            if window is not None:
                self.windows[g.index] = window
                self.shards[g.index] = window.local  # zero-filled (untouched pages of a fresh segment)
            else:
                # empty: the chunks tile the shard and each is written once, so pages become resident unit by unit
                self.shards[g.index] = torch.empty(g.shard_numel, dtype=self.dtype, device=g.device)

    def _window(self, g: FlatGroup) -> SharedWindow | None:
        """``g``'s shared-memory window, or None: gathers then all-gather. Collective; every input to the choice is
        the same on every rank (config, world, device type)."""
        if self.shared is False or self.world == 1 or g.device.type != "cpu":
            return None
        why = self.refused
        window = None if why else shared_window(self.group, g.shard_numel, self.dtype)
        if window is None and self.shared is True:
            why = why or "the ranks cannot map one another's /dev/shm segments (several hosts, no space, or " \
                         "ZERO_COMM_SHM=0)"  # fmt: skip
            warnings.warn(f"stage3_shared_shards: true, but stage 3 all-gathers instead: {why}", stacklevel=2)
        return window

    def shard(self, g: FlatGroup) -> torch.Tensor | None:
        return self.shards.get(g.index)

    def source(self, b: Bucket, ahead: bool, schedule: UnitSchedule) -> torch.Tensor:
        return self.shards[b.group.index][b.shard_slice()]

    def gathered(self, b: Bucket) -> None:
        """Nothing staged: the chunk is sent from the shard itself."""

    def read_chunk(self, b: Bucket) -> torch.Tensor:
        return self.shards[b.group.index][b.shard_slice()]

    def open_chunk(self, b: Bucket, keep: bool) -> torch.Tensor:
        """The stored chunk itself."""
        return self.shards[b.group.index][b.shard_slice()]

    def close_chunk(self, b: Bucket) -> None:
        """Nothing: :meth:`open_chunk` gave the stored chunk itself."""

    def flush(self) -> None:
        """Nothing: every write is stored when it is made."""

    def fence(self) -> None:
        """Every rank's writes to its shards so far are visible to every peer's reads after this (a barrier, only
        where shards live in shared windows). Collective."""
        if self.windows:
            with record_function("zero::fence"):
                next(iter(self.windows.values())).fence()

    def gather_unit(self, b: Bucket, full: torch.Tensor) -> None:
        """Fill ``full`` (``b.padded_numel`` elements) with unit ``b`` from its flat group's shared window: each
        rank's chunk copied from its stored shard, no collective (what the all-gather would give)."""
        self.windows[b.group.index].gather(full[: b.padded_numel], b.shard_offset, b.chunk)

    def resident(self) -> list[torch.Tensor]:
        return list(self.shards.values())

    def close(self) -> None:
        self.shards.clear()
        for w in self.windows.values():
            w.close()
        self.windows.clear()
