"""Running a stage's schedule: the instructions of :mod:`zero_parallel.pipe.schedule` carried out on one rank,
with activations and gradients exchanged with the neighbouring stages (:mod:`zero_parallel.pipe.transfer`).

The executor owns the buffer slots and the transfers; what backward, gradient reduction and the optimizer step do
is the caller's, declared by :class:`StageTraining` (the meta-package's pipeline engine wires ZeRO there).
Semantics mirrored from DeepSpeed's ``PipelineEngine``: a micro-batch is ``(inputs, labels)``; the first stage
uses its inputs, the last its labels; the last stage's loss is ``loss_fn(outputs, labels)`` (or the outputs when
there is no loss function or the loss is not wanted); floating-point activations received by a stage require
gradients, and each is sent back its gradient (zeros when it got none). A zero-bubble schedule's input pass
(:class:`~zero_parallel.pipe.zero_bubble.BackwardInputPass`) runs the caller's backward as 1F1B's does while a
:class:`~zero_parallel.pipe.weight_grad.WeightGradStore` captures: the stage's Linear layers queue their weight
work instead of doing it, so the pass gives the inputs' gradients and the other parameters'; the weight pass
(:class:`~zero_parallel.pipe.zero_bubble.BackwardWeightPass`) runs the queue through the caller's backward, so
the Linear weights' gradients reach the engine's gradient hooks there.
"""

from __future__ import annotations

from typing import Protocol

import torch

from zero_parallel.pipe import schedule as sched
from zero_parallel.pipe.transfer import as_tensors, recv_meta, recv_tensors, send_meta, send_tensors
from zero_parallel.pipe.weight_grad import WeightGradStore, weight_root
from zero_parallel.pipe.zero_bubble import BackwardInputPass, BackwardWeightPass, ZeroBubbleTrainSchedule


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

    __slots__ = ("micro", "inputs", "labels", "outputs", "loss", "grads", "weight_work")

    def __init__(self) -> None:
        self.micro = 0  # the micro-batch held (names its transfers' tags)
        self.inputs = None  # a tensor or a tuple: the loaded or received activations
        self.labels = None  # the last stage's labels
        self.outputs = None  # the stage's forward output
        self.loss = None  # the last stage's loss (a tensor, or what the last layer returned)
        self.grads: tuple[torch.Tensor, ...] = ()  # received gradients of the floating-point outputs
        self.weight_work: list = []  # a split backward's queued Linear weight work, for its weight pass


