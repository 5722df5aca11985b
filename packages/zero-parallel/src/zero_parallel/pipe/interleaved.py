"""Interleaved 1F1B (Megatron-LM's virtual pipeline stages) as data: each rank holds ``virtual_stages`` model
chunks, chunk ``c`` of rank ``r`` being virtual stage ``c * stages + r``, so an activation goes round the ranks
``virtual_stages`` times and the pipeline's idle time shrinks by that factor.

Order of work on rank ``r`` (Megatron's): forward number ``k`` runs chunk ``(k // stages) % virtual_stages`` on
micro-batch ``(k // (stages * virtual_stages)) * stages + k % stages``; backward number ``k`` the same micro-batch of
chunk ``virtual_stages - 1 - (k // stages) % virtual_stages``. A warm-up of ``min(2 * (stages - r - 1) +
(virtual_stages - 1) * stages, total)`` forwards, then one forward and one backward in turn, then the remaining
backwards. Transfers come from the order: a forward receives its input from the previous virtual stage first and
sends its output on after; a backward receives its output's gradient first and sends its input's gradient back
after. Every (chunk, micro-batch) has its own buffer slot, ``chunk * micro_batches + micro_batch``.

With ``virtual_stages`` 1 this is a plain 1F1B whose stage ``r`` runs ``2 * (stages - r - 1)`` warm-up forwards
(against DeepSpeed's ``stages - r - 1``) and sends each activation as its forward ends: the gradient of a stage's
first micro-batch is due after its further warm-up forwards instead of after one, so a stage slower than the next
does not wait for it, nor for its last ones (``pipeline.schedule: "eager_1f1b"``). Its stage ``r`` holds up to
``2 * (stages - r - 1) + 1`` micro-batches' activations (DeepSpeed's 1F1B ``stages - r``); the backwards run in
micro-batch order, so the gradients are 1F1B's.
"""

from __future__ import annotations

from zero_parallel.pipe.schedule import (
    BackwardPass,
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


class InterleavedTrainSchedule(PipeSchedule):
    """Interleaved 1F1B over ``stages`` ranks of ``virtual_stages`` chunks each; one instruction group per forward or
    backward. The last step reduces tied gradients, reduces gradients and steps the optimizer.

    Raises (``__init__``): ValueError for ``virtual_stages`` < 1, or, with ``virtual_stages`` > 1, ``micro_batches``
    not a multiple of ``stages`` (Megatron's condition: the micro-batches go round in groups of ``stages``).
    """

    forward_only = False

    def __init__(self, micro_batches: int, stages: int, stage_id: int, virtual_stages: int) -> None:
        super().__init__(micro_batches, stages, stage_id)
        if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
            raise ValueError(f"{type(self).__name__}: virtual_stages must be an int >= 1, got {virtual_stages!r}")
        if virtual_stages > 1 and micro_batches % stages:
            raise ValueError(f"{type(self).__name__}: micro_batches={micro_batches} must be a multiple of "
                             f"stages={stages} (gradient_accumulation_steps for the interleaved schedule)")  # fmt: skip
        self.virtual_stages = virtual_stages

    def num_pipe_buffers(self) -> int:
        return self.micro_batches * self.virtual_stages

    def _unit(self, k: int, forward: bool) -> tuple[int, int]:
        """(chunk, micro-batch) of this rank's ``k``-th forward or backward."""
        p, v = self.stages, self.virtual_stages
        chunk = (k // p) % v
        micro = (k // (p * v)) * p + k % p
        return (chunk if forward else v - 1 - chunk), micro

    def _forward(self, k: int) -> list[PipeInstruction]:
        chunk, mb = self._unit(k, True)
        virtual, last = chunk * self.stages + self.stage_id, self.stages * self.virtual_stages - 1
        buf = chunk * self.micro_batches + mb
        cmds: list[PipeInstruction] = []
        if virtual > 0:
            cmds.append(RecvActivation(buf, chunk))
        if virtual in (0, last):
            cmds.append(LoadMicroBatch(buf, chunk))
        cmds.append(ForwardPass(buf, chunk))
        if virtual < last:
            cmds.append(SendActivation(buf, chunk))
        return cmds

    def _backward(self, k: int) -> list[PipeInstruction]:
        chunk, mb = self._unit(k, False)
        virtual, last = chunk * self.stages + self.stage_id, self.stages * self.virtual_stages - 1
        buf = chunk * self.micro_batches + mb
        cmds: list[PipeInstruction] = [RecvGrad(buf, chunk)] if virtual < last else []
        cmds.append(BackwardPass(buf, chunk))
        if virtual > 0:
            cmds.append(SendGrad(buf, chunk))
        return cmds

    def steps(self) -> list[list[PipeInstruction]]:
        total = self.micro_batches * self.virtual_stages
        if self.forward_only:
            return [self._forward(k) for k in range(total)]
        warmup = min(2 * (self.stages - self.stage_id - 1) + (self.virtual_stages - 1) * self.stages, total)
        out = [self._forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            out.append(self._forward(warmup + k))
            out.append(self._backward(k))
        out += [self._backward(k) for k in range(total - warmup, total)]
        out[-1] = out[-1] + [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
        return out


class InterleavedInferenceSchedule(InterleavedTrainSchedule):
    """The forwards of :class:`InterleavedTrainSchedule` alone, in its order (no backward, no step)."""

    forward_only = True
