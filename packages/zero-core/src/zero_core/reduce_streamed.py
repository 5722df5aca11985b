"""Stage 3 with a master store that keeps the gradients itself (ZeRO-Infinity: streamed to NVMe,
``MasterStore.takes_grad_shards``): no gradient shard here; each reduced piece is handed to the store as it lands.

At most one reduction is in flight (``one_in_flight``: the reducer finishes the previous one, handing it over,
before it launches the next), so host memory holds one unit's gradient in flight besides the one backward is
filling. A unit above ``reduce_bucket_size`` is cut into pieces of whole parameters, and a piece of one parameter is
sent from autograd's own gradient (no buffer at all)."""

from __future__ import annotations

from typing import Protocol

import torch

from zero_core.comm_context import CommContext
from zero_core.grad_reduction import GradComm
from zero_core.layout import FlatGroup, ParamSlot
from zero_core.precision import PrecisionPolicy
from zero_core.reduce_mode import GradSink, Reduction, TransientScatterMode
from zero_core.reduce_piece import ReductionPiece, ShardPart


class StreamedGradSink(GradSink, Protocol):
    """The master store as the streamed mode uses it: a store that keeps the gradients itself
    (``takes_grad_shards``)."""

    def drop_grads(self) -> None:
        """Discard the accumulated gradients (``zero()``)."""
        ...


class StreamedReduction(Reduction):
    """A piece reduced in place (this rank's part of its send buffer, ``out``) and handed to the master store when
    it lands; no piece is counted off (the store, not the shard, has it)."""

    __slots__ = ("pc", "out", "at", "master")

    def __init__(self, handle, pc: ReductionPiece, out: torch.Tensor, at: int, master: StreamedGradSink) -> None:
        super().__init__(handle, (), False)
        self.pc, self.out, self.at, self.master = pc, out, at, master

    def finish(self, boundary: bool | None) -> None:
        self.handle.wait()
        pc, out = self.pc, self.out
        if pc.whole and out.numel() == pc.bucket.chunk:
            self.master.on_grad_ready(pc.bucket, out, boundary)  # copies ``out`` before returning
        elif out.numel():  # a piece's part of this rank's chunk, at shard offset ``at``
            self.master.on_grad_ready(pc.bucket, out, boundary, start=self.at)
        pc.give_back()  # ``out`` is a view of the piece's buffer: back to the pool only now


class StreamedMode(TransientScatterMode):
    """Stage 3, gradients streamed to the master store (see the module docstring).

    Args: as ``ReductionMode`` (``piece_limit``: ``reduce_bucket_size`` when the collective takes pieces).
    """

    streamed = True
    one_in_flight = True

    def __init__(self, *, flat_groups: list[FlatGroup], precision: PrecisionPolicy, comm: GradComm,
                 comm_ctx: CommContext, master: StreamedGradSink, piece_limit: int | None) -> None:  # fmt: skip
        super().__init__(flat_groups=flat_groups, precision=precision, comm=comm, comm_ctx=comm_ctx, master=master,
                         piece_limit=piece_limit)  # fmt: skip
        self.reductions = 0  # reductions launched (each finished before the next one starts)
        self.borrowed = 0  # ... of them sent straight from autograd's gradient

    def _allocate(self, count: int) -> list[torch.Tensor | None]:
        """No gradient shard: the master store accumulates."""
        return [None] * count

    def new_piece(self, pc: ReductionPiece, run: list[ParamSlot]) -> None:
        super().new_piece(pc, run)
        if self.piece_limit and len(run) == 1 and run[0].bucket_offset == pc.lo:
            pc.send_numel = run[0].numel

    def write(self, pc: ReductionPiece, at: int, grad: torch.Tensor, first: bool) -> None:
        if not (first and self._lend(pc, at, grad)):
            super().write(pc, at, grad, first)

    def _lend(self, pc: ReductionPiece, at: int, grad: torch.Tensor) -> bool:
        """A piece of one parameter: keep autograd's gradient itself as the piece's send buffer (the reducer now
        holds its only reference), instead of copying it into a buffer of the piece's size. The collective then
        moves the parameter's elements only (a trailing padding receives no gradient: the store steps it with
        zero, as an unwritten range). With ``reduce_bucket_size`` below two parameters, no unit-sized gradient
        buffer exists at all: what backward holds is autograd's gradient of one parameter besides the one
        reduction in flight (ZeRO-Infinity's memory-first path)."""
        if not (pc.send_numel and at == 0 and pc.buffer is None and grad.is_contiguous()
                and grad.dtype == self.reduce_dtype):  # fmt: skip
            return False
        pc.lend(grad)
        self.borrowed += 1
        return True

    def launch(self, pc: ReductionPiece) -> Reduction:
        """In place: this rank's part of the send buffer receives the result (the collective reads its input
        before it writes), so no output chunk is allocated per reduction."""
        self._zero_gaps(pc)  # (a lent gradient ends at its parameter's end: a gap past it is empty)
        part = ShardPart(pc, self._send(pc))
        out = part.send[part.a - pc.lo : part.e - pc.lo]
        self.reductions += 1
        return StreamedReduction(self._scatter(pc, part, out), pc, out, part.at, self.master)

    def zero(self, pieces: list[ReductionPiece]) -> None:
        self.master.drop_grads()  # the master store holds the accumulated gradients: it drops them too
        self._forget(pieces)
