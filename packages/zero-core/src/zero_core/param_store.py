"""Variation point 1: where parameters live between uses and how they are gathered after a step.

``ZeroRuntime`` holds one :class:`ParamStore`: :class:`DenseParamStore` at stages 0-2 (every parameter a view of
its bucket's full buffer, refreshed by one all-gather per bucket at the end of ``step()``) and
``zero_core.stage3.Stage3`` at stage 3 (units gathered before a module runs and released after). zero_offload
gives stage 3 another place for its stored shards (a ``zero_core.shard_storage.ShardStorage``: host memory, NVMe)
and zero_compile replaces the store with graph operations, both through ``ZeroRuntime(..., param_store=...)``.

Who calls what: the runtime builds the store first, with a builder given the :class:`ParamStoreInputs` (each store's
``from_inputs``); building materialises the storage from the module's current weights, rank 0's, with
``zero_core.materialize.bucket_values`` (parameters still partitioned by ``zero_init`` arrive with their records,
at every stage) and installs the hooks. The master store reads ``shard_view`` / ``shard_values`` while it is built;
``refresh(master)`` after every optimizer step and load (the store asks ``master.write_params(bucket, dst)`` for
each trainable bucket's chunk, then all-gathers; parameters are current when it returns, so no read can observe a
gather in flight); the reducer calls ``before_reduce()`` before it launches a reduction and
``on_grads_done(bucket)`` when a bucket's gradients are in; the runtime calls ``begin_backward`` /
``end_backward`` around autograd and ``close()`` last.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch.profiler import record_function

from zero_comm import all_gather_into_tensor
from zero_core.comm_context import CommContext
from zero_core.config import ZeroConfig
from zero_core.layout import Bucket, FlatGroup, ParamSlot
from zero_core.materialize import bucket_values
from zero_core.partition_records import forget
from zero_core.precision import PrecisionPolicy
from zero_core.shard_storage import ShardStorage
from zero_core.zeropp import ZeroPP

__all__ = ["DenseParamStore", "ParamStore", "ParamStoreInputs", "Stage3Settings"]


@dataclass(frozen=True)
class Stage3Settings:
    """The stage-3 keys of ``zero_optimization`` a parameter store reads, read once (see ``ZeroConfig``).

    Attributes:
        prefetch_numel: ``stage3_prefetch_bucket_size`` (elements one prefetch gathers at most).
        max_live: ``stage3_max_live_parameters`` (elements of non-persistent units gathered at once).
        reuse_distance: ``stage3_max_reuse_distance`` (elements).
        shared_shards: ``stage3_shared_shards`` (True, False or ``"auto"``).
        quantize_frozen: ``zero_quantized_nontrainable_weights``.
        quant_block / quantizer: ``zeropp_block_size`` / ``zeropp_quantizer`` (frozen int8 blocks).
        offloads: ``offload_optimizer`` or ``offload_param`` moves something off the device (memory first: one
            unit per all-gather).
    """

    prefetch_numel: int = 50_000_000
    max_live: int = 1_000_000_000
    reuse_distance: int = 1_000_000_000
    shared_shards: bool | str = False
    quantize_frozen: bool = False
    quant_block: int = 4096
    quantizer: str = "torch"
    offloads: bool = False

    @classmethod
    def from_config(cls, config: ZeroConfig) -> Stage3Settings:
        """The values of ``config``."""
        return cls(prefetch_numel=int(config.stage3_prefetch_bucket_size),
                   max_live=int(config.stage3_max_live_parameters),
                   reuse_distance=int(config.stage3_max_reuse_distance), shared_shards=config.stage3_shared_shards,
                   quantize_frozen=config.zero_quantized_nontrainable_weights, quant_block=config.zeropp_block_size,
                   quantizer=config.zeropp_quantizer, offloads=config.offloads)  # fmt: skip


@dataclass(frozen=True, eq=False)
class ParamStoreInputs:
    """What ``ZeroRuntime`` offers a parameter store: what a builder given to ``ZeroRuntime(param_store=...)``
    receives. A store takes the few it uses (each default store's ``from_inputs``) and keeps no reference to this.

    Attributes:
        module: the model.
        flat_groups: the layout (``zero_core.layout``): each flat group's buckets, stage 3's units.
        unit_owner: stage 3: ``id(param)`` -> the module whose forward gathers its unit.
        group / rank / world: the data-parallel process group, this rank in it, its size.
        settings: the stage-3 keys of the config.
        precision: the dtypes (storage ``param_dtype``, ``compute``).
        comm: the collective streams (``zero_core.comm_context``).
        zeropp: stage 3's ZeRO++ collectives (``zero_core.zeropp``); None below stage 3.
        forward_only: no optimizer: no backward will run.
        device: where the parameters live.
        wait_reduced: lands every gradient reduction in flight where reductions are streamed to the master store
            (stage 3's pre-backward calls it with offloaded shards, so one unit's gradient is in host memory at a
            time); a no-op otherwise. The reducer is built after the parameter store: this is the runtime's.
    """

    module: torch.nn.Module
    flat_groups: list[FlatGroup]
    unit_owner: dict[int, torch.nn.Module]
    group: object
    rank: int
    world: int
    settings: Stage3Settings
    precision: PrecisionPolicy
    comm: CommContext
    zeropp: ZeroPP | None
    forward_only: bool
    device: torch.device
    wait_reduced: Callable[[], None]


@runtime_checkable
class ParamStore(Protocol):
    """Where parameters live between uses (see the module docstring)."""

    offloaded: bool
    """True when the stored shards live off the compute device between uses (host memory or NVMe: zero_offload's
    parameter offload), so a master store may take gradient shards without a device copy of the parameters."""

    gathers_units: bool
    """True when parameters are released between uses and this store gathers them unit by unit outside forward
    (zero_core's ``Stage3``, whatever its shard storage; zero_compile's stage-3 store): it is then the
    ``zero_core.registry.UnitHolder`` that ``GatheredParameters`` and the ``ds_*`` properties ask."""

    def master_chunk(self, b: Bucket) -> torch.Tensor | None:
        """This rank's chunk of bucket ``b``'s full buffer (``b.chunk`` elements, compute dtype), when that buffer
        stays allocated and holds the values in the storage dtype, so a master of the same dtype can be that chunk
        itself (no second copy); else None (stage 3, whose buffers are freed between uses; offload)."""
        ...

    def shard_view(self, g: FlatGroup) -> torch.Tensor | None:
        """This rank's stored shard (``g.shard_numel`` elements) as one tensor that *is* the storage (writes reach
        the parameters), or None when it is not contiguous or not in the storage dtype."""
        ...

    def shard_values(self, g: FlatGroup) -> torch.Tensor:
        """This rank's stored shard (``g.shard_numel`` elements, storage dtype, zero padding); may be a copy."""
        ...

    def offloaded_chunks(self) -> ShardStorage | None:
        """Where the stored shards live off the device, unit by unit (the storage policy: ``read_chunk``,
        ``open_chunk``, ``close_chunk``, ``flush``), for a master store that steps into them; None otherwise."""
        ...

    def refresh(self, master) -> None: ...

    def resident(self) -> list[torch.Tensor]:
        """The tensors this store keeps for the parameters between uses (full buffers, stored shards, int8 blocks),
        for ``zero_core.memory``; the parameters' own views are counted there already."""
        ...

    def load_frozen(self, g: FlatGroup, shard: torch.Tensor) -> None:
        """Frozen group ``g`` (no master): take this rank's stored shard from ``shard`` (``shard_numel``)."""
        ...

    def before_write(self) -> None:
        """The stored shards are about to be written outside a step (a load, an edit): a store whose shards peers
        read directly (stage 3's shared windows) waits until no peer reads them. Collective."""
        ...

    def begin_backward(self) -> None: ...

    def end_backward(self) -> None: ...

    def before_reduce(self) -> None:
        """A gradient reduction is about to start on the ranks: finish any agreement the store left in flight
        (stage 3's forward-order check), so the reduction never meets ranks that ran different modules."""
        ...

    def on_grads_done(self, bucket: Bucket) -> None: ...

    def outside_writes(self) -> tuple[list[ParamSlot], torch.Tensor]:
        """The parameters whose in-place writes outside a gather this store watches (the same list, in the same
        order, on every rank) and, per parameter, how many of this rank's stored elements its gathered values no
        longer match (a float64 tensor on the store's device): a write that a step would silently undo. Stage 3
        watches its persistent units; stores whose parameters are partitioned only between uses watch none."""
        ...

    def empty_cache(self) -> None:
        """Release every parameter gathered outside its use (kept for reuse, prefetched, in flight) and forget the
        prefetch state (DeepSpeed's ``empty_partition_cache``); a no-op where parameters are always whole. Called on
        every rank at the same point, outside forward and backward."""
        ...

    def close(self) -> None: ...


