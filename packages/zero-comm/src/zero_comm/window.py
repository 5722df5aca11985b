"""Shared-memory windows: each rank's tensor readable by every rank of its group on one host, with no collective.

Why: a ZeRO-3 all-gather on gloo moves every byte through loopback TCP, a copy into the kernel and one out, on a
thread that takes CPU from the compute it is meant to overlap (on 2 cores shared by 2 ranks it is the whole cost:
Llama 20m's forward is about 60 ms slower at stage 3 than DDP's). When the ranks share a host, each rank's stored
shard can live in a shared-memory segment that every peer maps, so gathering a unit is a plain copy of the peers'
chunks (one-sided reads, MPI-3's ``MPI_Win_allocate_shared``; on GPUs, CUDA IPC or torch's symmetric memory).

Synchronisation is the window's ``fence()`` (``MPI_Win_fence``): a barrier of the group, after which every write
made before it, by any rank, is visible to every read after it. The writer's contract: between two fences a
rank's region is either written by its owner or read by peers, never both. The barrier goes through a gloo group
of its own (same ranks, the group's timeout), so a dead or stuck peer is reported, never waited on forever.

Set-up is collective and needs every rank on one host with ``/dev/shm`` space (it reuses ``zero_comm.shm``'s
segment files: nonce-checked, space reserved up front, names removed once mapped); anything else (several hosts,
no space, ``ZERO_COMM_SHM=0``) gives None on every rank, agreed with one all-reduce, and callers keep their
collectives.
"""

from __future__ import annotations

import time
import weakref

import torch
import torch.distributed as dist

from zero_comm import logger as _logger
from zero_comm import objects as _objects
from zero_comm import shm as _shm

# Data starts one page into the segment (the nonce lives at its start): aligned for vector copies and O_DIRECT.
_DATA_OFFSET = 4096

__all__ = ["SharedWindow", "shared_window"]


class SharedWindow:
    """Every rank's ``numel``-element tensor of one dtype, mapped by every rank of the group (see module doc).

    Attributes:
        rank / world: this rank's index in the group and the group's size.
        local: this rank's region (``numel`` elements, writable, zero-filled at creation).
        fences: fences passed so far (tests read it).
    """

    def __init__(self, rank: int, world: int, regions: list[torch.Tensor], barrier_group):
        self.rank, self.world = rank, world
        self._regions = regions
        self.local = regions[rank]
        self.fences = 0
        self._barrier_group = barrier_group

    def peer(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s region (``numel`` elements; this rank's own is ``local``). Read it only between fences
        in which its owner does not write it."""
        return self._regions[rank]

    def gather(self, out: torch.Tensor, start: int, count: int) -> None:
        """``out[r * count : (r + 1) * count] = peer(r)[start : start + count]`` for every rank ``r``: what
        ``all_gather_into_tensor(out, local[start:start + count])`` gives, as copies from the peers' regions (cast
        to ``out``'s dtype). Not collective: it reads only, between fences in which no owner writes those
        elements. Active ``CommsLogger``s record it as an ``all_gather_into_tensor`` with algorithm "window"
        (wire bytes: the bytes read from peers).

        Raises:
            ValueError: ``out`` does not hold ``world * count`` elements, or ``[start, start + count)`` leaves
                the region.
        """
        numel = self.local.numel()
        if out.numel() != self.world * count or start < 0 or count < 0 or start + count > numel:
            raise ValueError(f"SharedWindow.gather: out has {out.numel()} elements for {self.world} x {count}, "
                             f"elements [{start}, {start + count}) of a {numel}-element region")  # fmt: skip
        begin = time.perf_counter() if _logger._ACTIVE else 0.0
        parts = out.view(self.world, count)
        for r, region in enumerate(self._regions):
            parts[r].copy_(region[start : start + count])
        if _logger._ACTIVE:
            logical = self.world * count * self.local.element_size()
            rec = _logger.CommRecord(
                name="all_gather_into_tensor", group_size=self.world, dtype=str(self.local.dtype),
                logical_bytes=logical, wire_bytes=(self.world - 1) * count * self.local.element_size(),
                latency_s=time.perf_counter() - begin, async_op=False,
                busbw_factor=_logger.bus_factor("all_gather_into_tensor", self.world), algorithm="window",
            )  # fmt: skip
            for log in tuple(_logger._ACTIVE):
                log.record(rec)

    def fence(self) -> None:
        """Barrier of the group: writes before it (by any rank) are visible to reads after it (by any rank).
        Collective.

        Raises:
            RuntimeError: from gloo, when a peer does not arrive within the group's timeout (names the barrier).
        """
        try:
            dist.barrier(group=self._barrier_group)
        except RuntimeError as exc:
            raise RuntimeError(f"shared window fence (rank {self.rank} of {self.world}) failed: {exc}") from exc
        self.fences += 1

    def close(self) -> None:
        """Drop the mappings (the pages go back once every rank closed or exited)."""
        self._regions, self.local = [], None


def shared_window(group, numel: int, dtype: torch.dtype) -> SharedWindow | None:
    """A :class:`SharedWindow` of ``numel`` elements of ``dtype`` per rank of ``group``, or None (on every rank)
    when the ranks cannot share memory: a group of one, a non-gloo group, ranks on different hosts, no space under
    ``/dev/shm``, or ``ZERO_COMM_SHM=0``. Collective over ``group``.

    Raises:
        ValueError: ``numel`` is negative.
    """
    if numel < 0:
        raise ValueError(f"shared_window: numel must be >= 0, got {numel}")
    if group.size() == 1 or dist.get_backend(group) != "gloo":
        return None
    esize = torch.empty(0, dtype=dtype).element_size()
    nbytes = _DATA_OFFSET + max(1, numel) * esize
    made = _shm._create_segment(nbytes)
    try:
        mine = (_shm._host_key(), made[0] if made else None, made[1] if made else None)
        peers = _objects.all_gather_object(mine, group)
        regions = []
        if made:
            for host, path, nonce in peers:
                seg = _shm._map(path, nonce, nbytes) if host == mine[0] and path else None
                if seg is None:
                    break
                regions.append(seg[_DATA_OFFSET : _DATA_OFFSET + numel * esize].view(dtype))
        ok = torch.tensor([int(len(regions) == group.size())])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # every rank mapped every peer, or none uses it
    finally:
        if made:
            _shm.os.unlink(made[0])  # every peer has mapped it (or given up): the mappings outlive the name
    if not ok.item():
        return None
    # no zero_(): a fresh tmpfs segment reads zero (the nonce page is apart), and writing zeros would make the whole
    # window resident at once instead of page by page as the owner stores its shard
    ranks = dist.get_process_group_ranks(group)
    barrier_group = _barrier_group(group, ranks)
    return SharedWindow(dist.get_rank(group), group.size(), regions, barrier_group)


# group -> its barrier group, one however many windows; held weakly, so the barrier group is freed with the group
# (at destroy_process_group, on every rank at the same point, not at a later garbage collection of one rank)
_BARRIERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _barrier_group(group, ranks):
    side = _BARRIERS.get(group)
    if side is not None and side in dist.distributed_c10d._world.pg_map:
        return side
    side = dist.new_group(ranks, timeout=_shm._timeout(group), backend="gloo", use_local_synchronization=True)
    _BARRIERS[group] = side
    return side
