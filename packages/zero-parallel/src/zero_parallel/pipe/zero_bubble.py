"""A zero-bubble schedule (ZB-H1, Qi et al. 2023) as data: each backward is split into its input-gradient part
(``B``: the gradient of the stage's inputs, sent to the previous stage at once) and its weight-gradient part
(``W``: the parameters' gradients, which nothing downstream waits for), and the ``W`` parts are deferred into the
time a stage would otherwise wait for its next gradient.

Order of work on stage ``s`` of ``p`` (``m`` micro-batches): a warm-up of ``w = min(p - 1 - s, m)`` forwards, then
for each remaining micro-batch one forward and one ``B`` in turn (1F1B's order, so its transfers are 1F1B's), then
the last ``w`` ``B``s. A ``W`` runs after a ``B`` once more than ``w`` of them are pending, and after every ``B`` of
the cool-down (where 1F1B's stage ``s`` would idle for ``p - 1 - s`` backwards of the later stages); the pending
ones run at the end, before the gradient reduction and the optimizer step. Every micro-batch has its own buffer
slot. A micro-batch's graph is held from its forward to its ``B``, and what its ``W`` needs (the stage's Linear
layers' inputs and output gradients, :mod:`zero_parallel.pipe.weight_grad`) from its ``B`` to its ``W``: at most
``min(2 * w + 1, m)`` micro-batches on stage ``s`` hold either, against 1F1B's ``w + 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

from zero_parallel.pipe.schedule import (
    BufferOpInstruction,
    ForwardPass,
    LoadMicroBatch,
    OptimizerStep,
    PipeInstruction,
    PipeSchedule,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
)


@dataclass(frozen=True, repr=False)
class BackwardInputPass(BufferOpInstruction):
    """``B``: the gradients of the slot's inputs only (from its loss, or its outputs with the received
    gradients), keeping the graph for the slot's :class:`BackwardWeightPass`."""


@dataclass(frozen=True, repr=False)
class BackwardWeightPass(BufferOpInstruction):
    """``W``: the parameters' gradients of the slot's micro-batch, accumulated as a full backward would."""


class ZeroBubbleTrainSchedule(PipeSchedule):
    """ZB-H1 over ``stages`` stages (see the module notes); one instruction group per ``F``, ``B`` or ``W``; the
    last step reduces tied gradients, reduces gradients and steps the optimizer."""

    def num_pipe_buffers(self) -> int:
        return self.micro_batches

    def _forward(self, mb: int) -> list[PipeInstruction]:
        cmds: list[PipeInstruction] = [RecvActivation(mb)] if not self.is_first_stage else []
        if self.is_first_stage or self.is_last_stage:
            cmds.append(LoadMicroBatch(mb))
        cmds.append(ForwardPass(mb))
        if not self.is_last_stage:
            cmds.append(SendActivation(mb))
        return cmds

    def _input_backward(self, mb: int) -> list[PipeInstruction]:
        cmds: list[PipeInstruction] = [RecvGrad(mb)] if not self.is_last_stage else []
        cmds.append(BackwardInputPass(mb))
        if not self.is_first_stage:
            cmds.append(SendGrad(mb))
        return cmds

    def steps(self) -> list[list[PipeInstruction]]:
        m = self.micro_batches
        warmup = min(self.stages - 1 - self.stage_id, m)
        out = [self._forward(k) for k in range(warmup)]
        pending: list[int] = []  # micro-batches whose W is deferred, oldest first
        for k in range(m):
            if warmup + k < m:
                out.append(self._forward(warmup + k))
            out.append(self._input_backward(k))
            pending.append(k)
            if len(pending) > warmup or warmup + k >= m:
                out.append([BackwardWeightPass(pending.pop(0))])
        out += [[BackwardWeightPass(k)] for k in pending]
        out[-1] = out[-1] + [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
        return out
