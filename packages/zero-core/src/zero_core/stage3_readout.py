"""What a stage-3 store offers those who reach it through one of its parameters (``zero_core.registry.UnitHolder``),
beyond gathering and releasing units: the ``ds_status``, ``ds_shape`` and ``ds_tensor`` that integrations read,
from the store's own per-unit state and the parameter's place (``zero_core.registry.ParamHandle``); the exact
gather ``GatheredParameters`` asks for; the warning ``state_dict()`` gives at stage 3."""

from __future__ import annotations

import warnings

import torch

from zero_core.layout import Bucket, ParamSlot
from zero_core.registry import ParamHandle
from zero_core.shard_state import STEP, ShardState, ZeroParamStatus


class PartitionReadout:
    """Mixin of ``zero_core.stage3.Stage3``: reads its ``units``, ``state_of``, ``rank``, ``pinned``,
    ``flat_groups``, ``gathers_specially``, ``frozen_q`` and ``shard_values`` and calls its ``gather`` /
    ``mark_stale``; holds no state of its own."""

    def _warn_released(self, module, state_dict, prefix, local_metadata) -> None:
        """``module.state_dict()`` at stage 3 holds released parameters as empty tensors: say so."""
        empty = [k for k, v in state_dict.items() if isinstance(v, torch.Tensor) and v.numel() == 0]
        sizes = {prefix + s.name: s.numel for g in self.flat_groups for b in g.buckets for s in b.slots}
        released = [k for k in empty if sizes.get(k, 0) > 0]
        if released:
            warnings.warn(
                f"stage 3: state_dict() holds {len(released)} released parameters as empty tensors (e.g. "
                f"{released[0]!r}); use ZeroRuntime.full_parameters() or GatheredParameters for their values",
                stacklevel=2,
            )

    @torch.no_grad()
    def outside_writes(self) -> tuple[list[ParamSlot], torch.Tensor]:
        """``ParamStore.outside_writes``: the persistent units' parameters (they stay gathered, so a write into
        one outside ``GatheredParameters`` lands in the gathered values and the next step's refresh from the
        master undoes it) and, per parameter, the elements of this rank's stored chunk its gathered values no
        longer match. None watched where persistent units hold quantized (qwZ) or int8 copies, and no element
        is compared where the stored chunk is off the device (offloaded)."""
        if self.gathers_specially or self.frozen_q is not None:
            return [], torch.zeros(0, dtype=torch.float64)
        slots = [s for g in self.flat_groups for b in g.buckets if b.persistent for s in b.slots]
        counts = []
        for g in self.flat_groups:
            for b in g.buckets:
                if not b.persistent:
                    continue
                unit = self.units.buffers[b.index]
                if unit.stored is None or self.state_of(b) is not ShardState.GATHERED:
                    counts.append(torch.zeros(len(b.slots), dtype=torch.float64, device=g.device))
                    continue
                lo, hi = b.chunk_range(self.rank)
                differs = (unit.full[lo:hi] != unit.stored.to(unit.full.dtype)).to(torch.float64)
                running = torch.cat([differs.new_zeros(1), differs.cumsum(0)])
                ends = [min(max(s.bucket_offset + s.numel, lo), hi) - lo for s in b.slots]
                starts = [min(max(s.bucket_offset, lo), hi) - lo for s in b.slots]
                index = torch.tensor(ends + starts, device=g.device)
                edges = running[index]
                counts.append(edges[: len(b.slots)] - edges[len(b.slots) :])
        return slots, torch.cat(counts) if counts else torch.zeros(0, dtype=torch.float64)

    def gather_exact(self, b: Bucket) -> None:
        """Gather ``b`` holding exactly its stored values (``GatheredParameters``: they may be written back): a
        plain all-gather, never qwZ; a unit already gathered through qwZ/hpZ and held by no block is fetched again.
        Collective."""
        if self.gathers_specially and self.state_of(b) is ShardState.GATHERED and not self.is_pinned(b):
            self.mark_stale(b)  # holds a quantized copy
        self.gather(b, phase=STEP, exact=True)

    def param_status(self, h: ParamHandle) -> ZeroParamStatus:
        """``p.ds_status``: AVAILABLE while its unit is gathered, INFLIGHT while the gather is under way."""
        state = self.state_of(h.bucket)
        if state is ShardState.GATHERED:
            return ZeroParamStatus.AVAILABLE
        return ZeroParamStatus.INFLIGHT if state is ShardState.GATHERING else ZeroParamStatus.NOT_AVAILABLE

    def param_shape(self, h: ParamHandle) -> torch.Size:
        """``p.ds_shape``: its full shape."""
        return h.slot.shape

    def param_partition(self, h: ParamHandle) -> torch.Tensor:
        """``p.ds_tensor``: the elements of ``p`` in this rank's stored chunk of its unit (a view of the stored
        shard, or of the host copy when offloaded; empty where this rank's chunk holds none of ``p``)."""
        s, b = h.slot, h.bucket
        lo, hi = b.chunk_range(self.rank)
        a, e = max(lo, s.bucket_offset), min(hi, s.bucket_offset + s.numel)
        chunk = self.shard_values(b.group)[b.shard_slice()]
        return chunk[a - lo : max(a, e) - lo]
