"""The reduction's state objects: one reduction piece (a reduction bucket, DDP's and Megatron's ``Bucket``), its
layout bucket's counts, this rank's part of a scattering reduction, and stage 3's unit batch.

A layout bucket (``zero_core.layout.Bucket``) is reduced in one or more pieces: contiguous runs of whole parameters,
bucket-local elements ``[lo, hi)``. A :class:`ReductionPiece` owns everything about one of them that changes while
training: its send buffer, how many gradients it expects and how many have arrived this round, whether it is
launched. The collective in flight is a ``reduce_mode.Reduction`` the mode returns and the reducer queues. The layout
stays frozen.
"""

from __future__ import annotations

import torch

from zero_comm.buffers import scratch
from zero_core.layout import Bucket


class BucketRound:
    """One layout bucket's counts in the reduction, shared by its pieces: how many of its parameters' gradients are
    hooked, how many arrived this round (all in: the parameter store may release what it kept for them), and how
    many of its pieces are launched but not yet reduced (none left: the master store may use the bucket).

    Args:
        bucket: the layout bucket.
    """

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        self.expected = 0  # hooked gradients
        self.arrived = 0  # ... of them arrived this round
        self.active = 0  # pieces reduced each round (those of a bucket with a hooked gradient: all or none)
        self.pending = 0  # pieces of this round's reduction not reduced yet


class ReductionPiece:
    """Bucket-local elements ``[lo, hi)`` of ``bucket`` (whole parameters; the first piece starts at 0, the last
    ends at ``bucket.padded_numel``) and their reduction state.

    Args:
        bucket: the layout bucket it is part of.
        bucket_round: that bucket's counts, shared with its other pieces.
        lo, hi: its bucket-local element range.
        first_param: the smallest model position among its parameters (launch order, see ``GradReducer``).
        covered: piece-local ``(start, end)`` of each of its parameters, in order.
    """

    def __init__(self, bucket: Bucket, bucket_round: BucketRound, lo: int, hi: int, first_param: int,
                 covered: list[tuple[int, int]]) -> None:  # fmt: skip
        self.bucket, self.lo, self.hi, self.first_param = bucket, lo, hi, first_param
        self.slots = len(covered)  # parameters in [lo, hi)
        self.bucket_round = bucket_round
        self.whole = lo == 0 and hi == bucket.padded_numel  # the piece is its whole bucket
        # piece-local ranges no parameter covers (padding): what stays unwritten when every slot was written
        self.padding = _gaps(covered, hi - lo)
        self.expected = 0  # hooked gradients in [lo, hi)
        self.arrived = 0  # ... of them arrived this round
        self.launched = False
        # the send buffer, ``hi - lo`` elements: stages 0/1 a view of the bucket's persistent buffer (accumulation
        # dtype); stages 2/3 taken from ``zero_comm.buffers.scratch`` per round (reduce dtype), or autograd's own
        # gradient when ``borrowed``
        self.buffer: torch.Tensor | None = None
        self.transient = False  # stages 2/3: ``buffer`` is taken per round and given back once reduced
        self.borrowed = False  # streamed: ``buffer`` is autograd's gradient of the piece's one parameter
        # piece-local start -> end of each slot written since the buffer was last (logically) cleared; the rest of
        # the buffer holds stale values, zeroed only at launch (stages 0/1: no memset of the whole buffer per step)
        self.written: dict[int, int] = {}
        self.clean = True  # every element of ``buffer`` is meaningful (zero or accumulated): add into it
        # streamed, a piece of one parameter starting at ``lo``: its collective moves that parameter's elements
        # only (the same extent on every rank); 0: ``hi - lo``
        self.send_numel = 0
        self.batch: UnitBatch | None = None  # stage 3: the units reduced together with this one

    def unwritten(self) -> list[tuple[int, int]]:
        """Piece-local ranges no gradient was written into since the buffer was cleared (padding, unused or frozen
        slots, stale values of the last round), in order."""
        if len(self.written) == self.slots:  # every slot written: the padding only
            return self.padding
        return _gaps(sorted(self.written.items()), self.hi - self.lo)

    def part_range(self) -> tuple[int, int]:
        """This rank's part of the piece's reduced result: (its shard offset, elements); 0 elements when the piece
        lies outside this rank's chunk (as :class:`ShardPart` for a piece that sends its whole range)."""
        b = self.bucket
        base = b.group.rank * b.chunk
        a = max(self.lo, base)
        return b.shard_offset + a - base, max(0, min(self.hi, base + b.chunk) - a)

    def lend(self, grad: torch.Tensor) -> None:
        """Keep autograd's gradient ``grad`` (contiguous, reduce dtype) as the send buffer instead of a copy."""
        self.buffer, self.borrowed = grad.detach().reshape(-1), True

    def give_back(self) -> None:
        """The reduction has completed: a taken send buffer goes back to the pool (the next round writes the same
        storage instead of faulting fresh pages in); a borrowed gradient is only let go."""
        if self.buffer is not None and not self.borrowed:
            scratch.give(self.buffer)
        self.buffer, self.borrowed = None, False


