"""Collectives, bucketing, ZeRO++ quantized collectives (qwZ/qgZ/hpZ), comm logging and a multi-rank test harness."""

from zero_comm.collectives import (
    CollectiveError,
    CollectiveTimeout,
    CommHandle,
    all_gather_into_tensor,
    all_reduce,
    all_to_all_single,
    broadcast,
    reduce_scatter_tensor,
)
from zero_comm.logger import CommRecord, CommsLogger

__version__ = "0.1.0"

__all__ = [
    "CollectiveError",
    "CollectiveTimeout",
    "CommHandle",
    "CommRecord",
    "CommsLogger",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all_single",
    "broadcast",
    "reduce_scatter_tensor",
]