class StageExecutor:
    """Carries out a schedule's steps on this stage.

    Args:
        forward: runs the stage's layers on one micro-batch's inputs (the module, or an engine's forward).
        loss_fn: the last stage's ``loss_fn(outputs, labels)``, or None.
        stage_id, stages: this stage and the pipeline degree.
        group: the pipeline group (its ranks ordered by stage).
        device: where received tensors are allocated.
        virtual_stages: model chunks on each stage (interleaved schedules); with more than one, ``forward`` is
            called as ``forward(inputs, chunk=c)`` and activations go round the stages, the last stage's last
            chunk computing the loss.
        weight_grads: the store the stage's Linear layers were installed on (a zero-bubble schedule's split
            backward defers their weight gradients through it); None: a split backward defers nothing (its input
            pass is a full backward, its weight pass empty).
    """

    def __init__(self, forward, loss_fn, stage_id: int, stages: int, group, device: torch.device,
                 virtual_stages: int = 1, weight_grads: WeightGradStore | None = None) -> None:  # fmt: skip
        self.forward = forward
        self.loss_fn = loss_fn
        self.stage_id = stage_id
        self.stages = stages
        self.group = group
        self.device = torch.device(device)
        self.virtual_stages = virtual_stages
        self.weight_grads = weight_grads
        self._micro_batches = 1  # of the running batch (tags count micro-batches)
        self._counts: dict[tuple[str, int], int] = {}  # (what, chunk) -> how many so far this batch
        self._slots: list[_Slot] = []
        self._batches: list = []  # the micro-batches of the running batch, taken in LoadMicroBatch order
        self._training: StageTraining | None = None
        self._compute_loss = True
        self._sends: list = []  # handles of this run's async sends, waited at its end
        self._sent_meta: set[int] = set()  # chunks whose activation shapes this run sent on
        self._recv_meta: dict = {}  # chunk -> the received activation shapes of this run
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
        self._sends, self._sent_meta, self._recv_meta, self._backwards = [], set(), {}, 0
        self.losses, self.last_outputs = [], None
        self._micro_batches, self._counts = schedule.num_micro_batches, {}
        backwards = schedule.num_micro_batches * self.virtual_stages
        store = self.weight_grads
        if store is not None:
            store.deferring = training is not None and isinstance(schedule, ZeroBubbleTrainSchedule)
        try:
            for step in schedule:
                for cmd in step:
                    self._do(cmd, backwards)
            for handle in self._sends:
                handle.wait()
        finally:
            self._slots, self._batches, self._sends = [], [], []
            if store is not None:
                store.deferring = False
                store.take()

    def _do(self, cmd: sched.PipeInstruction, backwards: int) -> None:
        if isinstance(cmd, sched.BufferOpInstruction):
            slot, chunk = self._slots[cmd.buffer_id], cmd.chunk
            if isinstance(cmd, sched.LoadMicroBatch):
                self._load(slot, chunk)
            elif isinstance(cmd, sched.ForwardPass):
                self._forward(slot, chunk)
            elif isinstance(cmd, sched.BackwardPass):
                self._backwards += 1
                self._backward(slot, chunk, self._backwards == backwards)
            elif isinstance(cmd, BackwardInputPass):
                self._input_backward(slot, chunk)
            elif isinstance(cmd, BackwardWeightPass):
                self._backwards += 1
                self._weight_backward(slot, self._backwards == backwards)
            elif isinstance(cmd, sched.SendActivation):
                self._send_activations(slot, chunk)
            elif isinstance(cmd, sched.RecvActivation):
                self._recv_activations(slot, chunk)
            elif isinstance(cmd, sched.SendGrad):
                self._send_grads(slot, chunk)
            elif isinstance(cmd, sched.RecvGrad):
                self._recv_grads(slot, chunk)
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

    def _first(self, chunk: int) -> bool:
        """This chunk is the model's first (it loads the inputs)."""
        return self.stage_id == 0 and chunk == 0

    def _last(self, chunk: int) -> bool:
        """This chunk is the model's last (it loads the labels and computes the loss)."""
        return self.is_last_stage and chunk == self.virtual_stages - 1

    def _next(self, what: str, chunk: int) -> int:
        """How many ``what`` events ``chunk`` had before this one (events of a chunk come in micro-batch order)."""
        n = self._counts.get((what, chunk), 0)
        self._counts[(what, chunk)] = n + 1
        return n

    def _tag(self, kind: int, chunk: int, micro: int) -> int:
        """One tag per (chunk, micro-batch, kind): activations 0, gradients 1, shapes 2."""
        return (chunk * self._micro_batches + micro) * 3 + kind

    def _load(self, slot: _Slot, chunk: int) -> None:
        inputs, labels = self._batches.pop(0)
        slot.micro = self._next("load", chunk)
        if self._first(chunk):
            loaded = as_tensors(inputs, "the micro-batch's inputs", self.stage_id)
            loaded = tuple(t.detach().clone().to(self.device) for t in loaded)
            slot.inputs = loaded if isinstance(inputs, tuple | list) else loaded[0]
        if self._last(chunk):
            if isinstance(labels, torch.Tensor):
                labels = labels.to(self.device)
            elif isinstance(labels, tuple | list):
                labels = tuple(t.to(self.device) if isinstance(t, torch.Tensor) else t for t in labels)
            slot.labels = labels

    def _forward(self, slot: _Slot, chunk: int) -> None:
        outputs = self.forward(slot.inputs) if self.virtual_stages == 1 else self.forward(slot.inputs, chunk=chunk)
        slot.outputs = outputs
        if not self._last(chunk):
            return
        if self._compute_loss and self.loss_fn is not None:
            loss = self.loss_fn(outputs, slot.labels)
        else:
            loss = outputs
        slot.loss = loss
        self.last_outputs = outputs
        self.losses.append(loss.detach() if isinstance(loss, torch.Tensor) else [x.detach() for x in loss])

    def _backward(self, slot: _Slot, chunk: int, last: bool) -> None:
        if self._last(chunk):
            self._training.backward_loss(slot.loss, last)
        else:
            outs = as_tensors(slot.outputs, "the outputs", self.stage_id)
            floating = [(o, g) for o, g in zip([o for o in outs if o.is_floating_point()], slot.grads, strict=True)
                        if o.requires_grad]  # fmt: skip
            self._training.backward_outputs([o for o, _ in floating], [g for _, g in floating], last)
        slot.outputs, slot.loss, slot.grads = None, None, ()

    def _input_backward(self, slot: _Slot, chunk: int) -> None:
        """The caller's backward with the Linear weight work queued (never the accumulation boundary: the last
        weight pass is): the inputs' gradients land in their ``.grad`` for :meth:`_send_grads`."""
        store = self.weight_grads
        if store is None:
            self._backward(slot, chunk, False)
            return
        store.start()
        self._backward(slot, chunk, False)
        slot.weight_work = store.take()

    def _weight_backward(self, slot: _Slot, last: bool) -> None:
        """The slot's queued weight work through the caller's backward (``last``: the batch's last backward)."""
        work, slot.weight_work = slot.weight_work, []
        root = weight_root(work)
        if root is not None:
            self._training.backward_outputs([root], [torch.ones_like(root)], last)

    def _send_activations(self, slot: _Slot, chunk: int) -> None:
        outs = as_tensors(slot.outputs, "the outputs", self.stage_id)
        peer = (self.stage_id + 1) % self.stages
        if chunk not in self._sent_meta:  # shapes once per chunk and batch
            self._sends += send_meta(outs, peer, self.group, self.stage_id, self._tag(2, chunk, 0), self.device)
            self._sent_meta.add(chunk)
        self._sends += send_tensors(outs, peer, self.group, self._tag(0, chunk, slot.micro))
        if self._training is None:
            slot.outputs = None  # forward only: nothing comes back for it

    def _recv_activations(self, slot: _Slot, chunk: int) -> None:
        # the previous virtual stage: chunk - 1 of the last stage when this is stage 0
        peer, sender = (self.stage_id - 1) % self.stages, chunk if self.stage_id else chunk - 1
        if chunk not in self._recv_meta:
            self._recv_meta[chunk] = recv_meta(peer, self.group, self._tag(2, sender, 0), self.device)
        slot.micro = self._next("recv_act", chunk)
        got = recv_tensors(self._recv_meta[chunk], peer, self.group, self.device, self._tag(0, sender, slot.micro))
        if self._training is not None:
            for t in got:
                t.requires_grad_(t.is_floating_point())
        slot.inputs = got[0] if len(got) == 1 else got

    def _send_grads(self, slot: _Slot, chunk: int) -> None:
        inputs = slot.inputs if isinstance(slot.inputs, tuple) else (slot.inputs,)
        grads = tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs
                      if t.is_floating_point())  # fmt: skip
        self._sends += send_tensors(grads, (self.stage_id - 1) % self.stages, self.group,
                                    self._tag(1, chunk, slot.micro))  # fmt: skip
        slot.inputs = None

    def _recv_grads(self, slot: _Slot, chunk: int) -> None:
        outs = as_tensors(slot.outputs, "the outputs", self.stage_id)
        meta = [(o.dtype, tuple(o.shape)) for o in outs if o.is_floating_point()]
        # the next virtual stage: chunk + 1 of stage 0 when this is the last stage
        peer, sender = (self.stage_id + 1) % self.stages, chunk if self.stage_id + 1 < self.stages else chunk + 1
        slot.grads = recv_tensors(meta, peer, self.group, self.device, self._tag(1, sender, slot.micro))
