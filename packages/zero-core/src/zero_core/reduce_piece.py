"""One reduction piece (a reduction bucket, DDP's and Megatron's ``Bucket``) and this rank's part of its result.

A layout bucket (``zero_core.layout.Bucket``) is reduced in one or more pieces: contiguous runs of whole parameters,
bucket-local elements ``[lo, hi)``. A :class:`ReductionPiece` owns everything about one of them that changes while
training: its send buffer, how many gradients it expects and how many have arrived this round, whether it is
launched, and the collective in flight with its receive buffer. The layout stays frozen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zero_comm.buffers import scratch
from zero_core.layout import Bucket

if TYPE_CHECKING:
    from zero_core.reduce_batched import UnitBatch


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
        self.pending = 0  # pieces of this round's reduction not reduced yet


class ReductionPiece:
    """Bucket-local elements ``[lo, hi)`` of ``bucket`` (whole parameters; the first piece starts at 0, the last
    ends at ``bucket.padded_numel``) and their reduction state.

    Args:
        bucket: the layout bucket it is part of.
        bucket_round: that bucket's counts, shared with its other pieces.
        lo, hi: its bucket-local element range.
        first_param: the smallest model position among its parameters (launch order, see ``GradReducer``).
        slots: how many parameters lie in ``[lo, hi)``.
    """

    def __init__(self, bucket: Bucket, bucket_round: BucketRound, lo: int, hi: int, first_param: int,
                 slots: int) -> None:  # fmt: skip
        self.bucket, self.lo, self.hi, self.first_param, self.slots = bucket, lo, hi, first_param, slots
        self.bucket_round = bucket_round
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
        # the reduction in flight (between launch and its finish)
        self.handle = None  # the collective's handle (``wait()``, ``ready()``)
        self.out: torch.Tensor | None = None  # where the collective writes (a shard view or a scratch buffer)
        self.dest: torch.Tensor | None = None  # where the result ends up (``out`` itself when written directly)
        self.part: ShardPart | None = None  # this rank's part of a scattering reduction

    @property
    def whole(self) -> bool:
        """The piece is its whole bucket."""
        return self.lo == 0 and self.hi == self.bucket.padded_numel

    def record_write(self, at: int, numel: int) -> None:
        """A slot's first gradient since the buffer was cleared was copied to piece-local ``[at, at + numel)``."""
        self.written[at] = at + numel

    def unwritten(self) -> list[tuple[int, int]]:
        """Piece-local ranges no gradient was written into since the buffer was cleared (padding, unused or frozen
        slots, stale values of the last round), in order."""
        gaps, pos = [], 0
        for lo, hi in sorted(self.written.items()) + [(self.hi - self.lo, self.hi - self.lo)]:
            if lo > pos:
                gaps.append((pos, lo))
            pos = max(pos, hi)
        return gaps

    def lend(self, grad: torch.Tensor) -> None:
        """Keep autograd's gradient ``grad`` (contiguous, reduce dtype) as the send buffer instead of a copy."""
        self.buffer, self.borrowed = grad.detach().reshape(-1), True

    def give_back(self) -> None:
        """The reduction has completed: a taken send buffer goes back to the pool (the next round writes the same
        storage instead of faulting fresh pages in); a borrowed gradient is only let go."""
        if self.buffer is not None and not self.borrowed:
            scratch.give(self.buffer)
        self.buffer, self.borrowed = None, False

    def start(self, handle, out: torch.Tensor | None, dest: torch.Tensor | None, part: ShardPart | None) -> None:
        """Record the collective just started for this piece."""
        self.handle, self.out, self.dest, self.part = handle, out, dest, part

    def finished(self) -> None:
        """Drop the references of the completed reduction."""
        self.handle = self.out = self.dest = self.part = None

    def new_round(self) -> None:
        """Nothing arrived or launched yet."""
        self.launched = False
        self.arrived = 0


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
