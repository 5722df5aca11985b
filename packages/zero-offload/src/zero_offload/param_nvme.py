"""Stage 3 with parameter shards in swap files (ZeRO-Infinity's parameter part, DeepSpeed's
``offload_param: {"device": "nvme"}``).

:class:`NVMeShards` is :class:`~zero_offload.param_store.HostShards` with the host shards replaced by one swap file
per unit, named after the unit's first parameter (``param.<name>.swp``, stable across runs) in the folder zero owns
under ``nvme_path`` (:class:`~zero_offload.swap_folder.SwapFolder`):

* units are kept in host memory, in flat order, while their chunks total at most ``max_in_cpu`` elements; the
  others live only in their file;
* a unit's gather (``source``) takes its chunk from a read already in flight or reads it now, then starts reads of
  the next units along the order zero_core recorded (forward order in forward, reverse in backward: the store's
  ``units_after``), as many as the free buffers allow; the reads go through zero_kernels' aio engine into
  ``buffer_count`` aligned host buffers of at most ``buffer_size`` elements;
* a write (the step's new values, ``open_chunk``/``close_chunk``) fills a free buffer and starts its write;
  ``flush`` waits for all. A read of a unit whose write is in flight waits for the write first; a read started
  ahead of a write is dropped.

DeepSpeed swaps parameters through the same pool of ``buffer_count`` x ``buffer_size`` buffers
(``partitioned_param_swapper.py``) and fails mid-run when they are too few or small; here a unit chunk larger than
``buffer_size`` is an error at start-up naming both keys and the size needed. :class:`NVMeParamStore` builds the
store (what ``ZeroRuntime(param_store=...)`` takes).
"""

from __future__ import annotations

import torch

from zero_core.layout import Bucket, FlatGroup
from zero_core.param_store import ParamStoreInputs
from zero_core.shard_storage import UnitSchedule
from zero_core.stage3 import Stage3
from zero_kernels.aio import AsyncIO, aligned_empty
from zero_offload.host_memory import host_empty
from zero_offload.param_store import PIN_KEY, HostShards
from zero_offload.swap_folder import SwapFolder

__all__ = ["NVMeParamStore", "NVMeShards"]

ALIGN = 4096