def _gaps(covered: list[tuple[int, int]], end: int) -> list[tuple[int, int]]:
    """The ranges of ``[0, end)`` outside the sorted ``covered`` ranges."""
    gaps, pos = [], 0
    for lo, hi in covered:
        if lo > pos:
            gaps.append((pos, lo))
        pos = max(pos, hi)
    if end > pos:
        gaps.append((pos, end))
    return gaps


class ShardPart:
    """This rank's part of a piece's scattering reduction: bucket-local ``[a, e)`` inside its chunk (which starts at
    bucket-local ``base``), at shard offset ``at``; ``send`` is what the collective sends (up to ``hi``: a piece of
    one parameter does not send its padding)."""

    __slots__ = ("send", "hi", "base", "a", "e", "at")

    def __init__(self, pc: ReductionPiece, send: torch.Tensor) -> None:
        b = pc.bucket
        self.base = b.group.rank * b.chunk
        self.hi = pc.lo + pc.send_numel if pc.send_numel else pc.hi
        self.send = send[: self.hi - pc.lo] if send.numel() > self.hi - pc.lo else send
        self.a = max(pc.lo, self.base)
        self.e = max(self.a, min(self.hi, self.base + b.chunk))
        self.at = b.shard_offset + self.a - self.base

    @property
    def numel(self) -> int:
        """Elements this rank receives."""
        return self.e - self.a

    def splits(self, pc: ReductionPiece) -> list[int]:
        """Elements of the sent range in each rank's chunk (``zero_comm.reduce_scatter_uneven``'s splits)."""
        b = pc.bucket
        return [max(0, min(self.hi, (r + 1) * b.chunk) - max(pc.lo, r * b.chunk)) for r in range(b.group.partitions)]


class UnitBatch:
    """Stage 3: whole-unit pieces of one flat group, adjacent in flat order, reduced by one reduce-scatter.

    ``buffer`` (``partitions * stride`` elements of the reduce dtype, taken when the first gradient arrives) is
    rank-major: part ``r`` holds every member's chunk ``r``, member ``m``'s at ``offset[m]`` inside the part, in
    shard order, so rank ``r``'s result is its shard ``[first.shard_offset, first.shard_offset + stride)``.

    Args:
        members: the pieces, flat order (the reverse of launch order).
    """

    def __init__(self, members: list[ReductionPiece]) -> None:
        self.members = members
        self.pieces = tuple(members)  # what its reduction completes (``reduce_mode.Reduction.pieces``)
        self.stride = 0  # elements per rank: the members' chunks summed
        self.offset: dict[ReductionPiece, int] = {}  # member -> its chunk's start inside a rank's part
        self.buffer: torch.Tensor | None = None
        # member -> piece-local start of each of its slots -> (buffer start, buffer end, gradient start) of each
        # run of the slot's gradient (split at rank chunk boundaries), fixed while the batch lives
        self.runs: dict[ReductionPiece, dict[int, list[tuple[int, int, int]]]] = {}
        for pc in members:
            self.offset[pc] = self.stride
            self.stride += pc.bucket.chunk
            pc.batch = self
        for pc in members:
            b = pc.bucket
            self.runs[pc] = {s.bucket_offset - pc.lo: self.views(pc, s.bucket_offset, s.bucket_offset + s.numel)
                             for s in b.slots}  # fmt: skip

    def views(self, pc: ReductionPiece, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(buffer start, buffer end, source start) for member ``pc``'s bucket-local elements ``[lo, hi)``, split at
        chunk boundaries (a parameter may straddle ranks' chunks); the source counts from ``lo``."""
        chunk = pc.bucket.chunk
        out = []
        for r in range(lo // chunk, -(-hi // chunk)):
            a, e = max(lo, r * chunk), min(hi, (r + 1) * chunk)
            at = r * self.stride + self.offset[pc] + a - r * chunk
            out.append((at, at + e - a, a - lo))
        return out

    def give_back(self) -> None:
        """The buffer goes back to the pool (the reduce-scatter has completed, or nothing was written)."""
        if self.buffer is not None:
            scratch.give(self.buffer)
            self.buffer = None

    def disband(self) -> None:
        """The members are reduced on their own from now on."""
        self.give_back()
        for pc in self.members:
            pc.batch = None
