"""Stage 3: the all-gathers of several units as one collective.

DeepSpeed's stage 3 gathers every parameter one prefetch issues with one ``all_gather_coalesced``
(``partitioned_param_coordinator.py``, ``__all_gather_params_``); :class:`GatherBatch` is that for units. The send
buffer is the units' chunks side by side (``stride`` elements, in unit order); the output is rank-major
(``world * stride`` elements: part ``r`` holds every unit's chunk ``r``), so each unit is copied out of it into its
own full buffer, where its parameters' views live (a parameter may straddle two ranks' chunks, so the units cannot
be views of the output). On gloo the per-call cost of a collective outweighs that copy: Llama 20m's forward issues
about 10 all-gathers instead of 78 (``docs/benchmarks.md``, training section).
"""

from __future__ import annotations

import torch

from zero_comm import all_gather_into_tensor
from zero_comm.buffers import scratch
from zero_core.layout import Bucket


class GatherBatch:
    """One asynchronous all-gather of the chunks of ``units`` (one flat group, so one dtype).

    Args:
        units: the units, in flat order.
        send: their chunks side by side (``sum(b.chunk)`` elements, the storage dtype); read until ``wait()``.
        group: the process group (``world`` ranks).

    ``wait()`` is idempotent (every unit's gather waits on the one collective; a ``CollectiveTimeout`` from it
    propagates); ``copy_out(b, full)`` then fills unit ``b``'s full buffer (``b.padded_numel`` elements, any float
    dtype). The output goes back to ``zero_comm.buffers.scratch`` after the last unit's copy.
    """

    def __init__(self, units: list[Bucket], send: torch.Tensor, group, world: int):
        self.offset: dict[Bucket, int] = {}
        self.stride = 0
        for b in units:
            self.offset[b] = self.stride
            self.stride += b.chunk
        if send.numel() != self.stride:
            raise ValueError(f"GatherBatch: send has {send.numel()} elements, the units' chunks {self.stride}")
        self.world, self.send, self.left, self.done = world, send, len(units), False
        self.out = scratch.take(world * self.stride, send.dtype, send.device)
        self.handle = all_gather_into_tensor(self.out, send, group, async_op=True)

    def wait(self) -> None:
        """Wait for the collective (once)."""
        if not self.done:
            self.handle.wait()
            self.done = True

    def copy_out(self, b: Bucket, full: torch.Tensor) -> None:
        """Copy unit ``b`` (its chunk of every rank, in rank order) into ``full``."""
        at = self.offset[b]
        parts = self.out.view(self.world, self.stride)[:, at : at + b.chunk]
        full[: b.padded_numel].view(self.world, b.chunk).copy_(parts)
        self.left -= 1
        if self.left == 0:
            scratch.give(self.out)
            self.out = self.send = None
