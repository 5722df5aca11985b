"""The Engine: DeepSpeed's training-loop surface over a zero_core runtime. It composes; it owns no sharding."""

from __future__ import annotations

import json
import os

import torch

from zero.config import EngineConfig
from zero.distributed import rank_world
from zero.engine.autocast import AutocastMixin
from zero.engine.autotune_probe import AutotuneProbe
from zero.engine.checkpoint_calls import agreed_tag, checked_save_dir, latest_is_missing, universal_tag
from zero.engine.compiled import forward_callable
from zero.engine.config_getters import ConfigGettersMixin
from zero.engine.deepspeed_api import DeepSpeedEngineMixin
from zero.engine.direct_backward import guard_outputs
from zero.engine.expert_parallel import ExpertParallel
from zero.engine.lifecycle import LifecycleMixin
from zero.engine.loss_scale import EngineLossScaleMixin, expose_loss_scale
from zero.engine.monitoring import MonitorMixin
from zero.engine.observe import Observer
from zero.engine.offload_states import OffloadStatesMixin, StateOffload
from zero.engine.optimizer_names import expose_offload
from zero.engine.param_offload_view import attach_parameter_offload
from zero.engine.pipeline_reshard import load_resharded, read_record
from zero.engine.precision import cast_inputs
from zero.engine.qk_clip_step import EngineQKClip
from zero.engine.resume import ResumeMixin
from zero.engine.runtime_protocol import BuiltRuntime, EngineRuntime, RuntimeCheckpoints
from zero.engine.surface import EngineSurfaceMixin
from zero.engine.tensor_parallel import gather_full_state
from zero.optim.trainable import check_still_frozen
from zero_parallel import layout_of


