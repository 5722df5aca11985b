"""Stage 3's prefetching: the forward's unit order, recorded on one pass and followed on the next, and the units
to gather ahead of their module along it.

One :class:`Prefetcher` per stage-3 store answers what the store asks between its hooks: which units to gather
ahead (the order of first uses: forward ahead, backward in reverse, within ``stage3_prefetch_bucket_size`` and
``stage3_max_live_parameters``), in which runs (the units one prefetch issues, gathered together: one all-gather
per run of at most :data:`GATHER_BATCH_BYTES`, ``zero_core.gather_batch``, DeepSpeed's coalesced prefetch gather;
units of :data:`GATHER_ALONE_BYTES` or more alone, straight into their buffer), whether this pass still follows
the record (a pass that departs drops prefetching and records again; its gathers are agreed with the peers one by
one) and whether a unit stays gathered after its module for a near reuse (DeepSpeed's
``stage3_max_reuse_distance``, measured over the full sequence, repeats included: a tied or re-run module uses its
unit twice). It issues nothing itself: the store gathers the runs it returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from zero_core.layout import Bucket
from zero_core.shard_state import ShardState
from zero_core.shard_storage import ShardStorage

__all__ = ["GATHER_ALONE_BYTES", "GATHER_BATCH_BYTES", "Prefetcher"]

GATHER_BATCH_BYTES = 25 * 2**20
"""Most bytes one prefetch all-gather carries (the gathered size; DDP's 25 MiB bucket, as the reducer's pieces;
measured in packages/zero-core/README.md, stage 3's batched gathers)."""

GATHER_ALONE_BYTES = 2 * 2**20
"""Units of at least this many gathered bytes are gathered alone, straight into their full buffer: a batch's
output is copied out once more, and from this size that copy costs more than the collective it saves (same
place)."""

_SHARDED = ShardState.SHARDED


class PrefetchUnit(Protocol):
    """What the prefetcher reads of a unit (``zero_core.units.UnitBuffer``); it never changes one."""

    state: ShardState
    """Released (SHARDED), being gathered or gathered."""
    shared: bool
    """Gathered by copies from a shared window on the calling thread: never prefetched nor kept."""
    full: torch.Tensor | None
    """Its full buffer (the element size of a gather)."""
    storage: ShardStorage
    """Where its stored chunk lives (``batches``: whether the chunk may join a batched all-gather)."""


class Prefetcher:
    """The unit order of one forward pass, this pass's position in it, and the gathers to issue ahead.

    Args:
        units: the store's units, per ``Bucket.index`` (read for their state; never changed here).
        prefetch_numel: ``stage3_prefetch_bucket_size``, elements one prefetch may gather.
        max_live: ``stage3_max_live_parameters``, elements of non-persistent units gathered at once.
        reuse_distance: ``stage3_max_reuse_distance``, elements.
        world: ranks the units are gathered over.
        batches: runs of several units may share one all-gather (several ranks, plain all-gathers, chunks on the
            device, memory not first).

    Attributes:
        order: the recorded order of first uses (None until a pass has been recorded).
        steady: True once a whole step followed the record.
        sequence: every use of the recorded pass in order, repeats included (None until recorded), with per
            position ``next_use`` (the position of the same unit's next use, -1 for none) and ``numel_before``
            (elements gathered in the sequence before that position).
        pass_sequence: this pass's uses so far.
    """

    def __init__(self, units: Sequence[PrefetchUnit], *, prefetch_numel: int, max_live: int, reuse_distance: int,
                 world: int, batches: bool):  # fmt: skip
        self.units = units
        self.prefetch_numel, self.max_live, self.reuse_distance = prefetch_numel, max_live, reuse_distance
        self.world, self.batches = world, batches
        self.order: list[Bucket] | None = None
        self.position: dict[Bucket, int] = {}  # unit -> its index in ``order``
        self.cursor = 0  # the next expected index in ``order`` this pass
        self.follows = True  # this pass has followed ``order`` so far (or nothing is recorded)
        self.recording: list[Bucket] = []  # the order being recorded on this pass
        self.sequence: list[Bucket] | None = None
        self.next_use: list[int] = []
        self.numel_before: list[int] = []
        self.pass_sequence: list[Bucket] = []
        self.seq_cursor = 0
        self.last_pos: dict[Bucket, int] = {}  # unit -> its latest position in ``sequence`` on a steady pass
        self.steady = False

    # ---------------------------------------------------------------- the record
    def follow(self, b: Bucket) -> None:
        """Forward is about to use unit ``b``: advance along the record, or note the departure (prefetching
        stops, the order is recorded again from here, and ``steady`` falls so the next gathers are agreed)."""
        self.pass_sequence.append(b)
        seq = self.sequence
        if self.steady and seq is not None:
            if self.seq_cursor < len(seq) and seq[self.seq_cursor] is b:
                self.seq_cursor += 1
                self.last_pos[b] = self.seq_cursor - 1
            elif seq[0] is b:  # a new pass (e.g. after a forward without backward)
                self.seq_cursor, self.pass_sequence = 1, [b]
                self.last_pos[b] = 0
            else:
                self.steady = False
                self.last_pos.clear()
        order = self.order
        if order is None or not self.follows:
            if b not in self.recording:
                self.recording.append(b)
        elif order and order[0] is b:  # a new pass (e.g. after an eval forward)
            self.cursor = 1
        elif self.cursor < len(order) and order[self.cursor] is b:
            self.cursor += 1
        elif b not in order[: self.cursor]:
            self.follows = False
            self.recording = list(order[: self.cursor]) + [b]
            self.steady = False

    def after(self, b: Bucket, forward: bool) -> list[Bucket]:
        """The units that come after ``b`` in the recorded order: later ones in forward, earlier ones (nearest
        first) in backward; empty when ``b`` is not recorded."""
        pos = self.position.get(b) if self.order else None
        if pos is None:
            return []
        return self.order[pos + 1 :] if forward else self.order[:pos][::-1]

    def end_forward(self) -> None:
        """Forward is over: a first (or departed) pass becomes the record; a pass that was not steady becomes the
        sequence the reuse distances are measured on."""
        if not self.steady:
            self._set_sequence(self.pass_sequence)
        self.pass_sequence, self.seq_cursor = [], 0
        self.last_pos.clear()
        if self.order is None or not self.follows:
            self.order, self.follows = self.recording, True
            self.recording = []
            self.position = {b: i for i, b in enumerate(self.order)}

    def _set_sequence(self, seq: list[Bucket]) -> None:
        self.sequence = seq
        self.numel_before = [0]
        for b in seq:
            self.numel_before.append(self.numel_before[-1] + b.padded_numel)
        self.next_use, later = [-1] * len(seq), {}
        for i in range(len(seq) - 1, -1, -1):
            self.next_use[i] = later.get(seq[i], -1)
            later[seq[i]] = i

    def end_pass(self) -> None:
        """Backward (or a forward-only pass) is over: the next forward starts at the top; the pass was steady when
        both the sequence and the order are recorded and it followed them."""
        self.cursor = 0
        self.steady = self.sequence is not None and self.order is not None and self.follows

    def forget(self) -> None:
        """Drop the record (``empty_partition_cache``, close): the next forward records again."""
        self.order, self.position, self.cursor, self.follows, self.recording = None, {}, 0, True, []
        self.sequence, self.next_use, self.numel_before = None, [], []
        self.pass_sequence, self.seq_cursor, self.last_pos, self.steady = [], 0, {}, False

    # ---------------------------------------------------------------- what to gather ahead, and what to keep
    def runs(self, live: int, before: Bucket | None = None) -> list[list[Bucket]]:
        """The runs to gather ahead, with ``live`` elements gathered now: in forward (``before`` None) the units
        recorded after this pass's latest one; in backward at unit ``before``, the units recorded before it, nearest
        first (backward meets them in reverse). Only released units, within ``stage3_prefetch_bucket_size`` and
        ``stage3_max_live_parameters``, cut into runs: one flat group each, up to :data:`GATHER_BATCH_BYTES`, the
        first unit alone (the next module waits for it only, not for a whole batch). Empty while recording, or when
        this pass departed from the record or ``before`` is not in it."""
        order = self.order
        if not order or not self.follows:
            return []
        if before is None:
            candidates = order[self.cursor :]
        else:
            pos = self.position.get(before)
            if pos is None:
                return []
            candidates = order[:pos][::-1]
        budget, chosen, units = self.prefetch_numel, [], self.units
        for b in candidates:
            unit = units[b.index]
            if unit.state is not _SHARDED or unit.shared:
                continue  # a window's gather is a copy on this thread: nothing to overlap by issuing it early
            if b.padded_numel > budget or live + b.padded_numel > self.max_live:
                break
            chosen.append(b)
            budget -= b.padded_numel
            live += b.padded_numel
        runs, size = [], 0
        if not self.batches or len(chosen) < 3:  # batches start after the first unit, and hold two at least
            for b in chosen:
                runs.append([b])
            return runs
        for b in chosen:
            unit = units[b.index]
            nbytes = b.chunk * self.world * unit.full.element_size()
            # a large unit's own collective costs less than copying it out of a batch: it joins none; a unit
            # whose storage gathers itself (int8 blocks) never joins one either
            small = nbytes < GATHER_ALONE_BYTES and unit.storage.batches
            if small and len(runs) > 1 and runs[-1][0].group is b.group and size + nbytes <= GATHER_BATCH_BYTES:
                runs[-1].append(b)
                size += nbytes
            else:
                runs.append([b])
                size = nbytes if small else GATHER_BATCH_BYTES + 1
        return runs

    def keeps(self, b: Bucket, live: int, into_backward: bool) -> bool:
        """Whether ``b`` stays gathered after its module's forward: its next use comes within
        ``stage3_max_reuse_distance`` elements of other gathers and ``live`` stays within
        ``stage3_max_live_parameters``. DeepSpeed's rule on its trace of forward and backward together: while
        autograd records (``into_backward``), a unit's last forward use is followed by its backward use, backward
        meeting the units in reverse order, so the distance is twice the elements gathered after it in the forward
        (the forward's last unit: 0, and a reuse distance of 0 keeps nothing). DeepSpeed's default (1e9 elements)
        thus keeps every unit of a model under 5e8 elements gathered from its forward to its backward (no backward
        all-gather: 2 instead of 3 model sizes moved per step); 0 gives ZeRO-3's release after every use. A unit
        read from a shared window is never kept: its gather is a copy of shards this rank already maps, so keeping
        it would hold a second copy of them, at the end of forward (the step's peak of host memory) the whole
        model, to save one copy."""
        pos = self.last_pos.get(b)
        if pos is None or not self.steady or b.persistent or self.units[b.index].shared or live > self.max_live:
            return False
        nxt = self.next_use[pos]
        if nxt >= 0:
            distance = self.numel_before[nxt] - self.numel_before[pos + 1]
        elif into_backward and self.reuse_distance > 0:
            distance = 2 * (self.numel_before[-1] - self.numel_before[pos + 1])
        else:
            return False
        return distance <= self.reuse_distance
