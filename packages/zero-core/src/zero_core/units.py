"""Stage 3's units: one :class:`UnitBuffer` per unit (its full buffer, whether it is gathered, the gather in
flight, where its stored chunk lives, who holds it gathered) and :class:`Units`, which gathers them (alone, or
several by one collective), waits, releases and holds them, and counts the live elements
``stage3_max_live_parameters`` bounds.

The layout (``zero_core.layout.Bucket``) is frozen; what changes while training lives on the unit's
:class:`UnitBuffer`, held in a list indexed by ``Bucket.index``. The stage-3 store (``zero_core.stage3``) decides
when a unit is needed (its module hooks); :class:`Units` does the gathering: where a unit's chunk comes from is its
storage's (``UnitBuffer.stored``: the stored chunk itself on the device; else ``ShardStorage.source``; a shared
window's or int8 blocks' own gather), and the collective runs on the all-gather stream
(``zero_core.comm_context``), its wait where the unit is used.
"""

from __future__ import annotations

from collections.abc import Container
from operator import attrgetter

import torch
from torch.profiler import record_function

from zero_comm import CollectiveTimeout, all_gather_into_tensor
from zero_core.comm_context import NO_STREAM
from zero_core.divergence import DivergenceCheck
from zero_core.gather_batch import GatherBatch
from zero_core.layout import Bucket, FlatGroup
from zero_core.materialize import bucket_values, return_freed_host_memory
from zero_core.partition_records import forget
from zero_core.partitioned_param import ReleasedZeroParameter, ZeroParameter
from zero_core.prefetch import Prefetcher
from zero_core.shard_state import FORWARD, ShardState
from zero_core.shard_storage import DeviceShards

__all__ = ["UnitBuffer", "Units"]

_SHARDED, _GATHERING, _GATHERED = ShardState.SHARDED, ShardState.GATHERING, ShardState.GATHERED
_by_index = attrgetter("index")


class UnitBuffer:
    """Unit ``bucket``'s full buffer (``padded_numel`` elements, compute dtype) that its parameters view while
    gathered; its storage is freed (``resize_(0)``) while released and re-allocated in place by the next gather, so
    views autograd saved in forward see the re-gathered values in backward (PyTorch FSDP1 frees flat parameters the
    same way).

    Args:
        bucket: the unit.
        full: its full buffer.
        storage: the ``zero_core.shard_storage.ShardStorage`` holding its stored chunk.
        stored: that chunk itself on the compute device (a view of the stored shard, sent as it is), or None: the
            storage gives it at each gather (``source``).
        shared: its flat group's shard lives in a shared window: a gather copies the peers' chunks on the calling
            thread (no collective), so it is never prefetched nor kept for a reuse.
        packed: its chunk is held as int8 blocks, which its storage gathers itself (``gather_unit``).

    Attributes:
        state: SHARDED (released), GATHERING (``inflight`` is the gather's ``(handle, out, event)``) or GATHERED.
        held: ``GatheredParameters`` / ``gathered_for_compute`` blocks holding it (module forwards leave it alone).
        pinned: holds that forbid its release: the blocks above, and the forwards of modules reading it as an
            external parameter while they run.
        kept: gathered past its module's forward for a near reuse (released first when room is needed).
    """

    __slots__ = ("bucket", "full", "storage", "stored", "shared", "packed", "state", "inflight", "held", "pinned",
                 "kept")  # fmt: skip

    def __init__(self, bucket: Bucket, full: torch.Tensor, storage, stored: torch.Tensor | None, *,
                 shared: bool = False, packed: bool = False) -> None:  # fmt: skip
        self.bucket = bucket
        self.full: torch.Tensor | None = full
        self.storage = storage
        self.stored = stored
        self.shared = shared
        self.packed = packed
        self.state = ShardState.SHARDED
        self.inflight: tuple | None = None
        self.held = 0
        self.pinned = 0
        self.kept = False

    def allocate(self) -> None:
        """Give the full buffer its storage back (its values are undefined until a gather fills it)."""
        self.full.untyped_storage().resize_(self.bucket.padded_numel * self.full.element_size())

    def point_params(self) -> None:
        """Make each parameter's ``.data`` a view of its slot in the full buffer; a ``ReleasedZeroParameter``
        becomes a ``ZeroParameter`` (``zero_core.partitioned_param``: no Python on its torch functions)."""
        full = self.full
        for s in self.bucket.slots:
            p = s.param
            if isinstance(p, ZeroParameter):
                p.__class__ = ZeroParameter  # before the swap: no Python on it, nor on the forward's ops
            p.data = full[s.bucket_offset : s.bucket_offset + s.numel].view(s.shape)

    def free(self, keep_views: bool = False) -> None:
        """Free the full buffer's storage; each parameter's ``.data`` becomes an empty tensor, so reading a released
        parameter gives ``numel() == 0``, never freed memory, and a ``ZeroParameter`` becomes a
        ``ReleasedZeroParameter`` (in-place writes into the placeholder raise). ``keep_views``: the unit takes a
        new (empty) storage instead and drops its reference to the old one, which lives on while a view of it
        does (a tensor a user kept from inside ``GatheredParameters``: it stays readable, never freed memory)."""
        if keep_views:
            fresh = torch.empty(self.bucket.padded_numel, dtype=self.full.dtype, device=self.full.device)
            fresh.untyped_storage().resize_(0)
            self.full = fresh
        else:
            self.full.untyped_storage().resize_(0)
        empty = self.full.new_empty(0)
        for s in self.bucket.slots:
            p = s.param
            p.data = empty
            if isinstance(p, ZeroParameter):
                p.__class__ = ReleasedZeroParameter

    def detach_params(self) -> None:
        """Give each parameter its own dense storage holding its current (gathered) values; the buffer is dropped."""
        full = self.full
        for s in self.bucket.slots:
            s.param.data = full[s.bucket_offset : s.bucket_offset + s.numel].view(s.shape).clone()
        self.full = None


