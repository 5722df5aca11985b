"""Stage 3 on several ranks with a plain reduce-scatter: units adjacent in their flat group and in launch order are
reduced together (a ``reduce_piece.UnitBatch``, DeepSpeed's IPG bucket of ``reduce_bucket_size``, here also capped
at DDP's 25 MiB; the runs are cut by ``zero_comm.plan_buckets``): one reduce-scatter of a rank-major buffer whose
part ``r`` is the units' chunks ``r`` side by side, so rank ``r`` receives one contiguous range of its shard.
Gradients are written straight into their place in that buffer (no copy at launch). Not with offload (memory comes
first: a batch holds up to 25 MiB more in flight)."""

from __future__ import annotations

import torch

from zero_comm import plan_buckets
from zero_comm.buffers import scratch
from zero_core.comm_context import CommContext
from zero_core.grad_reduction import GradComm
from zero_core.layout import FlatGroup
from zero_core.precision import PrecisionPolicy
from zero_core.reduce_mode import GradSink, Reduction, TransientScatterMode
from zero_core.reduce_piece import ReductionPiece, UnitBatch


class BatchReduction(Reduction):
    """One reduce-scatter of a unit batch into this rank's shard range of its members (``out``: that range itself,
    or a scratch buffer added into it, ``dest``)."""

    __slots__ = ("batch", "out", "dest")

    def __init__(self, handle, bt: UnitBatch, out: torch.Tensor, dest: torch.Tensor) -> None:
        self.handle, self.pieces, self.pooled = handle, bt.pieces, True  # (``Reduction``'s fields)
        self.batch, self.out, self.dest = bt, out, dest

    def finish(self, boundary: bool | None) -> None:
        self.handle.wait()
        if self.out is not self.dest:
            self.dest.add_(self.out)
            scratch.give(self.out)
        bt = self.batch
        if bt.buffer is not None:  # back to the pool (as UnitBatch.give_back)
            scratch.give(bt.buffer)
            bt.buffer = None

    def give_back(self) -> None:
        self.handle.wait()  # completes at once; runs the all-to-all's sum, which reads the receive buffer
        self.batch.give_back()


class UnitBatchMode(TransientScatterMode):
    """Stage 3 with unit batches (see the module docstring); a unit in no batch is reduced on its own.

    Args: as ``ReductionMode``, and ``batch_limit``: most elements per batch (``reduce_bucket_size`` capped at the
    reducer's bytes per piece of the reduce dtype).
    """

    def __init__(self, *, flat_groups: list[FlatGroup], precision: PrecisionPolicy, comm: GradComm,
                 comm_ctx: CommContext, master: GradSink, piece_limit: int | None,
                 batch_limit: int) -> None:  # fmt: skip
        super().__init__(flat_groups=flat_groups, precision=precision, comm=comm, comm_ctx=comm_ctx, master=master,
                         piece_limit=piece_limit)  # fmt: skip
        self.batch_limit = batch_limit

    def _form_batches(self, active: list[ReductionPiece]) -> list[UnitBatch]:
        """Runs of active whole-unit pieces, adjacent in launch order and in their flat group, of at most
        ``batch_limit`` elements (filled in launch order; a run of one unit is no batch)."""
        batches = []
        run: list[ReductionPiece] = []  # adjacent pieces, launch order
        for pc in active + [None]:
            prev = run[-1].bucket if run else None
            if pc is not None and prev is not None and pc.bucket.group is prev.group \
                    and pc.bucket.index == prev.index - 1:  # fmt: skip
                run.append(pc)
                continue
            for cut in plan_buckets([p.bucket.padded_numel for p in run], self.batch_limit):
                if len(cut) > 1:
                    batches.append(UnitBatch(run[cut.start : cut.stop][::-1]))
            run = [pc] if pc is not None else []
        return batches

    def write(self, pc: ReductionPiece, at: int, grad: torch.Tensor, first: bool) -> None:
        bt = pc.batch
        if bt is None:
            return super().write(pc, at, grad, first)
        buf = bt.buffer
        if buf is None:
            buf = bt.buffer = scratch.take(pc.bucket.group.partitions * bt.stride, self.reduce_dtype, grad.device)
        flat = grad.reshape(-1)
        for lo, hi, src in bt.runs[pc][at]:
            view = buf[lo:hi]
            view.copy_(flat[src : src + hi - lo]) if first else view.add_(flat[src : src + hi - lo])

    def launch(self, pc: ReductionPiece) -> Reduction | None:
        bt = pc.batch
        if bt is None:
            return super().launch(pc)
        if not pc.clean:  # zero what no gradient was written (the padding, missing gradients)
            gaps = pc.padding if len(pc.written) == pc.slots else pc.unwritten()
            if gaps:
                if bt.buffer is None:
                    bt.buffer = scratch.take(pc.bucket.group.partitions * bt.stride, self.reduce_dtype,
                                             pc.bucket.group.device)  # fmt: skip
                for lo, hi in gaps:
                    for a, e, _ in bt.views(pc, lo, hi):
                        bt.buffer[a:e].zero_()
            pc.written = {}
        if pc is not bt.members[0]:  # launch order is the reverse of flat order: the first member launches last
            return None
        # every member is launched (their gaps zeroed): one reduce-scatter of the rank-major buffer into this
        # rank's contiguous shard range of the members
        first = pc.bucket
        shard = self.shards[first.group.index][first.shard_offset : first.shard_offset + bt.stride]
        out = shard if self.fresh and shard.dtype == self.reduce_dtype else scratch.take(bt.stride, self.reduce_dtype,
                                                                                          bt.buffer.device)  # fmt: skip
        if self.reduce_stream is None:
            handle = self.reduce(out, bt.buffer)
        else:
            with self.comm_ctx.on(self.reduce_stream):  # CUDA: off the compute stream
                handle = self.reduce(out, bt.buffer)
        return BatchReduction(handle, bt, out, shard)

    def zero(self, pieces: list[ReductionPiece]) -> None:
        for g in self.trainable:
            self.shards[g.index].zero_()
        for bt in self.batches:
            if bt.buffer is not None:
                bt.give_back()
        self._forget(pieces)

    def resident(self, pieces: list[ReductionPiece]) -> list[torch.Tensor]:
        return super().resident(pieces) + [bt.buffer for bt in self.batches if bt.buffer is not None]

    def close(self, pieces: list[ReductionPiece]) -> None:
        super().close(pieces)
        for bt in self.batches:
            bt.buffer = None
