"""Pipeline schedules as data: for one stage, the list of steps, each a list of instructions (DeepSpeed's
``deepspeed.runtime.pipe.schedule``). A schedule runs no model, so it is tested by reading it.

Instructions name a buffer slot (``buffer_id``); a stage keeps ``num_pipe_buffers()`` slots of inputs, outputs,
labels and gradients, and a micro-batch ``m`` uses slot ``m % num_pipe_buffers()``. In DeepSpeed's schedules the
steps of all stages line up, so that every send has its receive in the same step on the neighbouring stage; the
interleaved schedule (:mod:`zero_parallel.pipe.interleaved`) is a per-stage order of work instead.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class PipeInstruction:
    """One thing a stage does in a step; the subclasses name what (DeepSpeed's instruction classes)."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v}" for k, v in vars(self).items() if not (k == "chunk" and v == 0))
        return f"{type(self).__name__}({fields})"


@dataclass(frozen=True, repr=False)
class OptimizerStep(PipeInstruction):
    """Step the optimizer (gradients already reduced)."""


@dataclass(frozen=True, repr=False)
class ReduceGrads(PipeInstruction):
    """Reduce the accumulated gradients over the stage's data-parallel group."""


@dataclass(frozen=True, repr=False)
class ReduceTiedGrads(PipeInstruction):
    """Sum tied weights' gradients over the stages holding them."""


@dataclass(frozen=True, repr=False)
class BufferOpInstruction(PipeInstruction):
    """An instruction on buffer slot ``buffer_id``, for the stage's model chunk ``chunk`` (0 unless the schedule
    interleaves virtual stages)."""

    buffer_id: int
    chunk: int = 0


@dataclass(frozen=True, repr=False)
class LoadMicroBatch(BufferOpInstruction):
    """First stage: the micro-batch's inputs into the slot; last stage: its labels."""


@dataclass(frozen=True, repr=False)
class ForwardPass(BufferOpInstruction):
    """Run the stage on the slot's inputs (the last stage computes the loss)."""


@dataclass(frozen=True, repr=False)
class BackwardPass(BufferOpInstruction):
    """Backward from the slot's loss (last stage) or outputs with the received gradients."""


@dataclass(frozen=True, repr=False)
class SendActivation(BufferOpInstruction):
    """Send the slot's outputs to the next stage."""


@dataclass(frozen=True, repr=False)
class RecvActivation(BufferOpInstruction):
    """Receive the previous stage's outputs as the slot's inputs."""


@dataclass(frozen=True, repr=False)
class SendGrad(BufferOpInstruction):
    """Send the gradients of the slot's inputs to the previous stage."""


@dataclass(frozen=True, repr=False)
class RecvGrad(BufferOpInstruction):
    """Receive the gradients of the slot's outputs from the next stage."""


class PipeSchedule(ABC):
    """The steps of one stage for a batch of ``micro_batches`` micro-batches over ``stages`` stages.

    Iterating yields the steps (lists of :class:`PipeInstruction`); :meth:`steps` returns them all.

    Raises (``__init__``): ValueError for fewer than one micro-batch or stage, or ``stage_id`` out of range.
    """

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        for name, value in (("micro_batches", micro_batches), ("stages", stages)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{type(self).__name__}: {name} must be an int >= 1, got {value!r}")
        if not isinstance(stage_id, int) or not 0 <= stage_id < stages:
            raise ValueError(f"{type(self).__name__}: stage_id must be in 0..{stages - 1}, got {stage_id!r}")
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.prev_stage = stage_id - 1
        self.next_stage = stage_id + 1

    @abstractmethod
    def steps(self) -> list[list[PipeInstruction]]:
        """Every step of the batch, in order."""

    def num_pipe_buffers(self) -> int:
        """Buffer slots this stage needs."""
        return self.micro_batches

    def __iter__(self) -> Iterator[list[PipeInstruction]]:
        return iter(self.steps())

    @property
    def stage(self) -> int:
        """The stage this schedule is for."""
        return self.stage_id

    @property
    def num_stages(self) -> int:
        """The number of stages."""
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per batch."""
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        """True for stage 0."""
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        """True for the last stage."""
        return self.stage_id == self.stages - 1

    def _valid_micro_batch(self, micro_batch_id: int) -> bool:
        return 0 <= micro_batch_id < self.micro_batches

    def _valid_stage(self, stage_id: int) -> bool:
        return 0 <= stage_id < self.stages

    def _buffer_idx(self, micro_batch_id: int) -> int:
        return micro_batch_id % self.num_pipe_buffers()


class TrainSchedule(PipeSchedule):
    """DeepSpeed's synchronous 1F1B schedule: ``2 * (micro_batches + stages - 1)`` steps; in step ``t`` stage ``s``
    runs a forward when ``t`` and ``s`` have the same parity, else a backward; the last step reduces tied
    gradients, reduces gradients and steps the optimizer. Each stage keeps ``max(2, min(stages - s,
    micro_batches))`` micro-batches in flight (its buffer slots)."""

    def _micro_batch(self, step_id: int) -> tuple[int, bool]:
        """(micro-batch, is forward) of ``step_id`` on this stage; the micro-batch may be out of range (idle)."""
        if step_id % 2 == self.stage_id % 2:
            return step_id // 2 - self.stage_id // 2, True
        return (step_id + 1) // 2 - self.stages + (self.stage_id + 1) // 2, False

    def steps(self) -> list[list[PipeInstruction]]:
        total = 2 * (self.micro_batches + self.stages - 1)
        has_prev, has_next = self._valid_stage(self.prev_stage), self._valid_stage(self.next_stage)
        out, prev = [], -1
        for step_id in range(total):
            mb, forward = self._micro_batch(step_id)
            now_ok, prev_ok = self._valid_micro_batch(mb), self._valid_micro_batch(prev)
            cmds: list[PipeInstruction] = []
            if forward:  # hand back the previous backward's gradient, then take this forward's input
                if prev_ok and has_prev:
                    cmds.append(SendGrad(self._buffer_idx(prev)))
                if now_ok and has_prev:
                    cmds.append(RecvActivation(self._buffer_idx(mb)))
            else:  # take this backward's gradient, then pass on the previous forward's output
                if now_ok and has_next:
                    cmds.append(RecvGrad(self._buffer_idx(mb)))
                if prev_ok and has_next:
                    cmds.append(SendActivation(self._buffer_idx(prev)))
            if forward and now_ok and (self.is_first_stage or self.is_last_stage):
                cmds.append(LoadMicroBatch(self._buffer_idx(mb)))
            if now_ok:
                cmds.append((ForwardPass if forward else BackwardPass)(self._buffer_idx(mb)))
            if step_id == total - 1:
                cmds += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
            prev = mb
            out.append(cmds)
        return out

    def num_pipe_buffers(self) -> int:
        return max(2, min(self.stages - self.stage_id, self.micro_batches))


class InferenceSchedule(PipeSchedule):
    """DeepSpeed's forward-only schedule: ``micro_batches + stages - 1`` steps, stage ``s`` running micro-batch
    ``t - s`` in step ``t``, with two buffer slots alternating between receiving and sending (even stages send
    before receiving, odd stages receive before sending)."""

    def steps(self) -> list[list[PipeInstruction]]:
        out = []
        even = self.stage_id % 2 == 0
        has_prev, has_next = self._valid_stage(self.prev_stage), self._valid_stage(self.next_stage)
        for step_id in range(self.micro_batches + self.stages - 1):
            mb = step_id - self.stage_id
            recv_buf, send_buf = (step_id % 2, (step_id + 1) % 2) if even else ((step_id + 1) % 2, step_id % 2)
            now_ok, prev_ok = self._valid_micro_batch(mb), self._valid_micro_batch(mb - 1)
            cmds: list[PipeInstruction] = []
            if now_ok and (self.is_first_stage or self.is_last_stage):
                cmds.append(LoadMicroBatch(recv_buf))
            send = [SendActivation(send_buf)] if has_next and prev_ok else []
            recv = [RecvActivation(recv_buf)] if has_prev and now_ok else []
            cmds += send + recv if even else recv + send
            if now_ok:
                cmds.append(ForwardPass(recv_buf))
            out.append(cmds)
        return out

    def num_pipe_buffers(self) -> int:
        return 2
