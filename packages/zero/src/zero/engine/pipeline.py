"""The pipeline engine: DeepSpeed's ``PipelineEngine`` over zero's engine, one stage per rank.

Each rank's :class:`~zero.engine.Engine` holds its stage's layers, and ZeRO (stages 0-2; DeepSpeed refuses 2)
shards and averages over that stage's data-parallel group; zero_parallel's
:class:`~zero_parallel.pipe.StageExecutor` runs DeepSpeed's 1F1B schedule on it, this engine supplying backward,
tied-gradient reduction and the optimizer step. The gradient norm for clipping is taken over every stage and
replica.

Mirrored from DeepSpeed 0.19.8's ``PipelineEngine``: ``train_batch`` pulls ``gradient_accumulation_steps()``
micro-batches ``(inputs, labels)`` from the data iterator on the first and last stages, the last stage's loss is
divided by the micro-batch count in backward (gradients are the mean over the batch), and the returned loss is
the mean of the micro-batch losses, averaged over the data-parallel replicas and broadcast to every stage;
``eval_batch`` runs the inference schedule and returns the same mean of the losses (or, with
``compute_loss=False``, of the last stage's outputs). ``forward``/``backward``/``step`` raise
``PipelineError`` as DeepSpeed's do.
Checkpoints: each stage's replicas save and load the stage's checkpoint in zero's format under
``save_dir/pipe_stage_<ss>/`` (a resume is bitwise); ``save_dir/pipeline.json`` records the stages and partition;
a load at another pipeline degree takes each parameter (weights and optimizer state) from the stage that held it.
Beyond DeepSpeed, ``pipeline.schedule: "zero_bubble"`` runs zero_parallel's ZB-H1 schedule (backward split into
input- and weight-gradient passes: the stage's ``nn.Linear`` weight gradients are deferred to the weight pass),
whose gradients are 1F1B's up to rounding, and ``pipeline.schedule: "eager_1f1b"`` a 1F1B with twice DeepSpeed's
warm-up forwards whose activations are sent as each forward ends (zero_parallel's interleaved order with one
chunk): a stage slower than the next does not wait for the first and last gradients (more activations held on
the early stages), the gradients are 1F1B's.
Differences: the micro-batches of a batch are taken before it runs, so an iterator that runs out mid-batch raises
ValueError on every rank (DeepSpeed raises StopIteration on the loading ranks and the others wait); the returned
losses are 0-dim fp32 tensors on every stage; the clipping norm is over every stage's gradients at ZeRO stage 0 too
(DeepSpeed's stage-0 pipeline counts only the first stage's there, its ZeRO-1 path every stage's).
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from zero.config import NotSupportedError
from zero.engine.checkpoint_calls import agreed_tag, checked_save_dir
from zero.engine.compiled import torch_backend
from zero.engine.engine import Engine
from zero.engine.param_access import safe_get_full_grad, safe_set_full_grad
from zero.engine.pipeline_reshard import PIPELINE_RECORD, load_resharded, read_record, stage_dir
from zero_comm import same_outcome
from zero_parallel.pipe import (
    InferenceSchedule,
    InterleavedInferenceSchedule,
    InterleavedTrainSchedule,
    PipelineError,
    PipelineModule,
    PipelineParallelGrid,
    StageExecutor,
    TrainSchedule,
    WeightGradStore,
    ZeroBubbleTrainSchedule,
)


class PipelineEngine(Engine):
    """DeepSpeed's ``PipelineEngine``: ``train_batch`` / ``eval_batch`` over the stages of a
    :class:`~zero_parallel.pipe.PipelineModule` (built by ``initialize``; see the module notes).

    Attributes: ``grid`` (the :class:`~zero_parallel.pipe.PipelineParallelGrid`), ``stage_id``, ``num_stages``,
    ``micro_batches`` (= ``gradient_accumulation_steps()``), ``micro_batch_size``, ``is_pipe_parallel``,
    ``is_data_parallel``, ``data_iterator``.
    """

    pipeline_parallelism = True  # DeepSpeed's engine flag: a PipelineModule is trained

    def __init__(self, built, config, lr_scheduler=None, training_dataloader=None, schedule: str = "1f1b",
                 frozen_left_out=()) -> None:  # fmt: skip
        super().__init__(built, config, lr_scheduler=lr_scheduler, training_dataloader=training_dataloader,
                         frozen_left_out=frozen_left_out)  # fmt: skip
        self.schedule = schedule  # "1f1b", "eager_1f1b" or "zero_bubble" (ZB-H1); virtual stages: interleaved
        module: PipelineModule = built.runtime.module
        grid: PipelineParallelGrid = module.mpu()
        self.pipeline_module = module
        self.grid = grid
        self.stage_id = grid.get_stage_id()
        self.num_stages = grid.get_pipe_parallel_world_size()
        self.micro_batches = self.gradient_accumulation_steps()
        self.micro_batch_size = self.train_micro_batch_size_per_gpu()
        self.is_pipe_parallel = self.num_stages > 1
        self.is_data_parallel = grid.get_data_parallel_world_size() > 1
        self.data_iterator = None
        self.batch_fn = None  # set_batch_fn: applied to each micro-batch after it is taken
        self.agg_train_loss: torch.Tensor | None = None  # the last train_batch's returned loss
        self.dp_group_loss: torch.Tensor | None = None  # the last train_batch's loss before the replica average
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        self.virtual_stages = module.virtual_stages
        weight_grads = None
        if schedule == "zero_bubble":  # the split backward defers the stage's Linear weight gradients
            weight_grads = WeightGradStore()
            weight_grads.install(module)
        self.executor = StageExecutor(super().forward, module.loss_fn, self.stage_id, self.num_stages,
                                      grid.get_pipe_parallel_group(), device, self.virtual_stages,
                                      weight_grads)  # fmt: skip
        self._stage = _StageTraining(self)
        if config.torch_compile.enabled:  # per layer, as engine.compile(); initialize refused what does not compose
            module.compile(backend=torch_backend(config.torch_compile.backend, module))
            self._forward = module
        if training_dataloader is not None:
            self.set_dataloader(training_dataloader)

    # --- stage position and data ----------------------------------------------------------------------------
    def is_first_stage(self) -> bool:
        """True on stage 0 (it loads the micro-batches' inputs)."""
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        """True on the last stage (it loads the labels and computes the loss)."""
        return self.stage_id == self.num_stages - 1

    def get_pipeline_parallel_rank(self) -> int:
        """This rank's stage."""
        return self.stage_id

    def set_dataiterator(self, iterator) -> None:
        """Use ``iterator`` for the following batches (first and last stages; ignored on the others)."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = None
            self.data_iterator = iterator

    def set_dataloader(self, loader) -> None:
        """Take batches from ``iter(loader)`` (first and last stages)."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = loader
            self.data_iterator = iter(loader)

    def set_batch_fn(self, fn) -> None:
        """Apply ``fn`` to each micro-batch after it is taken from the iterator."""
        self.batch_fn = fn

    def _take(self, count: int, what: str) -> list:
        """``count`` micro-batches from the iterator on loading stages; every rank agrees on the outcome, so an
        iterator that is missing, runs out or gives something other than ``(inputs, labels)`` pairs raises
        ValueError on every rank."""
        batches: list = []
        with same_outcome(what):
            if self.is_first_stage() or self.is_last_stage():
                if self.data_iterator is None:
                    raise ValueError(f"{what}: no data iterator on stage {self.stage_id} (global rank "
                                     f"{self.global_rank}); pass one or call set_dataiterator()")  # fmt: skip
                for i in range(count):
                    try:
                        batch = next(self.data_iterator)
                    except StopIteration:
                        raise ValueError(
                            f"{what}: the data iterator ran out after {i} of the {count} micro-batches of this "
                            f"batch on stage {self.stage_id} (global rank {self.global_rank}); each batch takes "
                            f"{count} micro-batches (gradient_accumulation_steps): give more data, or an iterator "
                            "that restarts at its end"
                        ) from None
                    batch = self.batch_fn(batch) if self.batch_fn is not None else batch
                    if not (isinstance(batch, tuple | list) and len(batch) == 2):
                        raise ValueError(f"{what}: micro-batch {i} on stage {self.stage_id} is a "
                                         f"{type(batch).__name__}, not an (inputs, labels) pair: the first stage "
                                         "feeds the inputs to its layers, the last gives the labels to "
                                         "loss_fn")  # fmt: skip
                    batches.append(batch)
        return batches

    # --- training ---------------------------------------------------------------------------------------------
    def train_batch(self, data_iter=None) -> torch.Tensor:
        """Train on the next ``gradient_accumulation_steps()`` micro-batches and step the optimizer once.

        Returns:
            The mean of the micro-batch losses averaged over the data-parallel replicas (0-dim fp32), the same on
            every stage.

        Raises:
            RuntimeError: gradients are disabled (use :meth:`eval_batch`).
            ValueError: the iterator is missing or runs out mid-batch (on every rank).
        """
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        batches = self._take(self.micro_batches, "train_batch")
        if self.virtual_stages > 1 or self.schedule == "eager_1f1b":
            schedule = InterleavedTrainSchedule(self.micro_batches, self.num_stages, self.stage_id, self.virtual_stages)
        elif self.schedule == "zero_bubble":
            schedule = ZeroBubbleTrainSchedule(self.micro_batches, self.num_stages, self.stage_id)
        else:
            schedule = TrainSchedule(self.micro_batches, self.num_stages, self.stage_id)
        self.executor.run(schedule, batches, self._stage, compute_loss=True)
        with torch.no_grad():
            local = self._mean(self.executor.losses, self.micro_batches, "train_batch") if self.is_last_stage() \
                else None  # fmt: skip
            self.dp_group_loss, self.agg_train_loss = self._share_from_last_stage(local)
        return self.agg_train_loss

    def eval_batch(self, data_iter, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None):  # fmt: skip
        """Run the inference schedule on the next micro-batches of ``data_iter`` without gradients.

        Args:
            data_iter: the iterator (the training iterator is restored afterwards).
            return_logits: also return the last stage's outputs of the last micro-batch (None on other stages).
            compute_loss: apply ``loss_fn``; False: reduce the last stage's outputs instead.
            reduce_output: "avg" (the mean over micro-batches and replicas) or None (the list of per-micro-batch
                results, last stage only).
            bcast_loss: send the averaged result to every stage (with ``compute_loss``).
            num_micro_batches: micro-batches to run; default ``gradient_accumulation_steps()``.

        Returns:
            The result, or ``(result, outputs)`` with ``return_logits``.

        Raises:
            ValueError: an unknown ``reduce_output``; the iterator runs out (on every rank).
        """
        if reduce_output not in (None, "avg"):
            raise ValueError(f"eval_batch: reduce_output must be 'avg' or None, got {reduce_output!r}")
        micro_batches = self.micro_batches if num_micro_batches is None else num_micro_batches
        self.module.eval()
        saved = self.data_iterator
        self.set_dataiterator(data_iter)
        try:
            batches = self._take(micro_batches, "eval_batch")
            with torch.no_grad():
                if self.virtual_stages > 1:
                    schedule = InterleavedInferenceSchedule(micro_batches, self.num_stages, self.stage_id,
                                                            self.virtual_stages)  # fmt: skip
                else:
                    schedule = InferenceSchedule(micro_batches, self.num_stages, self.stage_id)
                self.executor.run(schedule, batches, None, compute_loss=compute_loss)
                result = None
                if self.is_last_stage():
                    results = self.executor.losses
                    result = self._mean(results, micro_batches, "eval_batch") if reduce_output else results
                if compute_loss and bcast_loss and reduce_output:
                    result = self._share_from_last_stage(result)[1]
        finally:
            self.set_dataiterator(saved)
        if return_logits:
            return result, self.executor.last_outputs
        return result

    def _mean(self, values: list, count: int, what: str) -> torch.Tensor:
        """The sum of ``values`` / ``count``, averaged over the data-parallel replicas (DeepSpeed's order)."""
        if not values or not isinstance(values[0], torch.Tensor):
            raise TypeError(f"{what}: the last stage's loss must be a tensor, got {type(values[0]).__name__}")
        total = torch.zeros_like(values[0])
        for v in values:
            total += v
        total = total / count
        if self.is_data_parallel:
            total = total.clone()
            dist.all_reduce(total, group=self.grid.get_data_parallel_group())
            total /= self.grid.get_data_parallel_world_size()
        return total

    def _share_from_last_stage(self, local: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(this replica's loss, the replicas' mean) from the last stage's ``local`` (its replica-averaged mean)
        to every stage of the pipeline, as fp32; the first is the pre-average loss on the last stage only."""
        if self.is_last_stage():
            pair = torch.stack([local.detach().float().reshape(()), local.detach().float().reshape(())])
            pair = pair.to(self.executor.device)
        else:
            pair = torch.zeros(2, dtype=torch.float32, device=self.executor.device)
        if self.is_pipe_parallel:
            src = self.grid.stage_to_global(self.num_stages - 1)
            dist.broadcast(pair, src=src, group=self.grid.get_pipe_parallel_group())
        return pair[0].cpu(), pair[1].cpu()

    # --- DeepSpeed's refusals -----------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        """Raises PipelineError: a pipeline engine runs whole batches (DeepSpeed's)."""
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    __call__ = forward

    def backward(self, *args, **kwargs):
        """Raises PipelineError: a pipeline engine runs whole batches (DeepSpeed's)."""
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def step(self, *args, **kwargs):
        """Raises PipelineError: a pipeline engine runs whole batches (DeepSpeed's)."""
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def compile(
        self,
        backend: str = "inductor",
        compile_kwargs: dict | None = None,
        schedule=None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """``torch.compile`` the stage's layers one by one (DeepSpeed's ``PipelineEngine.compile``, through
        :meth:`zero_parallel.pipe.PipelineModule.compile`; ``backend`` and ``compile_kwargs`` as torch.compile's).
        The executor's per-micro-batch forward and backward, the p2p transfers, tied layers and activation
        checkpointing run around the compiled layers unchanged. A second call, or one after the config's
        ``torch_compile.enabled`` compiled them, does nothing.

        Raises:
            NotSupportedError: ``pipeline.schedule: "zero_bubble"`` (its split backward reroutes each ``nn.Linear``
                through an autograd function that defers the weight gradient, which compiled layers would not
                call); stages split over a ``model`` axis (tensor parallelism: its collectives are not compiled
                here); ``schedule`` or ``compiled_autograd_enabled`` (as ``Engine.compile``).
        """
        refusal = compile_refusal(self.schedule, self.grid.get_slice_parallel_world_size())
        if refusal is not None:
            raise NotSupportedError(f"engine.compile() {refusal}")
        super().compile(backend, compile_kwargs, schedule, compiled_autograd_enabled)

    def save_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:  # fmt: skip
        """Collective over every rank: each stage's replicas write the stage's checkpoint (zero's format, as
        ``Engine.save_checkpoint``) to ``save_dir/pipe_stage_<ss>/<tag>/``, and global rank 0 records the pipeline
        (stages, partition) in ``save_dir/pipeline.json`` and, once every stage saved, the tag in ``save_dir/latest``
        (``save_latest``). Returns True, as DeepSpeed's.

        Raises:
            NotSupportedError: ``checkpoint.format`` is not zero's own (DeepSpeed's layouts hold no pipeline stages
                here yet).
        """
        self._check_format("save_checkpoint")
        save_dir = checked_save_dir(save_dir)
        tag = agreed_tag(tag or f"global_step{self.global_steps}", self.config.checkpoint.tag_validation,
                         dist.group.WORLD)  # fmt: skip
        with same_outcome("save_checkpoint"):
            if dist.get_rank() == 0:
                os.makedirs(save_dir, exist_ok=True)
                with open(os.path.join(save_dir, PIPELINE_RECORD), "w") as f:
                    json.dump(self._pipeline_record(), f)
        Engine.save_checkpoint(self, self._stage_dir(save_dir), tag, client_state, save_latest,
                               exclude_frozen_parameters)  # fmt: skip
        with same_outcome("save_checkpoint"):  # every stage saved: point save_dir/latest at the tag
            if save_latest and dist.get_rank() == 0:
                tmp = os.path.join(save_dir, ".latest.tmp")
                with open(tmp, "w") as f:
                    f.write(tag)
                os.replace(tmp, os.path.join(save_dir, "latest"))
        return True

    def save_checkpoint_if_due(self, save_dir: str | os.PathLike, interval, client_state: dict | None = None):
        """Collective over every rank: save (as :meth:`save_checkpoint`) when ``interval`` (a
        ``CheckpointInterval``) says so, every stage agreeing; returns the tag or None."""
        if not interval.due(self.global_steps, dist.get_rank(), dist.group.WORLD):
            return None
        tag = f"global_step{self.global_steps}"
        self.save_checkpoint(save_dir, tag=tag, client_state=client_state)
        interval.saved()
        return tag

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: str | None = None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        load_module_strict: bool = True):  # fmt: skip
        """Load a pipeline checkpoint (``Engine.load_checkpoint``'s arguments and return value).

        Saved with this pipeline's stages and partition: each stage loads ``load_dir/pipe_stage_<ss>/`` (bitwise).
        Saved at another pipeline degree, partition or virtual-stage count of the same layers (1 stage included):
        each stage takes its parameters by name from whichever saved stage held them, master weights and optimizer
        state whole (:mod:`zero.engine.pipeline_reshard`), with the client and engine state of saved stage 0; the
        RNG states are not restored. A failure on one stage raises on every rank.

        Raises:
            ValueError: ``load_dir`` has no ``pipeline.json`` (on every rank).
            zero_core's LayoutMismatchError: a parameter no saved stage holds (other layers).
        """
        self._check_format("load_checkpoint")
        with same_outcome("load_checkpoint"):
            saved = read_record(load_dir)
            if saved is None:
                raise ValueError(f"load_checkpoint: {os.path.join(os.fspath(load_dir), PIPELINE_RECORD)} is "
                                 f"missing: {load_dir} is not a pipeline checkpoint (PipelineEngine.save_checkpoint "
                                 "writes it)")  # fmt: skip
        if saved == self._pipeline_record():
            return Engine.load_checkpoint(self, self._stage_dir(load_dir), tag, load_optimizer_states,
                                          load_lr_scheduler_states, load_module_only, load_module_strict)  # fmt: skip
        return load_resharded(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states, load_module_only)

    def _stage_dir(self, root) -> str:
        return str(stage_dir(root, self.stage_id))

    def _pipeline_record(self) -> dict:
        return {"stages": self.num_stages, "virtual_stages": self.virtual_stages,
                "parts": [int(p) for p in self.pipeline_module.parts]}  # fmt: skip

    def _check_format(self, what: str) -> None:
        if self.grid.get_slice_parallel_world_size() > 1:
            raise NotSupportedError(f"{what} with a PipelineModule whose stages are split over a 'model' axis "
                                    "(tensor parallelism) is not supported yet: each stage's tensor-parallel "
                                    "ranks would write one folder")  # fmt: skip
        fmt = self.config.checkpoint.format
        if fmt != "zero":
            raise NotSupportedError(f"config key 'checkpoint.format': {fmt!r} with a PipelineModule; {what} "
                                    "writes and reads zero's format per stage only: leave checkpoint.format as "
                                    "'zero'")  # fmt: skip


def compile_refusal(schedule: str, model_axis: int) -> str | None:
    """Why a pipeline engine with ``schedule`` and stages split over ``model_axis`` tensor-parallel ranks cannot
    compile its layers (the end of a sentence starting with what asked for it), or None when it can."""
    if schedule == "zero_bubble":
        return ("with pipeline.schedule 'zero_bubble' is not supported: its split backward defers each nn.Linear's "
                "weight gradient through an autograd function the compiled layers would not call; use the '1f1b' "
                "schedule to compile, or leave the layers eager")  # fmt: skip
    if model_axis > 1:
        return (f"with stages split over a 'model' axis of {model_axis} ranks (tensor parallelism) is not supported "
                "yet: the split layers' collectives are not compiled here; leave the layers eager")  # fmt: skip
    return None


class _StageTraining:
    """The engine's side of a training schedule (zero_parallel's ``StageTraining``): backward through the
    stage's ZeRO runtime, tied gradients summed over their stages, one optimizer step per batch."""

    __slots__ = ("engine",)

    def __init__(self, engine: PipelineEngine) -> None:
        self.engine = engine

    def backward_loss(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        """The last stage's loss, divided by the micro-batch count as ``Engine.backward`` does."""
        e = self.engine
        e.set_gradient_accumulation_boundary(last_micro_batch)
        try:
            Engine.backward(e, loss)
        finally:
            e.set_gradient_accumulation_boundary(None)

    def backward_outputs(self, outputs: list[torch.Tensor], grads: list[torch.Tensor], last_micro_batch: bool) -> None:
        """``sum(output * grad)``'s backward gives each output exactly ``grad`` as its gradient (already divided
        by the micro-batch count and, with ``gradient_allreduce_op: "sum"``, times the data-parallel world size on
        the last stage: the surrogate is divided by that size, which ``Engine.backward`` multiplies back, so the
        factor is applied once, as one process summing the replicas' gradients gets it)."""
        if not outputs:
            return
        e = self.engine
        surrogate = sum((o * g).sum() for o, g in zip(outputs, grads, strict=True))
        if e.config.gradient_allreduce_op == "sum":
            surrogate = surrogate / e.world_size
        e.set_gradient_accumulation_boundary(last_micro_batch)
        try:
            Engine.backward(e, surrogate, scale_wrt_gas=False)
        finally:
            e.set_gradient_accumulation_boundary(None)

    def reduce_tied_grads(self) -> None:
        """Sum each tied weight's (replica-averaged) gradient over the stages holding it."""
        for weight, group in self.engine.pipeline_module.tied_weights():
            grad = safe_get_full_grad(weight)
            dist.all_reduce(grad, group=group)
            safe_set_full_grad(weight, grad)

    def reduce_grads(self) -> None:
        """Nothing: the stage's runtime reduced over its data-parallel group in the last backward."""

    def optimizer_step(self) -> None:
        """One optimizer step (and LR scheduler step) for the batch."""
        e = self.engine
        e.set_gradient_accumulation_boundary(True)
        try:
            Engine.step(e)
        finally:
            e.set_gradient_accumulation_boundary(None)
