"""Running a stage's schedule: the instructions of :mod:`zero_parallel.pipe.schedule` carried out on one rank,
with activations and gradients exchanged with the neighbouring stages (:mod:`zero_parallel.pipe.transfer`).

The executor owns the buffer slots and the transfers; what backward, gradient reduction and the optimizer step do
is the caller's, declared by :class:`StageTraining` (the meta-package's pipeline engine wires ZeRO there).
Semantics mirrored from DeepSpeed's ``PipelineEngine``: a micro-batch is ``(inputs, labels)``; the first stage
uses its inputs, the last its labels; the last stage's loss is ``loss_fn(outputs, labels)`` (or the outputs when
there is no loss function or the loss is not wanted); floating-point activations received by a stage require
gradients, and each is sent back its gradient (zeros when it got none).
"""

from __future__ import annotations

from typing import Protocol

import torch

from zero_parallel.pipe import schedule as sched
from zero_parallel.pipe.transfer import as_tensors, recv_meta, recv_tensors, send_meta, send_tensors


class StageTraining(Protocol):
    """What a training schedule needs from the engine around the stage."""

    def backward_loss(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        """Last stage: backward of one micro-batch's loss (scaled as the engine's ``backward`` scales it)."""

    def backward_outputs(self, outputs: list[torch.Tensor], grads: list[torch.Tensor], last_micro_batch: bool) -> None:
        """Other stages: backward of ``outputs`` with the gradients the next stage sent (already scaled)."""

    def reduce_tied_grads(self) -> None:
        """Sum tied weights' gradients over the stages holding them."""

    def reduce_grads(self) -> None:
        """Reduce gradients over the stage's data-parallel group (where the engine has not already)."""

    def optimizer_step(self) -> None:
        """Step the optimizer and zero the gradients."""


class _Slot:
    """One buffer slot: a micro-batch's tensors on this stage, from its load or receive to its backward."""

    __slots__ = ("inputs", "labels", "outputs", "loss", "grads")

    def __init__(self) -> None:
        self.inputs = None  # a tensor or a tuple: the loaded or received activations
        self.labels = None  # the last stage's labels
        self.outputs = None  # the stage's forward output
        self.loss = None  # the last stage's loss (a tensor, or what the last layer returned)
        self.grads: tuple[torch.Tensor, ...] = ()  # received gradients of the floating-point outputs


class StageExecutor:
    """Carries out a schedule's steps on this stage.

    Args:
        forward: runs the stage's layers on one micro-batch's inputs (the module, or an engine's forward).
        loss_fn: the last stage's ``loss_fn(outputs, labels)``, or None.
        stage_id, stages: this stage and the pipeline degree.
        group: the pipeline group (its ranks ordered by stage).
        device: where received tensors are allocated.
    """

    def __init__(self, forward, loss_fn, stage_id: int, stages: int, group, device: torch.device) -> None:
        self.forward = forward
        self.loss_fn = loss_fn
        self.stage_id = stage_id
        self.stages = stages
        self.group = group
        self.device = torch.device(device)
        self._slots: list[_Slot] = []
        self._batches: list = []  # the micro-batches of the running batch, taken in LoadMicroBatch order
        self._training: StageTraining | None = None
        self._compute_loss = True
        self._sends: list = []  # handles of this run's async sends, waited at its end
        self._sent_meta = False  # this run sent its activations' metadata to the next stage
        self._recv_meta = None  # this run's received activation metadata
        self._backwards = 0
        self.losses: list = []  # the last stage's loss per micro-batch, in order (detached)
        self.last_outputs = None  # the last stage's outputs of the last micro-batch run

    @property
    def is_first_stage(self) -> bool:
        """True for stage 0."""
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        """True for the last stage."""
        return self.stage_id == self.stages - 1

    def run(self, schedule: sched.PipeSchedule, batches: list, training: StageTraining | None,
            compute_loss: bool = True) -> None:  # fmt: skip
        """Carry out every step of ``schedule``.

        Args:
            schedule: this stage's schedule.
            batches: the micro-batches ``(inputs, labels)`` this stage loads, in order (empty on middle stages).
            training: the engine's backward/reduce/step, or None for a forward-only schedule.
            compute_loss: the last stage applies ``loss_fn`` (False: its outputs are the result).

        Afterwards :attr:`losses` holds the last stage's per-micro-batch losses and :attr:`last_outputs` its
        last outputs.
        """
        self._slots = [_Slot() for _ in range(schedule.num_pipe_buffers())]
        self._batches = list(batches)
        self._training = training
        self._compute_loss = compute_loss
        self._sends, self._sent_meta, self._recv_meta, self._backwards = [], False, None, 0
        self.losses, self.last_outputs = [], None
        micro_batches = schedule.num_micro_batches
        try:
            for step in schedule:
                for cmd in step:
                    self._do(cmd, micro_batches)
            for handle in self._sends:
                handle.wait()
        finally:
            self._slots, self._batches, self._sends = [], [], []

    def _do(self, cmd: sched.PipeInstruction, micro_batches: int) -> None:
        if isinstance(cmd, sched.BufferOpInstruction):
            slot = self._slots[cmd.buffer_id]
            if isinstance(cmd, sched.LoadMicroBatch):
                self._load(slot)
            elif isinstance(cmd, sched.ForwardPass):
                self._forward(slot)
            elif isinstance(cmd, sched.BackwardPass):
                self._backwards += 1
                self._backward(slot, self._backwards == micro_batches)
            elif isinstance(cmd, sched.SendActivation):
                self._send_activations(slot)
            elif isinstance(cmd, sched.RecvActivation):
                self._recv_activations(slot)
            elif isinstance(cmd, sched.SendGrad):
                self._send_grads(slot)
            elif isinstance(cmd, sched.RecvGrad):
                self._recv_grads(slot)
            else:
                raise TypeError(f"pipeline stage {self.stage_id}: unknown instruction {cmd!r}")
        elif isinstance(cmd, sched.ReduceTiedGrads):
            self._training.reduce_tied_grads()
        elif isinstance(cmd, sched.ReduceGrads):
            self._training.reduce_grads()
        elif isinstance(cmd, sched.OptimizerStep):
            self._training.optimizer_step()
        else:
            raise TypeError(f"pipeline stage {self.stage_id}: unknown instruction {cmd!r}")

    def _load(self, slot: _Slot) -> None:
        inputs, labels = self._batches.pop(0)
        if self.is_first_stage:
            loaded = as_tensors(inputs, "the micro-batch's inputs", self.stage_id)
            loaded = tuple(t.detach().clone().to(self.device) for t in loaded)
            slot.inputs = loaded if isinstance(inputs, tuple | list) else loaded[0]
        if self.is_last_stage:
            if isinstance(labels, torch.Tensor):
                labels = labels.to(self.device)
            elif isinstance(labels, tuple | list):
                labels = tuple(t.to(self.device) if isinstance(t, torch.Tensor) else t for t in labels)
            slot.labels = labels

    def _forward(self, slot: _Slot) -> None:
        outputs = self.forward(slot.inputs)
        slot.outputs = outputs
        if not self.is_last_stage:
            return
        if self._compute_loss and self.loss_fn is not None:
            loss = self.loss_fn(outputs, slot.labels)
        else:
            loss = outputs
        slot.loss = loss
        self.last_outputs = outputs
        self.losses.append(loss.detach() if isinstance(loss, torch.Tensor) else [x.detach() for x in loss])

    def _backward(self, slot: _Slot, last: bool) -> None:
        if self.is_last_stage:
            self._training.backward_loss(slot.loss, last)
        else:
            outs = as_tensors(slot.outputs, "the outputs", self.stage_id)
            floating = [(o, g) for o, g in zip([o for o in outs if o.is_floating_point()], slot.grads, strict=True)
                        if o.requires_grad]  # fmt: skip
            self._training.backward_outputs([o for o, _ in floating], [g for _, g in floating], last)
        slot.outputs, slot.loss, slot.grads = None, None, ()

    def _send_activations(self, slot: _Slot) -> None:
        outs = as_tensors(slot.outputs, "the outputs", self.stage_id)
        if not self._sent_meta:
            self._sends += send_meta(outs, self.stage_id + 1, self.group, self.stage_id)
            self._sent_meta = True
        self._sends += send_tensors(outs, self.stage_id + 1, self.group)
        if self._training is None:
            slot.outputs = None  # forward only: nothing comes back for it

    def _recv_activations(self, slot: _Slot) -> None:
        if self._recv_meta is None:
            self._recv_meta = recv_meta(self.stage_id - 1, self.group)
        got = recv_tensors(self._recv_meta, self.stage_id - 1, self.group, self.device)
        if self._training is not None:
            for t in got:
                t.requires_grad_(t.is_floating_point())
        slot.inputs = got[0] if len(got) == 1 else got

    def _send_grads(self, slot: _Slot) -> None:
        inputs = slot.inputs if isinstance(slot.inputs, tuple) else (slot.inputs,)
        grads = tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs if t.is_floating_point())
        self._sends += send_tensors(grads, self.stage_id - 1, self.group)
        slot.inputs = None

    def _recv_grads(self, slot: _Slot) -> None:
        outs = as_tensors(slot.outputs, "the outputs", self.stage_id)
        meta = [(o.dtype, tuple(o.shape)) for o in outs if o.is_floating_point()]
        slot.grads = recv_tensors(meta, self.stage_id + 1, self.group, self.device)
