"""Stage 3 with each rank's parameter shards in host memory between uses (ZeRO-Offload's parameter part,
DeepSpeed's ``offload_param: {"device": "cpu"}``).

:class:`HostShards` is a storage policy of zero_core's stage-3 store (``zero_core.shard_storage.ShardStorage``):
zero_core's ``Stage3`` (units, hooks, recorded order, prefetch, reuse, divergence checks all its own) keeps its
stored shards here instead of on the device:

* materialising: each unit's starting chunk is written into the host shard (pinned where an accelerator exists,
  ``offload_param.pin_memory``); the device keeps no shard;
* a unit's gather (``source``): its chunk is copied from host memory into a fresh device buffer (``b.chunk``
  elements) when the all-gather is issued, on zero_core's gather stream (asynchronous from pinned memory on CUDA,
  so it overlaps compute), and gathered from there; prefetch issues gathers ahead of their unit along the order
  zero_core records, so the copies run ahead too. The buffer goes when the gather ends (``gathered``);
* after a step: the master store writes the stepped values straight into the host shards (host to host with
  ``offload_optimizer: cpu``; one device-to-host copy per unit otherwise); persistent units are re-gathered.

With offload the store gathers one unit per all-gather (memory first: ``batches`` False), so host memory holds one
device chunk per gather in flight. What stays on the device per rank: the persistent units' full buffers
(``stage3_param_persistence_threshold``), the units gathered at the moment, the gradient shard, and (without
``offload_optimizer``) the master shard and the optimizer state. On a CPU-only machine host and device are the same
memory, but the same buffers and copies are made, so CI runs the GPU's code path. DeepSpeed keeps ``ds_tensor``
(the partition) on the host and copies it to the device inside its all-gather (``partition_parameters.py``); this
mirrors that. :class:`OffloadParamStore` builds the store (what ``ZeroRuntime(param_store=...)`` takes).
"""

from __future__ import annotations

import torch

from zero_core.layout import Bucket, FlatGroup
from zero_core.param_store import ParamStoreInputs
from zero_core.shard_storage import UnitSchedule
from zero_core.stage3 import Stage3
from zero_offload.host_memory import host_empty

PIN_KEY = "zero_optimization.offload_param.pin_memory"

__all__ = ["HostShards", "OffloadParamStore"]


class HostShards:
    """Stage 3's stored chunks in host memory (see the module docstring).

    Args:
        dtype: the storage dtype.
        device: the compute device (where a gathered chunk is copied to).
        pin_memory: ``offload_param.pin_memory`` (page-locked host shards; falls back to pageable memory with one
            warning where pinning is impossible, e.g. CPU-only torch).

    Attributes:
        host: flat-group index -> this rank's stored shard in host memory (``shard_numel`` elements, storage dtype).
        copies: counters, ``to_device`` (chunks copied host -> device), ``to_device_bytes``, ``ahead`` (of those,
            copies made for a prefetch, i.e. before their unit's module ran), ``to_host_bytes`` (values written
            into the host shards: materialisation, steps, loads, edits).
    """

    offloaded = True
    # each unit's chunk is copied (or read) from host memory when its gather is issued: one unit at a time keeps
    # host memory and the read buffers at one chunk per gather in flight
    batches = False

    def __init__(self, *, dtype: torch.dtype, device: torch.device, pin_memory: bool = False):
        self.dtype, self.device, self.pin_memory = dtype, device, pin_memory
        self.host: dict[int, torch.Tensor] = {}
        self._staged: dict[Bucket, torch.Tensor] = {}  # unit -> its device chunk, alive until the gather completes
        self.copies = {"to_device": 0, "to_device_bytes": 0, "ahead": 0, "to_host_bytes": 0}

    def allocate(self, groups: list[FlatGroup]) -> None:
        """The host shards (zero-filled); the device keeps none."""
        for g in groups:
            self.host[g.index] = host_empty(g.shard_numel, self.dtype, pin_memory=self.pin_memory, key=PIN_KEY).zero_()

    def shard(self, g: FlatGroup) -> None:
        """None: the stored shard lives in host memory, so a device master store keeps its own copy."""
        return None

    def read_chunk(self, b: Bucket) -> torch.Tensor:
        """This rank's stored chunk of unit ``b`` in host memory (``b.chunk`` elements, storage dtype)."""
        return self.host[b.group.index][b.shard_offset : b.shard_offset + b.chunk]

    def source(self, b: Bucket, ahead: bool, schedule: UnitSchedule) -> torch.Tensor:
        """Copy ``b``'s chunk from host memory to a new device buffer and return it."""
        return self._to_device(b, self.read_chunk(b), ahead)

    def _to_device(self, b: Bucket, src: torch.Tensor, ahead: bool) -> torch.Tensor:
        dev = torch.empty(b.chunk, dtype=src.dtype, device=self.device)
        # never a blocking copy: torch would then synchronise the host with the gather stream, which waits for all
        # the compute queued before it, so every prefetch would stall the host until the device drains (a pageable
        # chunk is staged by the driver before the call returns, so it may be written again right after)
        dev.copy_(src, non_blocking=True)
        self._staged[b] = dev
        self.copies["to_device"] += 1
        self.copies["to_device_bytes"] += dev.numel() * dev.element_size()
        self.copies["ahead"] += int(ahead)
        return dev

    def gathered(self, b: Bucket) -> None:
        """``b``'s gather ended: its device chunk goes."""
        self._staged.pop(b, None)

    def open_chunk(self, b: Bucket, keep: bool) -> torch.Tensor:
        """Unit ``b``'s chunk to fill in place: the host chunk itself (it starts with the stored values)."""
        return self.host[b.group.index][b.shard_offset : b.shard_offset + b.chunk]

    def close_chunk(self, b: Bucket) -> None:
        """Nothing to store: :meth:`open_chunk` gave the host chunk itself (counted in ``copies``)."""
        self.copies["to_host_bytes"] += b.chunk * self.dtype.itemsize

    def flush(self) -> None:
        """Nothing: host memory is written when it is written."""

    def resident(self) -> list[torch.Tensor]:
        """Nothing on the device between gathers."""
        return []

    def host_bytes(self) -> int:
        """Host bytes of the stored shards (every flat group's ``shard_numel`` x storage element size)."""
        return sum(t.numel() * t.element_size() for t in self.host.values())

    def close(self) -> None:
        """The host shards are freed."""
        self._staged.clear()
        self.host.clear()


class OffloadParamStore:
    """Builds zero_core's ``Stage3`` with its stored shards in host memory (:class:`HostShards`): what
    ``ZeroRuntime(param_store=...)`` takes (a builder, called with the runtime's ``ParamStoreInputs``).

    Args:
        pin_memory: ``offload_param.pin_memory``.

    Raises (when called):
        ValueError: hpZ (``zero_hpz_partition_size`` > 1), whose secondary shards are built from device shards.
    """

    def __init__(self, *, pin_memory: bool = False):
        self.pin_memory = pin_memory

    def __call__(self, inputs: ParamStoreInputs) -> Stage3:
        storage = HostShards(dtype=inputs.precision.param_dtype, device=inputs.device, pin_memory=self.pin_memory)
        return Stage3.from_inputs(inputs, storage=storage)