class Engine(
    LifecycleMixin,
    DeepSpeedEngineMixin,
    EngineLossScaleMixin,
    ResumeMixin,
    MonitorMixin,
    AutocastMixin,
    OffloadStatesMixin,
    EngineSurfaceMixin,
    ConfigGettersMixin,
):
    """Forward, backward, step and checkpoints with DeepSpeed's semantics.

    * ``backward(loss)`` divides the loss by ``gradient_accumulation_steps`` (DeepSpeed's ``scale_wrt_gas``) so the
      accumulated gradient is the mean over the global batch.
    * ``step()`` is called after every micro-batch; it steps the optimizer only at the gradient accumulation
      boundary (every ``gradient_accumulation_steps``-th call), then steps the LR scheduler unless the step was
      skipped for non-finite gradients, and zeroes the gradients.
    * ``global_steps`` counts optimizer boundaries (skipped ones included, as DeepSpeed); ``skipped_steps`` the
      skipped ones.
    * The rest of DeepSpeed's engine names: ``EngineSurfaceMixin`` and ``ConfigGettersMixin``; a name zero lacks
      raises NotSupportedError naming what to use, any other unknown name is the wrapped module's.

    Args:
        built: the runtime (``EngineRuntime``: zero_core's ``ZeroRuntime`` or the 1-bit optimizers'
            ``CompressedRuntime``), its checkpoint format and DeepCompile's forward, from ``build_engine_runtime``.
        config: the validated :class:`~zero.config.EngineConfig` (batch sizes resolved).
        lr_scheduler: stepped once per optimizer step, or None.
        training_dataloader: the loader built from ``training_data``, or None.
        mpu: the sequence-parallel mpu given to ``initialize`` (``deepspeed.utils.groups`` answers from it until
            ``destroy()``), or None.
        tp_groups: the AutoTP mesh's groups (``zero.parallel_groups.TensorParallelGroups``) with
            ``tensor_parallel.autotp_size`` > 1 (``deepspeed.utils.groups`` answers from them until ``destroy()``).
        frozen_left_out: ``(name, parameter)`` pairs ``initialize`` kept out of the optimizer it built from the
            config (frozen then, :mod:`zero.optim.trainable`); :meth:`backward` raises ValueError naming one that
            requires grad since.
    """

    def __init__(self, built: BuiltRuntime, config: EngineConfig, lr_scheduler=None, training_dataloader=None,
                 mpu=None, tp_groups=None, frozen_left_out=()):  # fmt: skip
        runtime = built.runtime
        self.runtime: EngineRuntime = runtime
        self.checkpoints: RuntimeCheckpoints = built.checkpoints
        self.mpu = mpu
        self.tp_groups = tp_groups
        self.config = config
        self.lr_scheduler = lr_scheduler
        self.training_dataloader = training_dataloader
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self.micro_steps = 0
        self._grad_norm: float | None = None
        self._compiled = False  # engine.compile() compiled the module (is_compiled)
        self._step_applied = False  # the last step() updated the parameters (DeepSpeed's was_step_applied)
        if runtime.optimizer is not None:  # DeepSpeed's loss-scale names on engine.optimizer (engine.loss_scale)
            expose_loss_scale(runtime.optimizer, runtime)
        self._boundary_override: bool | None = None
        self.inside_no_sync_ctxt = False  # in no_sync() or coalesce_grad_reduction(): step() raises (DeepSpeed's)
        self._in_engine_backward = False  # stage 0: a loss.backward() outside engine.backward raises (DeepSpeed's)
        # (name, parameter) frozen when initialize built the optimizer from the config: never in it (DeepSpeed's)
        self._frozen_left_out: tuple = tuple(frozen_left_out)
        self.rank, self.world_size = rank_world(runtime.group)
        self.observer = Observer.maybe(config, runtime, self.rank)
        self._compute_dtype = runtime.precision.compute
        self._start_monitor()  # tensorboard / wandb / csv_monitor / comet (zero.engine.monitoring)
        self._autotune = AutotuneProbe.maybe(self)  # an autotuning experiment measures itself
        self._forward = forward_callable(built, config, mpu)  # the module, or its compiled forward
        attach_parameter_offload(runtime)  # stage 3: what TRL's unwrap_model_for_generation reaches for
        self._qk_clip = EngineQKClip.maybe(runtime)  # MuonClip: clipped here after each step, not in Muon.step()
        self._state_offload = StateOffload.of(runtime)  # offload_states() / reload_states() (RLHF rollouts)
        if runtime.optimizer is not None:
            expose_offload(runtime.optimizer, self._state_offload)  # engine.optimizer.offload_states() too

    # --- the model --------------------------------------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        """The wrapped model (at stage 3 its parameters hold shards outside forward/backward)."""
        return self.runtime.module

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer the runtime steps (its ``param_groups`` carry the live lr); None for an engine built
        without one (forward only)."""
        return self.runtime.optimizer

    def _check_trains(self, what: str) -> None:
        """RuntimeError for ``backward``/``step`` on an engine built without an optimizer (forward only)."""
        if self.runtime.optimizer is None:
            raise RuntimeError(f"engine.{what}(): this engine was initialized without an optimizer, so it runs "
                               "forward only (a reference, teacher or evaluation model); pass an optimizer or "
                               "add an 'optimizer' section to its config to train it")  # fmt: skip

    def forward(self, *args, **kwargs):
        """Run the model's forward on this rank's micro-batch.

        Floating-point tensors among the inputs (nested in tuples, lists and dicts too) are cast to the compute
        dtype of the precision policy first, as DeepSpeed's engine casts inputs under fp16/bf16; integer tensors
        are left alone. With fp32 compute (fp32 runs, or bf16 storage on a CPU without bf16 matrix units) fp32
        inputs pass through unchanged. At stage 0 a ``loss.backward()`` on the outputs outside
        :meth:`backward` raises RuntimeError, as DeepSpeed's.
        """
        if self.runtime.optimizer is None and self.runtime.stage == 3:  # no step() to catch a rank's stray write
            self.runtime.check_outside_writes()
        compute = self._compute_dtype
        if compute is not None:
            args, kwargs = cast_inputs(args, compute), cast_inputs(kwargs, compute)
        with self._autocast():  # torch_autocast section (zero.engine.autocast)
            if self.observer is None:
                out = self._forward(*args, **kwargs)
            else:
                self.observer.before_forward(self.global_steps + 1)
                with self.observer.phase("forward"):
                    out = self._forward(*args, **kwargs)
        if self.runtime.stage == 0 and torch.is_grad_enabled():  # DeepSpeed refuses a direct loss.backward() there
            guard_outputs(out, lambda: self._in_engine_backward)
        return out

    __call__ = forward

    def train(self, mode: bool = True) -> Engine:
        """Set training mode on the module."""
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        """Set evaluation mode on the module."""
        return self.train(False)

    # --- batch sizes ----------------------------------------------------------------------------------------
    def train_batch_size(self) -> int:
        """Global batch per optimizer step (samples)."""
        return self.config.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per rank per forward/backward."""
        return self.config.batch.micro_batch_per_gpu

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self.config.batch.gradient_accumulation_steps

    # --- training step ---------------------------------------------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next ``step()`` steps the optimizer (DeepSpeed: ``(micro_steps + 1) % gas == 0``)."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Force (True/False) or release (None) the boundary decision, as DeepSpeed's method of this name."""
        self._boundary_override = is_boundary

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss`` (a scalar tensor) divided by the accumulation steps; returns the scaled loss. With
        ``gradient_allreduce_op: "sum"`` the data-parallel ranks' gradients are summed instead of averaged.

        Raises ValueError: ``loss`` is not a scalar tensor; a parameter ``initialize`` left out of the optimizer it
        built from the config (frozen then) requires grad now."""
        self._check_trains("backward")
        check_still_frozen(self._frozen_left_out)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"backward(loss): loss must be a scalar tensor, got {shape}")
        self._monitor_backward(loss)
        gas = self.gradient_accumulation_steps()
        if scale_wrt_gas and gas > 1:
            loss = loss / gas
        # gradient_allreduce_op "sum": the ranks' gradients summed, not averaged (the runtime averages)
        reduced = loss * self.world_size if self.config.gradient_allreduce_op == "sum" else loss
        self._in_engine_backward = True
        try:
            boundary = self.is_gradient_accumulation_boundary()
            if self.observer is None:
                self.runtime.backward(reduced, is_boundary=boundary)
            else:
                with self.observer.phase("backward"):
                    self.runtime.backward(reduced, is_boundary=boundary)
            if isinstance(self.runtime.model_parallel, ExpertParallel):  # MoE: shared gradients averaged over ep
                self.runtime.model_parallel.after_backward(boundary or self.zero_optimization_stage() >= 2)
            return loss
        finally:
            self._in_engine_backward = False

    def step(self) -> None:
        """Count the micro-step; at the accumulation boundary step the optimizer and the scheduler, zero grads.

        Raises RuntimeError on an engine built without an optimizer; AssertionError inside ``no_sync()`` or
        ``coalesce_grad_reduction()`` (DeepSpeed's)."""
        self._check_trains("step")
        if self.inside_no_sync_ctxt:
            raise AssertionError("It is illegal to call Engine.step() inside no_sync context manager")
        self._step_applied = False
        if self.is_gradient_accumulation_boundary():
            if isinstance(self.runtime.model_parallel, ExpertParallel):
                self.runtime.model_parallel.before_step()
            if self.observer is None:
                result = self.runtime.step()
            else:
                with self.observer.phase("step"):
                    result = self.runtime.step()
            self._grad_norm = None if result.grad_norm is None else float(result.grad_norm)
            self._step_applied = bool(result.stepped)
            if self._qk_clip is not None:
                self._qk_clip.after_step(self._step_applied)
            if result.stepped:
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step()
            else:
                self.skipped_steps += 1
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
            self.runtime.zero_grad()
            if self.observer is not None:
                self.observer.after_boundary(self.global_steps)
            self._monitor_step()
            if self._autotune is not None:
                self._autotune.after_boundary(self)
        self.micro_steps += 1

    def zero_grad(self) -> None:
        """Drop accumulated gradients."""
        self.runtime.zero_grad()

    def comms_summary(self) -> str:
        """Print (rank 0) and return the ``comms_logger`` table of every collective since initialize: calls,
        logical and wire MB, ms, algbw/busbw per collective. Raises RuntimeError when ``comms_logger`` is off."""
        if self.observer is None:
            raise RuntimeError("comms_summary(): the comms logger is off; set comms_logger.enabled true in the config")
        text = self.observer.comms_summary()
        self.observer._print(text)
        return text

    def get_lr(self) -> list[float]:
        """The current lr of every param group, in group order (empty for a forward-only engine)."""
        return [g["lr"] for g in self.optimizer.param_groups] if self.optimizer is not None else []

    def get_global_grad_norm(self) -> float | None:
        """L2 norm of the full (all-rank, unclipped) gradient at the last optimizer step; None before the first."""
        return self._grad_norm

    # --- checkpoints -------------------------------------------------------------------------------------------
    def _engine_state(self) -> dict:
        state = {"global_steps": self.global_steps, "global_samples": self.global_samples,
                 "skipped_steps": self.skipped_steps, "micro_steps": self.micro_steps}  # fmt: skip
        if self.lr_scheduler is not None:
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        state["loss_scaler"] = self.runtime.loss_scaler.state_dict()
        return state

    def _model_config(self) -> dict | None:
        """The transformers config of the module as a dict (None for other models), with ``architectures`` filled
        as ``save_pretrained`` does, so the written ``config.json`` names the model class."""
        to_dict = getattr(getattr(self.module, "config", None), "to_dict", None)
        if to_dict is None:
            return None
        cfg = to_dict()
        if not cfg.get("architectures"):
            cfg["architectures"] = [type(self.module).__name__]
        return cfg

    def save_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:  # fmt: skip
        """Collective: every rank writes its shard to ``save_dir/tag`` (default ``global_step<N>``); returns True,
        as DeepSpeed's.

        The engine's counters, the LR scheduler and the loss scaler are saved with it; ``client_state`` comes back
        from :meth:`load_checkpoint`. ``save_latest=False`` leaves ``save_dir/latest`` naming the previous tag.
        ``exclude_frozen_parameters=True`` leaves out parameters with ``requires_grad=False`` that are in no
        optimizer param group (frozen ones inside an optimizer group are saved, as DeepSpeed keeps its groups'
        params); loading such a checkpoint keeps the module's current values for them, and consolidation omits
        them. Mirrors ``DeepSpeedEngine.save_checkpoint``.

        With AutoTP (``tensor_parallel.autotp_size`` > 1) each tensor-parallel rank's data-parallel group writes
        its checkpoint to ``save_dir/tag/tp_rank_<t>/`` and the split (every split parameter's dim, full shape and
        per-rank sizes) is recorded in ``save_dir/tag/tensor_parallel.json``; ``zero_to_fp32`` then gives the
        single-process state dict.
        """
        save_dir = checked_save_dir(save_dir)
        tag = agreed_tag(tag or f"global_step{self.global_steps}", self.config.checkpoint.tag_validation,
                         self.runtime.group)  # fmt: skip
        model_config = self._model_config()
        self.checkpoints.save(save_dir, tag, dict(client_state or {}), self._engine_state(), model_config,
                              save_latest=save_latest, exclude_frozen=exclude_frozen_parameters)  # fmt: skip
        return True

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: str | None = None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        load_module_strict: bool = True):  # fmt: skip
        """Load ``load_dir/tag`` (default: ``load_dir/latest``); returns ``(load_path, client_state)`` as DeepSpeed.

        ``load_path`` is the model-states file DeepSpeed 0.19.8 names, ``os.path.join(load_dir, tag, name)``:
        ``name`` is ``mp_rank_00_model_states.pt``, at stage 3 ``zero_pp_rank_<dp rank>_mp_rank_00_model_states.pt``
        (rank 0's for a universal folder); zero's own layout gives ``mp_rank_00_model_states.safetensors`` (under
        ``tp_rank_<t>/`` for an AutoTP checkpoint loaded at the same split).

        ``load_module_strict`` is accepted for DeepSpeed's signature (transformers passes it): zero's load always
        checks every key against the saved layout.

        A checkpoint of a model AutoTP split loads at the same split bit for bit (at any data-parallel size), and
        at another ``autotp_size``, without tensor parallelism, or a plain one into a split model through the
        full tensors (each parameter's master weights and optimizer state reassembled and cut again; the RNG
        states are then not restored).

        The folder may also be DeepSpeed 0.19's own ZeRO stage 1-3 checkpoint, or its universal checkpoint
        (``ds_to_universal``; with ``checkpoint.load_universal: true`` the tag comes from ``latest_universal``), loaded
        at any rank count and stage; DeepSpeed saves no RNG state, so none is restored.

        A pipeline checkpoint (``PipelineEngine.save_checkpoint``'s folder) loads into a module naming its
        parameters as the PipelineModule does (e.g. an ``nn.Sequential`` of the same layers), each parameter's
        weights and optimizer state from the stage that saved it (``zero.engine.pipeline_reshard``).

        Without ``tag``, a folder with no ``latest`` file on any rank gives a warning and ``(None, None)``
        (DeepSpeed's); missing on some ranks only, the error is raised on every rank.

        Raises: FileNotFoundError / zero_core's CheckpointError naming the missing or corrupt file.
        """
        if read_record(load_dir) is not None:  # a PipelineEngine's folder: the parameters by name from its stages
            return load_resharded(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
                                  load_module_only)  # fmt: skip
        if tag is None and self.config.checkpoint.load_universal:
            tag = universal_tag(load_dir, self.runtime.group)
        if latest_is_missing(load_dir, tag, self.runtime.group):
            return None, None
        path, client_state, state = self.checkpoints.load(str(load_dir), tag, load_optimizer_states,
                                                          load_module_only)  # fmt: skip
        if not load_module_only and state:
            self._restore_engine_state(state, load_lr_scheduler_states)
        return path, client_state

    def _restore_engine_state(self, state: dict, load_lr_scheduler_states: bool) -> None:
        """The step counters, LR scheduler and loss scaler of a loaded checkpoint's engine state."""
        for key in ("global_steps", "global_samples", "skipped_steps", "micro_steps"):
            setattr(self, key, state.get(key, getattr(self, key)))
        if load_lr_scheduler_states and self.lr_scheduler is not None and "lr_scheduler" in state:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
            # zero's (DeepSpeed's) schedulers set the lr in step(); re-apply the restored iteration's lr.
            # torch's schedulers restore it through the optimizer state (param_groups' "lr").
            if getattr(self.lr_scheduler, "last_batch_iteration", -1) >= 0:
                self.lr_scheduler.step(self.lr_scheduler.last_batch_iteration)
        if "loss_scaler" in state:
            self.runtime.loss_scaler.load_state_dict(state["loss_scaler"])

    def save_16bit_model(self, save_dir: str | os.PathLike, save_filename: str = "model.safetensors",
                         exclude_frozen_parameters: bool = False) -> bool:  # fmt: skip
        """Collective: write the full model (every ``state_dict()`` key: parameters, buffers, tied keys) from rank 0.

        Mirrors ``DeepSpeedEngine.save_16bit_model(save_dir, save_filename="pytorch_model.bin",
        exclude_frozen_parameters=False)``. Floating-point tensors (parameters and buffers) are saved in the
        model's parameter dtype (bf16/fp16 when enabled, else fp32); integer buffers as they are. A filename
        ending in ``.bin``, ``.pt`` or ``.pth`` is written in torch format (``torch.save`` of a dict), anything
        else as safetensors. For a transformers model ``config.json`` is written beside it, so
        ``from_pretrained(save_dir)`` loads it. Every rank must call it; the write is atomic (temp file + rename).

        At stage 3 the weights are gathered only when ``zero_optimization.stage3_gather_16bit_weights_on_model_save``
        is true (DeepSpeed's default: false). When it is false nothing is gathered or written and every rank
        returns False, as DeepSpeed (which logs why): save a checkpoint with ``save_checkpoint`` instead and run the
        ``zero_to_fp32.py`` written beside it (HF Trainer's ``save_model`` does that fallback itself).

        Args:
            exclude_frozen_parameters: leave out parameters with ``requires_grad=False``.

        With AutoTP (``tensor_parallel``) each split parameter is all-gathered over its tensor-parallel group and
        global rank 0 writes the single-process model's state dict (full shapes, the model's own config). With
        expert parallelism (AutoEP, or DeepSpeed MoE layers with ``ep_size`` > 1) global rank 0 gathers every
        expert-parallel rank's experts and writes the state dict of the same model at ``ep_size`` 1 (the
        transformers model's own for AutoEP, as ``zero_to_fp32`` gives from a checkpoint).

        Returns:
            True once the file exists (on every rank); False when stage 3 was told not to gather.
        """
        if self.zero_optimization_partition_weights() and not self.zero_gather_16bit_weights_on_model_save():
            from zero.log import logger

            logger.info("did not save the model %s: stage3_gather_16bit_weights_on_model_save is false",
                        os.path.join(str(save_dir), str(save_filename)))  # fmt: skip
            return False
        from zero_comm import same_outcome
        from zero_core.checkpoint import full_state_dict, save_model_weights

        name = str(save_filename)
        fmt = "torch" if name.endswith((".bin", ".pt", ".pth")) else "safetensors"
        dtype = self.runtime.precision.param_dtype
        model_config = self._model_config()
        out = os.path.join(str(save_dir), name)
        split = layout_of(self.module)  # AutoTP: each tensor-parallel rank's shards gathered into full tensors
        experts = self._expert_parallel_parts()
        if exclude_frozen_parameters or split is not None or experts is not None:
            frozen = set()
            if exclude_frozen_parameters:
                frozen = {n for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
            if experts is not None:  # every expert-parallel rank's experts, under the names of the model at ep 1
                state = experts.dense_state(dtype)
            elif split is None:
                state = full_state_dict(self.runtime, dtype)
            else:
                state = gather_full_state(full_state_dict(self.runtime, dtype, rank0_only=False), split)
            whole = split is None and experts is None
            group = self.runtime.group if whole else None  # None: every rank
            writer = self.rank == 0 if whole else torch.distributed.get_rank() == 0
            with same_outcome("save_16bit_model", group):  # the writer's error: every rank's
                if writer:
                    _write_weights({k: v for k, v in state.items() if k not in frozen}, out, fmt)
                    if model_config is not None:
                        with open(os.path.join(str(save_dir), "config.json"), "w") as f:
                            json.dump(model_config, f, indent=2)
        else:
            written = save_model_weights(self.runtime, save_dir, fmt=fmt, dtype=dtype, model_config=model_config)
            if written is not None and os.path.abspath(written) != os.path.abspath(out):
                os.replace(written, out)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.barrier()  # the file exists on return, on every rank
        return True


def _write_weights(state: dict[str, torch.Tensor], path: str, fmt: str) -> None:
    """Atomic write of ``state`` as safetensors (tied tensors copied: it refuses shared storage) or torch format."""
    from safetensors.torch import save_file

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    if fmt == "torch":
        torch.save(state, tmp)
    else:
        seen: set[int] = set()
        tensors = {}
        for k, v in state.items():
            tensors[k] = v.clone() if id(v) in seen else v.contiguous()
            seen.add(id(v))
        save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, path)
