"""Stage 3 with a master store that keeps the gradients itself (ZeRO-Infinity: streamed to NVMe,
``MasterStore.takes_grad_shards``): no gradient shard here; each reduced piece is handed to the store as it lands.

At most one reduction is in flight: the previous one lands (and is handed over) before the next starts, so host
memory holds one unit's gradient in flight besides the one backward is filling. A unit above
``reduce_bucket_size`` is cut into pieces of whole parameters, and a piece of one parameter is sent from autograd's
own gradient (no buffer at all)."""

from __future__ import annotations

import torch

from zero_core.layout import FlatGroup, ParamSlot
from zero_core.reduce_mode import TransientScatterMode
from zero_core.reduce_piece import ReductionPiece, ShardPart


class StreamedMode(TransientScatterMode):
    """Stage 3, gradients streamed to the master store (see the module docstring)."""

    streamed = True

    def __init__(self, reducer, rt, comm) -> None:
        super().__init__(reducer, rt, comm)
        self.reductions = 0  # reductions launched (each waited for before the next one starts)
        self.borrowed = 0  # ... of them sent straight from autograd's gradient

    def allocate(self, groups: list[FlatGroup]) -> None:
        """No gradient shard: the master store accumulates."""

    def piece_limit(self) -> int | None:
        # runs of at most reduce_bucket_size, so a unit's gradient need not be held whole (see _lend)
        return self.rt.config.reduce_bucket_size if self.comm.takes_pieces else None

    def new_piece(self, pc: ReductionPiece, run: list[ParamSlot]) -> None:
        super().new_piece(pc, run)
        if self.piece_limit() and len(run) == 1 and run[0].bucket_offset == pc.lo:
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

    def launch(self, pc: ReductionPiece) -> None:
        """In place: this rank's part of the send buffer receives the result (the collective reads its input
        before it writes), so no output chunk is allocated per reduction."""
        part = ShardPart(pc, self._send(pc))
        self.reducer.wait_reduced()
        out = part.send[part.a - pc.lo : part.e - pc.lo]
        pc.start(self._scatter(pc, part, out), out, None, part)
        self.reducer.in_flight.append((pc, self._hand_over))
        self.reductions += 1
        if self.rt.world == 1:  # nothing to overlap: hand it over now, not while the next gradient is computed
            self.reducer.wait_reduced()

    def _hand_over(self, pc: ReductionPiece) -> None:
        out, boundary = pc.out, self.reducer.boundary
        if pc.whole and out.numel() == pc.bucket.chunk:
            self.rt.master.on_grad_ready(pc.bucket, out, boundary)  # copies ``out`` before returning
        elif out.numel():  # a piece's part of this rank's chunk, at shard offset ``part.at``
            self.rt.master.on_grad_ready(pc.bucket, out, boundary, start=pc.part.at)
        pc.give_back()  # ``out`` is a view of the piece's buffer: back to the pool only now
        pc.finished()

    def zero(self, groups: list[FlatGroup], pieces: list[ReductionPiece]) -> None:
        self.rt.master.drop_grads()  # the master store holds the accumulated gradients: it drops them too
        self._forget(pieces)