def _padded(numel: int, dtype: torch.dtype) -> int:
    """Elements of ``dtype`` covering ``numel`` rounded up to whole 4 KiB blocks (O_DIRECT transfers)."""
    item = dtype.itemsize
    return -(-numel * item // ALIGN) * ALIGN // item


class NVMeShards(HostShards):
    """Stage 3's stored chunks in swap files; see the module docstring.

    Args:
        folder: this rank's swap folder (checked and owned by zero; closed with the storage).
        io: the aio engine for ``folder``.
        dtype / device / pin_memory: as :class:`~zero_offload.param_store.HostShards` (``pin_memory``: the resident
            host chunks).
        buffer_count, buffer_size, max_in_cpu: the ``offload_param`` keys (buffers; elements per buffer; elements
            kept in host memory).

    Attributes:
        swap: counters, ``started_ahead`` (reads started along the recorded order before their unit's gather),
            ``read_ahead`` (of those, the ones a gather then used), ``read_now`` (reads a gather started itself),
            ``dropped`` (reads ahead given up: written over, or their buffer needed), ``sent_from_buffer``
            (gathers that sent straight from the read buffer, no chunk copy: CPU device), ``gather_waited``
            (buffers taken back from a gather in flight, which was waited for first); the aio engine's
            ``reads``/``writes`` count every transfer (``reads == started_ahead + read_now``).

    Raises (from ``allocate``):
        ValueError: a unit's chunk (padded to 4 KiB) is larger than ``offload_param.buffer_size``; the message
            names ``buffer_size`` and ``buffer_count`` and the elements needed.
    """

    def __init__(self, folder: SwapFolder, io: AsyncIO, *, dtype: torch.dtype, device: torch.device,
                 pin_memory: bool = False, buffer_count: int = 5, buffer_size: int = 100_000_000,
                 max_in_cpu: int = 1_000_000_000):  # fmt: skip
        super().__init__(dtype=dtype, device=device, pin_memory=pin_memory)
        if buffer_count < 1:
            raise ValueError(f"zero_optimization.offload_param.buffer_count must be >= 1, got {buffer_count}")
        self.folder, self.io = folder, io
        self.buffer_count, self.buffer_size, self.max_in_cpu = buffer_count, buffer_size, max_in_cpu
        self.host_chunks: dict[Bucket, torch.Tensor] = {}  # unit -> its chunk in host memory
        self.files: dict[Bucket, object] = {}  # unit -> swap file path
        self.buffers: list[torch.Tensor] = []
        self._free: list[int] = []
        self._reading: dict = {}  # unit -> (handle, buffer index): reads in flight
        self._writing: dict = {}  # unit -> (handle, buffer index): writes in flight
        self._lent: int | None = None  # the buffer the last read returned
        self._held: dict = {}  # unit -> buffer index its all-gather sends from (CPU device), until the gather ends
        self._open: dict = {}  # unit -> buffer index being filled (open_chunk), until close_chunk writes it
        # the store whose gathers send from held buffers (given with every source call): asked to finish one
        # when every buffer is held
        self._gathers: UnitSchedule | None = None
        self.swap = {"started_ahead": 0, "read_ahead": 0, "read_now": 0, "dropped": 0, "sent_from_buffer": 0,
                     "gather_waited": 0}  # fmt: skip

    # ---------------------------------------------------------------- set-up
    def allocate(self, groups: list[FlatGroup]) -> None:
        """Plan where each unit lives (host memory while ``max_in_cpu`` allows, else its swap file) and allocate
        the resident chunks and the swap buffers; the store then writes units one at a time (no whole shard is ever
        held in host memory)."""
        kept, largest = 0, 0
        swapped = []
        for g in groups:
            for b in g.buckets:
                if kept + b.chunk <= self.max_in_cpu:
                    kept += b.chunk
                    self.host_chunks[b] = host_empty(b.chunk, self.dtype, pin_memory=self.pin_memory, key=PIN_KEY)
                else:
                    swapped.append(b)
                    largest = max(largest, _padded(b.chunk, self.dtype))
        if largest > self.buffer_size:
            raise ValueError(f"zero_optimization.offload_param.buffer_size={self.buffer_size} is smaller than the "
                             f"largest unit chunk to swap ({largest} elements, padded to 4 KiB); set buffer_size >= "
                             f"{largest} (offload_param.buffer_count={self.buffer_count} buffers of it are "
                             "allocated)")  # fmt: skip
        if swapped:
            self.buffers = [aligned_empty(largest, self.dtype) for _ in range(self.buffer_count)]
            self._free = list(range(self.buffer_count))
        for b in swapped:
            self.files[b] = self.folder.file(f"param.{b.slots[0].name}.swp")

    # ---------------------------------------------------------------- buffers
    def _take(self) -> int:
        """A free buffer index; when none is free: the buffer last lent (its reader has copied it), else the oldest
        write waited for, else the oldest read ahead dropped, else the oldest gather sending from one finished."""
        if not self._free and self._lent is not None:
            self._free.append(self._lent)
            self._lent = None
        if not self._free and self._writing:
            self._finish_write(next(iter(self._writing)))
        if not self._free and self._reading:
            self._drop_read(next(iter(self._reading)))
        if not self._free and self._held:  # every buffer is being sent: the oldest gather finishes first
            u = next(iter(self._held))
            self._gathers.finish_gather(u)  # its end (``gathered``) gives the buffer back
            if u in self._held:  # its gather failed to start: nothing reads the buffer
                self._free.append(self._held.pop(u))
            else:
                self.swap["gather_waited"] += 1
        return self._free.pop()

    def _view(self, i: int, b: Bucket) -> torch.Tensor:
        return self.buffers[i][: _padded(b.chunk, self.buffers[i].dtype)]

    def _finish_write(self, b: Bucket) -> None:
        handle, i = self._writing.pop(b)
        self.io.wait(handle)
        self._free.append(i)

    def _drop_read(self, b: Bucket) -> None:
        handle, i = self._reading.pop(b)
        self.io.wait(handle)
        self._free.append(i)
        self.swap["dropped"] += 1

    def _start_read(self, b: Bucket) -> None:
        if b in self._writing:
            self._finish_write(b)
        i = self._take()
        self._reading[b] = (self.io.read(self._view(i, b), self.files[b]), i)

    # ---------------------------------------------------------------- storage
    def read_chunk(self, b: Bucket) -> torch.Tensor:
        """``b``'s chunk: resident, from its read in flight, or read now. A swapped chunk is a view of a buffer,
        valid until the next read or write."""
        if b in self.host_chunks:
            return self.host_chunks[b]
        if self._lent is not None:
            self._free.append(self._lent)
            self._lent = None
        if b in self._reading:
            self.swap["read_ahead"] += 1
        else:
            self.swap["read_now"] += 1
            self._start_read(b)
        handle, i = self._reading.pop(b)
        self.io.wait(handle)
        self._lent = i
        return self.buffers[i][: b.chunk]

    def source(self, b: Bucket, ahead: bool, schedule: UnitSchedule) -> torch.Tensor:
        """``b``'s chunk for its all-gather; a swapped one's read is followed by reads ahead along the recorded
        order (``schedule.units_after``). On a CPU device a swapped chunk's read buffer itself is sent (no chunk
        copy, one chunk less of host memory per gather in flight): the buffer stays with the gather until it ends
        (``gathered``), or until a buffer is needed and none is free (that gather is then finished first). On an
        accelerator, and for resident chunks, the chunk is copied to a device buffer."""
        self._gathers = schedule
        if b in self.host_chunks:
            return self._to_device(b, self.host_chunks[b], ahead)
        src = self.read_chunk(b)
        self._read_ahead(b, schedule)
        if self.device.type != "cpu":
            return self._to_device(b, src, ahead)
        self._held[b], self._lent = self._lent, None
        self.swap["sent_from_buffer"] += 1
        return src

    def gathered(self, b: Bucket) -> None:
        super().gathered(b)
        i = self._held.pop(b, None)
        if i is not None:
            self._free.append(i)

    def _read_ahead(self, b: Bucket, schedule: UnitSchedule) -> None:
        """Start reads of the released units that come after ``b`` in the recorded order (reverse in backward),
        while a buffer is free; resident units and reads in flight are passed over."""
        for u in schedule.units_after(b):
            if not self._free:
                break
            if u in self.host_chunks or u in self._reading:
                continue
            self._start_read(u)
            self.swap["started_ahead"] += 1

    def open_chunk(self, b: Bucket, keep: bool) -> torch.Tensor:
        """A swap buffer to fill with unit ``b``'s new values (read from its file first when ``keep``); the buffer
        stays with ``b`` until ``close_chunk(b)`` starts its write. Resident chunks: the chunk itself."""
        if b in self.host_chunks:
            return self.host_chunks[b]
        if b in self._reading:
            self._drop_read(b)
        if b in self._writing:
            self._finish_write(b)
        i = self._take()
        view = self._view(i, b)
        if keep:
            self.io.wait(self.io.read(view, self.files[b]))
        self._open[b] = i
        return view[: b.chunk]

    def close_chunk(self, b: Bucket) -> None:
        """Start the write of the chunk ``open_chunk(b)`` gave (padding zeroed); ``flush`` waits for it."""
        super().close_chunk(b)  # counted
        if b in self.host_chunks:
            return
        i = self._open.pop(b)
        view = self._view(i, b)
        view[b.chunk :].zero_()
        self._writing[b] = (self.io.write(view, self.files[b]), i)

    def flush(self) -> None:
        for b in list(self._writing):
            self._finish_write(b)

    def host_bytes(self) -> int:
        """Host bytes of the resident chunks and the swap buffers."""
        tensors = list(self.host_chunks.values()) + self.buffers
        return sum(t.numel() * t.element_size() for t in tensors)

    def close(self) -> None:
        """Reads in flight dropped, writes finished, the swap files removed."""
        for b in list(self._reading):
            self._drop_read(b)
        self.flush()
        self.io.close()
        self.folder.close()
        self.host_chunks.clear()
        self.buffers, self._free, self._lent = [], [], None
        self._gathers = None
        super().close()


class NVMeParamStore:
    """Builds zero_core's ``Stage3`` with its stored shards in swap files (:class:`NVMeShards`): what
    ``ZeroRuntime(param_store=...)`` takes (a builder, called with the runtime's ``ParamStoreInputs``).

    Args: as :class:`NVMeShards` less ``dtype`` and ``device`` (the runtime's).
    """

    def __init__(self, folder: SwapFolder, io: AsyncIO, *, pin_memory: bool = False, buffer_count: int = 5,
                 buffer_size: int = 100_000_000, max_in_cpu: int = 1_000_000_000):  # fmt: skip
        if buffer_count < 1:
            raise ValueError(f"zero_optimization.offload_param.buffer_count must be >= 1, got {buffer_count}")
        self.folder, self.io, self.pin_memory = folder, io, pin_memory
        self.buffer_count, self.buffer_size, self.max_in_cpu = buffer_count, buffer_size, max_in_cpu

    def __call__(self, inputs: ParamStoreInputs) -> Stage3:
        storage = NVMeShards(self.folder, self.io, dtype=inputs.precision.param_dtype, device=inputs.device,
                             pin_memory=self.pin_memory, buffer_count=self.buffer_count, buffer_size=self.buffer_size,
                             max_in_cpu=self.max_in_cpu)  # fmt: skip
        return Stage3.from_inputs(inputs, storage=storage)
