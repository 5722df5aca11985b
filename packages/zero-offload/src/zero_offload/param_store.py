"""``OffloadParamStore``: stage 3 with each rank's parameter shards in host memory between uses (ZeRO-Offload's
parameter part, DeepSpeed's ``offload_param: {"device": "cpu"}``).

A plug-in of zero_core's parameter-store variation point (``ZeroRuntime(..., param_store=OffloadParamStore())``):
it is zero_core's :class:`~zero_core.stage3.Stage3` (units, hooks, recorded order, prefetch, reuse, divergence
checks all unchanged) with the stored shards moved off the device:

* ``attach``: the shards are materialised as usual, then moved to host buffers (pinned where an accelerator
  exists, ``offload_param.pin_memory``); ``Stage3.param_shard`` holds None, so nothing of them stays on the device;
* ``gather_source`` (zero_core's storage hook): when a unit's all-gather is issued, its chunk is copied from host
  memory into a fresh device buffer (``b.chunk`` elements) and gathered from there. Prefetch issues gathers ahead
  of their unit along the order zero_core records, so the copies run ahead too; on CUDA the copy is asynchronous
  from pinned memory, on zero_core's gather stream before the gather (so it overlaps compute). The buffer is
  dropped when the gather ends;
* ``refresh``: the master store writes the stepped values straight into the host shards (host to host with
  ``offload_optimizer: cpu``; one device-to-host copy per bucket otherwise); persistent units are re-gathered.

What stays on the device per rank: the persistent units' full buffers (``stage3_param_persistence_threshold``),
the units gathered at the moment, the gradient shard, and (without ``offload_optimizer``) the master shard and the
optimizer state. On a CPU-only machine host and device are the same memory, but the same buffers and copies are
made, so CI runs the GPU's code path. DeepSpeed keeps ``ds_tensor`` (the partition) on the host and copies it to
the device inside its all-gather (``partition_parameters.py``); this mirrors that.
"""

from __future__ import annotations

import torch

from zero_core.stage3 import Stage3
from zero_offload.host_memory import host_empty

PIN_KEY = "zero_optimization.offload_param.pin_memory"


