"""Stage 3: the all-gathers of several units as one collective.

DeepSpeed's stage 3 gathers every parameter one prefetch issues with one ``all_gather_coalesced``
(``partitioned_param_coordinator.py``, ``__all_gather_params_``); :class:`GatherBatch` is that for units. The send
buffer is the units' chunks side by side (``stride`` elements, in unit order); the output is rank-major
(``world * stride`` elements: part ``r`` holds every unit's chunk ``r``), so each unit is copied out of it into its
own full buffer, where its parameters' views live (a parameter may straddle two ranks' chunks, so the units cannot
be views of the output). On gloo the per-call cost of a collective outweighs that copy for units below
``zero_core.prefetch.GATHER_ALONE_BYTES`` (figures in packages/zero-core/README.md).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import torch

from zero_comm import all_gather_into_tensor
from zero_comm.buffers import scratch


class GatherBatch:
    """One asynchronous all-gather of several units' chunks (one dtype): stage 3's units (``Bucket`` keys) and
    zero_compile's units (int keys) alike.

    Args:
        chunks: each unit's chunk length in elements (its ``padded_numel / world``), in send order; the keys are
            the units, any hashable.
        send: their chunks side by side (``sum(chunks.values())`` elements, the storage dtype); read until
            ``wait()``.
        group: the process group (``world`` ranks).

    ``wait()`` is idempotent (every unit's gather waits on the one collective; a ``CollectiveTimeout`` from it
    propagates); ``copy_out(unit, full)`` then fills that unit's full buffer (``world * chunk`` elements, any float
    dtype). The output goes back to ``zero_comm.buffers.scratch`` after the last unit's copy.

    Raises:
        ValueError: ``send``'s length is not the sum of the chunks.
    """

    def __init__(self, chunks: Mapping[Hashable, int], send: torch.Tensor, group, world: int):
        self.offset: dict[Hashable, int] = {}
        self.chunk: dict[Hashable, int] = dict(chunks)
        self.stride = 0
        for unit, n in self.chunk.items():
            self.offset[unit] = self.stride
            self.stride += n
        if send.numel() != self.stride:
            raise ValueError(f"GatherBatch: send has {send.numel()} elements, the units' chunks {self.stride}")
        self.world, self.send, self.left, self.done = world, send, len(self.chunk), False
        self.out = scratch.take(world * self.stride, send.dtype, send.device)
        self.handle = all_gather_into_tensor(self.out, send, group, async_op=True)

    def wait(self) -> None:
        """Wait for the collective (once)."""
        if not self.done:
            self.handle.wait()
            self.done = True

    def copy_out(self, unit: Hashable, full: torch.Tensor) -> None:
        """Copy ``unit`` (its chunk of every rank, in rank order) into ``full``."""
        at, n = self.offset[unit], self.chunk[unit]
        parts = self.out.view(self.world, self.stride)[:, at : at + n]
        full[: self.world * n].view(self.world, n).copy_(parts)
        self.left -= 1
        if self.left == 0:
            scratch.give(self.out)
            self.out = self.send = None