class Units:
    """The units of one stage-3 store (see the module docstring).

    Args:
        buffers: per ``Bucket.index``, the unit's :class:`UnitBuffer` (filled by the store as it materialises).
        group / world: the data-parallel process group the units are gathered over.
        comm: the collective streams (``zero_core.comm_context.CommContext``).
        zeropp: the ZeRO++ collectives; ``gathers_specially``: unit gathers go through its qwZ/hpZ ``all_gather``.
        divergence: the rank-divergence check (every gather agreed while the pass is not steady).
        prefetch: the recorded order (``steady``; ``after`` for a storage reading ahead).
        max_live: ``stage3_max_live_parameters``.
        shards: per flat group, the stored shard on the device (a batch sends adjacent chunks as one slice of it).
        shared: the device storage holding shared windows (units with ``shared`` set gather from it), or None.

    Attributes:
        live: elements of non-persistent units gathered or being gathered.
        gathers: gathers issued (units gathered from a shared window included).
        phase: FORWARD, BACKWARD or STEP: what a gather is agreed as, and which way a storage reads ahead.
    """

    def __init__(self, buffers: list[UnitBuffer], *, group, world: int, comm, zeropp, divergence: DivergenceCheck,
                 prefetch: Prefetcher, max_live: int, shards: list[torch.Tensor | None],
                 shared: DeviceShards | None):  # fmt: skip
        self.buffers = buffers
        self.group, self.world = group, world
        self.comm = comm
        self.streams = comm.active  # collectives on their own CUDA streams (else they run where they are issued)
        self.zeropp = zeropp
        self.gathers_specially = zeropp.gathers_specially
        self.divergence = divergence
        self.prefetch = prefetch
        self.max_live = max_live
        self.shards = shards
        self.shared = shared
        self.live = 0
        self.gathers = 0
        self.phase = FORWARD
        self.kept = 0  # units whose ``kept`` is set
        self.holding = 0  # units held by blocks (hold() calls not yet undone)

    def gather(self, b: Bucket, *, async_op: bool = False, phase: int | None = None, exact: bool = False) -> None:
        """Materialise ``b`` (idempotent); ``async_op``: issue it and return (waited for where it is used).
        Collective: every rank must gather the same units in the same order. With ZeRO++ the gather runs through
        qwZ/hpZ (``zero_core.zeropp``) unless ``exact`` (plain all-gather of the stored shards).

        Raises:
            RankDivergenceError: on every rank, when the ranks asked for different units (or phases).
        """
        unit = self.buffers[b.index]
        state = unit.state
        if state is _GATHERED:
            return
        if state is _GATHERING:
            if not async_op:
                self.wait(b)
            return
        divergence = self.divergence
        if divergence.pending is not None:
            divergence.settle()  # a check in flight agrees before any unit moves
        if not self.prefetch.steady:
            divergence.agree(b, self.phase if phase is None else phase)
        if self.kept and not b.persistent and self.live + b.padded_numel > self.max_live:
            self.release_kept()
        full = unit.full
        if unit.shared:  # each rank's chunk copied from its shard in the shared window: no collective
            with record_function("zero::gather"):
                unit.allocate()
                self.shared.gather_unit(b, full)
            unit.point_params()
            unit.state = _GATHERED
            if not b.persistent:
                self.live += b.padded_numel
            self.gathers += 1
            return
        comm = self.comm  # on CUDA: the all-gather stream, so a prefetch overlaps compute
        stream = comm.on(comm.gather_stream) if self.streams else NO_STREAM
        with record_function("zero::gather"), stream as event:
            if unit.packed:  # int8 blocks: the stored values themselves, so this is also the exact gather
                unit.allocate()
                out, handle = full, unit.storage.gather_unit(b, full)
            else:
                src = unit.stored
                if src is None:  # on the gather stream too: an offloaded chunk's copy to the device overlaps compute
                    src = unit.storage.source(b, async_op, self)
                unit.allocate()
                out = full if full.dtype == src.dtype else torch.empty(b.padded_numel, dtype=src.dtype,
                                                                       device=full.device)  # fmt: skip
                if self.gathers_specially and not exact:
                    handle = self.zeropp.all_gather(b, out, src)
                else:
                    handle = all_gather_into_tensor(out, src, self.group, async_op=True)
        unit.inflight = (handle, out, event)
        unit.state = _GATHERING
        if not b.persistent:
            self.live += b.padded_numel
        self.gathers += 1
        if not async_op:
            self.wait(b)

    def wait(self, b: Bucket) -> None:
        """Finish ``b``'s gather in flight: its parameters view the gathered values afterwards.

        Raises:
            MissingRanksError / RankDivergenceError: the collective timed out (ranks named).
        """
        unit = self.buffers[b.index]
        handle, out, event = unit.inflight
        with record_function("zero::gather_wait"):
            try:
                handle.wait()
            except CollectiveTimeout as exc:  # name the ranks that never joined (or a departed one, when steady)
                raise self.divergence.after_timeout(b, self.phase, check_peers=self.prefetch.steady) from exc
            if event is not None:
                self.comm.use(event, unit.full)  # compute waits here, not at issue (no host sync)
        unit.inflight = None
        full = unit.full
        if isinstance(handle, GatherBatch):
            handle.copy_out(b, full)
        elif out is not full:
            full.copy_(out)
        unit.point_params()
        unit.state = _GATHERED
        if unit.stored is None and not unit.packed:
            unit.storage.gathered(b)

    def release(self, b: Bucket, *, keep_views: bool = False) -> None:
        """Free ``b``'s full buffer (its parameters hold empty placeholders until gathered); a no-op for a
        persistent, released or pinned unit. ``keep_views``: see :meth:`UnitBuffer.free`."""
        unit = self.buffers[b.index]
        state = unit.state
        if b.persistent or state is _SHARDED or unit.pinned:
            return
        if unit.kept:
            unit.kept = False
            self.kept -= 1
        if state is _GATHERING:
            self.wait(b)
        with record_function("zero::release"):
            unit.free(keep_views)
            unit.state = _SHARDED
            self.live -= b.padded_numel

    @torch.no_grad()
    def materialize(self, groups: list[FlatGroup], place: list, compute: torch.dtype, dtype: torch.dtype,
                    shared: Container[int], packed) -> None:  # fmt: skip
        """Build every unit from the module's current weights (or zero_init's records), one at a time in flat
        order: its full buffer (``compute`` dtype) filled by ``bucket_values`` (one collective), this rank's chunk
        written to its storage (``place[g.index]``; ``dtype``: the storage dtype), then released unless
        persistent, so a storage off the device receives units one by one and no rank holds the whole model.
        ``shared``: the flat groups held in shared windows; ``packed``: the int8 storage, or None."""
        buffers = self.buffers
        buffers.extend([None] * sum(len(g.buckets) for g in groups))
        for g in groups:
            st, shard = place[g.index], self.shards[g.index]
            for b in g.buckets:
                full = torch.empty(b.padded_numel, dtype=compute, device=g.device)
                bucket_values(b, self.group, dtype, full)  # one collective (zero_init: no broadcast)
                lo, hi = b.chunk_range(g.rank)
                st.open_chunk(b, keep=False).copy_(full[lo:hi])
                st.close_chunk(b)
                stored = shard[b.shard_slice()] if shard is not None else None
                unit = buffers[b.index] = UnitBuffer(b, full, st, stored, shared=g.index in shared,
                                                     packed=st is packed)  # fmt: skip
                unit.point_params()
                for s in b.slots:
                    forget(s.param)
                unit.state = _GATHERED
                if not b.persistent:
                    self.live += b.padded_numel
                    self.release(b)
                if g.device.type == "cpu":  # the records and temporaries freed: before the next unit's pages
                    return_freed_host_memory()

    def after_forward(self, needed: list[Bucket], into_backward: bool) -> None:
        """A module's forward is over: each of its units ``needed`` stays gathered when its next use is near
        (``Prefetcher.keeps``; ``into_backward``: autograd records, so backward uses it next), released first when
        room is needed; the others are released."""
        keeps = self.prefetch.keeps
        for b in needed:
            if keeps(b, self.live, into_backward):
                unit = self.buffers[b.index]
                if not unit.kept:
                    unit.kept = True
                    self.kept += 1
            else:
                self.release(b)

    def release_kept(self) -> None:
        """Release the units kept for a reuse (they are gathered again when needed)."""
        for u in self.buffers:
            if u.kept:
                self.release(u.bucket)

    def release_all(self) -> None:
        """Release every unit not persistent nor pinned."""
        for u in self.buffers:
            if u.state is not _SHARDED and not u.bucket.persistent:
                self.release(u.bucket)

    def mark_stale(self, b: Bucket) -> None:
        """``b``'s gathered values are not its stored shard's (a qwZ copy, or values before a step): the next
        gather fetches them again (its buffer keeps its storage until then)."""
        unit = self.buffers[b.index]
        if unit.state is not _SHARDED:
            unit.state = _SHARDED
            if not b.persistent:
                self.live -= b.padded_numel

    def regather(self, phase: int) -> None:
        """Gather again, from the stored shards, every unit that is persistent or gathered now."""
        for u in self.buffers:
            b = u.bucket
            if b.persistent or u.state is not _SHARDED:
                if u.state is _GATHERING:
                    self.wait(b)
                self.mark_stale(b)
                self.gather(b, phase=phase)

    def hold(self, b: Bucket) -> None:
        """A block holds gathered unit ``b``: no release, and module forwards leave it alone. Counted: blocks nest."""
        unit = self.buffers[b.index]
        unit.pinned += 1
        unit.held += 1
        self.holding += 1

    def unhold(self, b: Bucket) -> None:
        """The block that called :meth:`hold` ends."""
        unit = self.buffers[b.index]
        unit.pinned = max(0, unit.pinned - 1)  # empty_cache may have dropped the pins already
        unit.held -= 1
        self.holding -= 1

    def gather_runs(self, runs: list[list[Bucket]]) -> None:
        """Start the prefetcher's runs: a unit alone by its own gather, several by one all-gather."""
        for run in runs:
            if len(run) == 1:
                self.gather(run[0], async_op=True)
            else:
                self._gather_batch(run)

    def _gather_batch(self, run: list[Bucket]) -> None:
        """Start one all-gather for the units of ``run`` (released, one flat group, chunks on the device): see
        ``GatherBatch``."""
        divergence = self.divergence
        if divergence.pending is not None:
            divergence.settle()
        if not self.prefetch.steady:
            for b in run:
                divergence.agree(b, self.phase)
        run = sorted(run, key=_by_index)
        buffers = self.buffers
        lo, hi = run[0].shard_offset, run[-1].shard_offset + run[-1].chunk
        chunks = 0
        for b in run:
            chunks += b.chunk
        comm = self.comm
        stream = comm.on(comm.gather_stream) if self.streams else NO_STREAM
        with record_function("zero::gather"), stream as event:
            if hi - lo == chunks:  # adjacent units: their chunks already lie side by side
                send = self.shards[run[0].group.index][lo:hi]
            else:
                send = torch.cat([buffers[b.index].stored for b in run])
            for b in run:
                buffers[b.index].allocate()
            batch = GatherBatch({b: b.chunk for b in run}, send, self.group, self.world)
        for b in run:
            unit = buffers[b.index]
            unit.inflight = (batch, None, event)
            unit.state = _GATHERING
            self.live += b.padded_numel
            self.gathers += 1

    # ---------------------------------------------------------------- what a storage reading ahead asks
    def units_after(self, b: Bucket):
        """The released units gathered after ``b`` in the recorded order of this phase, nearest first."""
        for u in self.prefetch.after(b, forward=self.phase == FORWARD):
            if not u.persistent and self.buffers[u.index].state is _SHARDED:
                yield u

    def finish_gather(self, b: Bucket) -> None:
        """Wait for ``b``'s gather in flight, if any."""
        if self.buffers[b.index].state is _GATHERING:
            self.wait(b)