class DenseParamStore:
    """Stages 0-2: one full compute-dtype buffer per flat group, parameters view it; all-gather after a step.

    Building it materialises the buffers from the module's weights (one collective per bucket) and points every
    parameter at its slot. The all-gather of bucket ``k`` runs while bucket ``k+1``'s chunk is written from the
    master, and all are finished before ``refresh`` returns: DeepSpeed's stages 1/2 also all-gather before
    ``step()`` returns, so no read, e.g. of a parameter used outside its module, sees stale or half-written values.

    Args:
        flat_groups: the layout.
        group: the data-parallel process group.
        precision: the storage (``param_dtype``) and compute dtypes.
    """

    offloaded = False
    gathers_units = False

    @torch.no_grad()
    def __init__(self, *, flat_groups: list[FlatGroup], group, precision: PrecisionPolicy):
        self.flat_groups = flat_groups
        self.group = group
        self.param_dtype = precision.param_dtype
        self.compute_dtype = precision.compute
        self.full: dict[int, torch.Tensor] = {}  # flat-group index -> its full buffer (compute dtype, padded)
        self.views: list[torch.Tensor | None] = [None] * sum(len(g.buckets) for g in flat_groups)  # per Bucket.index
        self.closed = False
        for g in flat_groups:
            full = torch.empty(g.padded_numel, dtype=self.compute_dtype, device=g.device)
            pos = 0
            for b in g.buckets:
                view = self.views[b.index] = full[pos : pos + b.padded_numel]
                bucket_values(b, group, self.param_dtype, view)  # one collective (zero_init: no broadcast)
                for s in b.slots:
                    s.param.data = view[s.bucket_offset : s.bucket_offset + s.numel].view(s.shape)
                    forget(s.param)
                pos += b.padded_numel
            self.full[g.index] = full

    @classmethod
    def from_inputs(cls, inputs: ParamStoreInputs) -> DenseParamStore:
        """The store for what the runtime offers (the builder ``ZeroRuntime`` uses at stages 0-2)."""
        return cls(flat_groups=inputs.flat_groups, group=inputs.group, precision=inputs.precision)

    def full_of(self, b: Bucket) -> torch.Tensor:
        """Bucket ``b``'s full buffer (``padded_numel`` elements, compute dtype) that its parameters view."""
        return self.views[b.index]

    def master_chunk(self, b: Bucket) -> torch.Tensor | None:
        if self.param_dtype != self.compute_dtype:
            return None
        return self.views[b.index].detach()[slice(*b.chunk_range(b.group.rank))]

    def shard_view(self, g: FlatGroup) -> torch.Tensor | None:
        if self.param_dtype != self.compute_dtype:
            return None  # the buffer holds compute-dtype values, not the stored ones
        if g.partitions == 1:
            return self.full[g.index]
        if len(g.buckets) == 1:  # several buckets make a rank's chunks non-contiguous
            return self.views[g.buckets[0].index][slice(*g.buckets[0].chunk_range(g.rank))]
        return None

    def shard_values(self, g: FlatGroup) -> torch.Tensor:
        dtype = self.param_dtype
        chunks = [self.views[b.index][slice(*b.chunk_range(g.rank))] for b in g.buckets]
        return torch.cat(chunks).to(dtype) if chunks else torch.zeros(0, dtype=dtype, device=g.device)

    def offloaded_chunks(self) -> None:
        """None: the full buffers stay on the device."""
        return None

    @torch.no_grad()
    def refresh(self, master) -> None:
        """Per trainable bucket: ``master.write_params`` into a send buffer, launch its all-gather; wait for all."""
        dtype = self.param_dtype
        pending = []
        with record_function("zero::gather"):
            for g in self.flat_groups:
                if g.group_index is None:
                    continue
                for b in g.buckets:
                    full = self.views[b.index]
                    if full.dtype == dtype:
                        # in place: this rank's chunk of the buffer is the all-gather's input (and, when the
                        # master aliases it, write_params has nothing to copy: stage 0 and fp32 stages 1/2)
                        send = full[slice(*b.chunk_range(g.rank))]
                        master.write_params(b, send)
                        if g.partitions > 1:
                            pending.append((all_gather_into_tensor(full, send, self.group, async_op=True), full,
                                            full))  # fmt: skip
                        continue
                    send = torch.empty(b.chunk, dtype=dtype, device=g.device)
                    master.write_params(b, send)
                    if g.partitions == 1:
                        full.copy_(send)
                        continue
                    out = torch.empty(b.padded_numel, dtype=dtype, device=g.device)
                    pending.append((all_gather_into_tensor(out, send, self.group, async_op=True), full, out))
            for handle, full, out in pending:
                handle.wait()
                if out is not full:
                    full.copy_(out)

    def resident(self) -> list[torch.Tensor]:
        """Every flat group's full buffer."""
        return list(self.full.values())

    @torch.no_grad()
    def load_frozen(self, g: FlatGroup, shard: torch.Tensor) -> None:
        for b in g.buckets:
            lo, hi = b.chunk_range(g.rank)
            self.views[b.index][lo:hi].copy_(shard[b.shard_slice()])

    def begin_backward(self) -> None:
        pass

    def end_backward(self) -> None:
        pass

    def before_reduce(self) -> None:
        """Nothing in flight to settle."""

    def before_write(self) -> None:
        """Nothing: no peer reads this rank's buffers."""

    def on_grads_done(self, bucket: Bucket) -> None:
        pass

    def outside_writes(self) -> tuple[list[ParamSlot], torch.Tensor]:
        """None watched."""
        return [], torch.zeros(0, dtype=torch.float64)

    def empty_cache(self) -> None:
        """Nothing: stages 0-2 keep every parameter whole (DeepSpeed's call is a no-op there too)."""

    @torch.no_grad()
    def close(self) -> None:
        """Every parameter gets its own storage holding its current values; the flat buffers are dropped."""
        if self.closed:
            return
        for g in self.flat_groups:
            for s in g.slots:
                s.param.data = s.param.detach().clone()
        self.full.clear()
        self.views = []
        self.closed = True
