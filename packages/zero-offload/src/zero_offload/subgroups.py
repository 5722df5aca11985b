"""Sub-groups: the units an offloaded optimizer steps, reads and writes (DeepSpeed's ``sub_group_size``).

Each flat master shard (one per flat group of the core's layout) is cut into consecutive ranges of at most
``sub_group_size`` elements. Sub-groups are the grain of SuperOffload's speculative step (one starts when all of
its reduced gradient has arrived), of NVMe swapping, and of DeepSpeed's Twin-Flow ``ratio``: only that fraction of
the sub-groups steps on the host; the rest keep their master and optimizer state on the device. The device ones
are the first sub-groups in parameter order: backward produces their gradients last, so stepping them where the
gradients already are leaves the host nothing to wait for (ZeRO-Offload++ "Twin-Flow", DeepSpeed 0.10.3).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SubGroup:
    """One range of one master shard.

    Attributes:
        index: position in the plan (parameter order over all shards).
        shard: which master shard (flat group) it belongs to.
        start, end: element range inside that shard (end exclusive).
        on_host: True = master and optimizer state in host memory, stepped on the host; False = on the device.
    """

    index: int
    shard: int
    start: int
    end: int
    on_host: bool

    @property
    def numel(self) -> int:
        return self.end - self.start


def plan_sub_groups(
    shard_numels: Sequence[int], sub_group_size: int, ratio: float = 1.0, cuts: Sequence[Sequence[int]] | None = None
) -> list[SubGroup]:
    """Cut shards of ``shard_numels`` elements into sub-groups of at most ``sub_group_size`` elements.

    Args:
        shard_numels: elements of each master shard, in parameter order (empty shards give no sub-group).
        sub_group_size: most elements per sub-group (``zero_optimization.sub_group_size``), >= 1.
        ratio: fraction of the sub-groups stepped on the host (``offload_optimizer.ratio``), in [0, 1]; the host
            gets the last ``ceil(ratio * count)`` of them.

    Returns:
        The sub-groups in parameter order.

    Raises:
        ValueError: ``sub_group_size`` < 1 or ``ratio`` outside [0, 1], naming the config key.
    """
    if sub_group_size < 1:
        raise ValueError(f"zero_optimization.sub_group_size must be >= 1, got {sub_group_size}")
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"zero_optimization.offload_optimizer.ratio must be in [0, 1], got {ratio}")
    ranges = []
    for shard, numel in enumerate(shard_numels):
        bounds = sorted({0, numel, *(c for c in (cuts[shard] if cuts else ()) if 0 < c < numel)})
        for lo, hi in zip(bounds, bounds[1:]):
            for start in range(lo, hi, sub_group_size):
                ranges.append((shard, start, min(hi, start + sub_group_size)))
    on_host = math.ceil(ratio * len(ranges) - 1e-9)
    first_host = len(ranges) - on_host
    return [SubGroup(i, s, a, b, i >= first_host) for i, (s, a, b) in enumerate(ranges)]