class OffloadParamStore(Stage3):
    """Stage 3 with parameter shards in host memory; see the module docstring.

    Args:
        pin_memory: ``offload_param.pin_memory`` (page-locked host shards; falls back to pageable memory with one
            warning where pinning is impossible, e.g. CPU-only torch).

    Attributes:
        host: flat-group index -> this rank's stored shard in host memory (``shard_numel`` elements, storage dtype).
        copies: counters, ``to_device`` (chunks copied host -> device), ``to_device_bytes``, ``ahead`` (of those,
            copies made for a prefetch, i.e. before their unit's module ran), ``to_host_bytes`` (stepped values
            written into the host shards).

    Raises (from ``attach``):
        ValueError: hpZ (``zero_hpz_partition_size`` > 1), whose secondary shards are built from device shards.
    """

    # each unit's chunk is copied (or read) from host memory when its gather is issued: one unit at a time keeps
    # host memory and the read buffers at one chunk per gather in flight
    batches_gathers = False
    offloaded = True

    def __init__(self, *, pin_memory: bool = False):
        super().__init__()
        self.pin_memory = pin_memory
        self.host: dict[int, torch.Tensor] = {}
        self._staged: dict = {}  # unit -> its device chunk, alive until the gather completes
        self._ahead = False
        self.copies = {"to_device": 0, "to_device_bytes": 0, "ahead": 0, "to_host_bytes": 0}

    def attach(self, runtime) -> None:
        if runtime.zeropp.hpz is not None:
            raise ValueError("zero_optimization.offload_param with zero_hpz_partition_size > 1 is not supported: hpZ "
                             "builds its secondary shards from device-resident shards")  # fmt: skip
        super().attach(runtime)

    # ---------------------------------------------------------------- storage
    def _begin_shard(self, g) -> None:
        """Materialisation: the host shard is allocated; the device keeps no shard (``param_shard`` stays None)."""
        dtype = self.rt.precision.param_dtype
        self.host[g.index] = host_empty(g.shard_numel, dtype, pin_memory=self.pin_memory, key=PIN_KEY).zero_()

    @torch.no_grad()
    def _keep_chunk(self, b, chunk: torch.Tensor) -> None:
        self.host[b.group.index][b.shard_offset : b.shard_offset + b.chunk].copy_(chunk)

    def read_chunk(self, b) -> torch.Tensor:
        """This rank's stored chunk of unit ``b`` in host memory (``b.chunk`` elements, storage dtype); valid until
        the next ``read_chunk`` (the NVMe store reuses its buffers)."""
        return self.host[b.group.index][b.shard_offset : b.shard_offset + b.chunk]

    def write_chunk(self, b, fill) -> None:
        """Store new values of unit ``b``'s chunk: ``fill(dst)`` writes them into a host tensor of ``b.chunk``
        elements (storage dtype)."""
        fill(self.host[b.group.index][b.shard_offset : b.shard_offset + b.chunk])

    def open_chunk(self, b, keep: bool) -> torch.Tensor:
        """Unit ``b``'s chunk to fill in place (``b.chunk`` elements, storage dtype), stored by ``close_chunk(b)``;
        ``keep``: it starts with the stored values (else its contents are undefined). In host memory: the host
        chunk itself."""
        return self.host[b.group.index][b.shard_offset : b.shard_offset + b.chunk]

    def close_chunk(self, b) -> None:
        """Store the chunk ``open_chunk(b)`` gave (in host memory: already stored)."""

    def flush(self) -> None:
        """Wait until every ``write_chunk`` is stored (a no-op in host memory)."""

    def gather(self, b, *, async_op: bool = False, phase: int | None = None, exact: bool = False) -> None:
        self._ahead = async_op  # an asynchronous gather is a prefetch (or a persistent unit after the step)
        try:
            super().gather(b, async_op=async_op, phase=phase, exact=exact)
        finally:
            self._ahead = False

    def gather_source(self, b) -> torch.Tensor:
        """Copy ``b``'s chunk from host memory to a new device buffer and return it (zero_core's storage hook)."""
        if self.param_shard[b.group.index] is not None:  # still materialising (qwZ re-gathers persistent units there)
            return super().gather_source(b)
        src = self.read_chunk(b)
        dev = torch.empty(b.chunk, dtype=src.dtype, device=self.rt.device)
        dev.copy_(src, non_blocking=src.is_pinned())
        self._staged[b] = dev
        self.copies["to_device"] += 1
        self.copies["to_device_bytes"] += dev.numel() * dev.element_size()
        self.copies["ahead"] += int(self._ahead)
        return dev

    def _wait(self, b) -> None:
        super()._wait(b)
        self._staged.pop(b, None)

    @torch.no_grad()
    def write_shard(self, b, chunk: torch.Tensor) -> None:
        """``GatheredParameters`` edits: ``chunk`` becomes this rank's host chunk of ``b``."""
        self.write_chunk(b, lambda dst: dst.copy_(chunk))
        self.flush()

    @torch.no_grad()
    def refresh(self, master) -> None:
        """After a step or load: the master writes each trainable unit's chunk into the host shard; persistent
        units are gathered again (through ``gather_source``). A master that wrote them during its step
        (``params_written``, NVMe with streamed gradients) is not asked again."""
        if master.params_written:
            master.params_written = False
            self._regather_persistent()
            return
        for g in self.rt.flat_groups:
            if g.group_index is None:
                continue
            for b in g.buckets:
                self.write_chunk(b, lambda dst, b=b: master.write_params(b, dst))
                self.copies["to_host_bytes"] += b.chunk * self.rt.precision.param_dtype.itemsize
        self.flush()
        self._regather_persistent()

    def shard_view(self, g) -> None:
        """None: the stored shard lives in host memory, so a device master store keeps its own copy."""
        return None

    def shard_values(self, g) -> torch.Tensor:
        """This rank's stored shard on the compute device (a copy; storage dtype)."""
        dtype = self.rt.precision.param_dtype
        out = torch.empty(g.shard_numel, dtype=dtype, device=self.rt.device)
        for b in g.buckets:
            out[b.shard_offset : b.shard_offset + b.chunk].copy_(self.read_chunk(b))
        return out

    @torch.no_grad()
    def load_frozen(self, g, shard: torch.Tensor) -> None:
        flat = shard.reshape(-1)
        for b in g.buckets:
            self.write_chunk(b, lambda dst, b=b: dst.copy_(flat[b.shard_offset : b.shard_offset + b.chunk]))
        self.flush()

    def host_bytes(self) -> int:
        """Host bytes of the stored shards (every flat group's ``shard_numel`` x storage element size)."""
        return sum(t.numel() * t.element_size() for t in self.host.values())

    def close(self) -> None:
        """zero_core's close (collective: each unit gathered once more, through the host copies), then the host
        shards are freed."""
        if self.rt is None:
            return
        super().close()
        self._staged.clear()
        self.host.clear()
