"""What a stage-3 store answers about one of its parameters (``zero_core.partitioned_param.ParamHolder``): the
``ds_status``, ``ds_shape`` and ``ds_tensor`` that integrations read, from the store's own per-unit state."""

from __future__ import annotations

import torch

from zero_core.layout import Bucket
from zero_core.partitioned_param import ZeroParamStatus


class PartitionReadout:
    """Mixin of ``zero_core.stage3.Stage3``: reads its ``state`` (per unit), ``_slots`` (id(param) -> ParamSlot),
    ``rank`` and ``shard_values``; holds no state of its own."""

    def param_status(self, p: torch.Tensor, b: Bucket) -> ZeroParamStatus:
        """``p.ds_status``: AVAILABLE while its unit is gathered, INFLIGHT while the gather is under way."""
        from zero_core.stage3 import ShardState  # the store's own module (it imports this one)

        state = self.state[b.index]
        if state is ShardState.GATHERED:
            return ZeroParamStatus.AVAILABLE
        return ZeroParamStatus.INFLIGHT if state is ShardState.GATHERING else ZeroParamStatus.NOT_AVAILABLE

    def param_shape(self, p: torch.Tensor, b: Bucket) -> torch.Size:
        """``p.ds_shape``: its full shape."""
        return self._slots[id(p)].shape

    def param_partition(self, p: torch.Tensor, b: Bucket) -> torch.Tensor:
        """``p.ds_tensor``: the elements of ``p`` in this rank's stored chunk of its unit (a view of the stored
        shard, or of the host copy when offloaded; empty where this rank's chunk holds none of ``p``)."""
        s = self._slots[id(p)]
        lo, hi = b.chunk_range(self.rank)
        a, e = max(lo, s.bucket_offset), min(hi, s.bucket_offset + s.numel)
        chunk = self.shard_values(b.group)[b.shard_slice()]
        return chunk[a - lo : max(a, e) - lo]
