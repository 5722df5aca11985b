"""The Engine: DeepSpeed's training-loop surface over a zero_core runtime. It composes; it owns no sharding."""

from __future__ import annotations

import os

import torch

from zero.config import EngineConfig
from zero.distributed import rank_world
from zero.engine import checkpointing
from zero.engine.observe import Observer


class Engine:
    """Forward, backward, step and checkpoints with DeepSpeed's semantics.

    * ``backward(loss)`` divides the loss by ``gradient_accumulation_steps`` (DeepSpeed's ``scale_wrt_gas``) so the
      accumulated gradient is the mean over the global batch.
    * ``step()`` is called after every micro-batch; it steps the optimizer only at the gradient accumulation
      boundary (every ``gradient_accumulation_steps``-th call), then steps the LR scheduler unless the step was
      skipped for non-finite gradients, and zeroes the gradients.
    * ``global_steps`` counts optimizer boundaries (skipped ones included, as DeepSpeed); ``skipped_steps`` the
      skipped ones.

    Args:
        runtime: a zero_core ``ZeroRuntime`` (or the stage-0 LocalRuntime); provides module, optimizer, backward,
            step, zero_grad.
        config: the validated :class:`~zero.config.EngineConfig` (batch sizes resolved).
        lr_scheduler: stepped once per optimizer step, or None.
        training_dataloader: the loader built from ``training_data``, or None.
    """

    def __init__(self, runtime, config: EngineConfig, lr_scheduler=None, training_dataloader=None):
        self.runtime = runtime
        self.config = config
        self.lr_scheduler = lr_scheduler
        self.training_dataloader = training_dataloader
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self.micro_steps = 0
        self._grad_norm: float | None = None
        self._boundary_override: bool | None = None
        self.rank, self.world_size = rank_world(getattr(runtime, "group", None))
        self.observer = Observer.maybe(config, runtime, self.rank)

    # --- the model --------------------------------------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        """The wrapped model (at stage 3 its parameters hold shards outside forward/backward)."""
        return self.runtime.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer the runtime steps (its ``param_groups`` carry the live lr)."""
        return self.runtime.optimizer

    def forward(self, *args, **kwargs):
        """Run the model's forward on this rank's micro-batch."""
        if self.observer is None:
            return self.runtime.module(*args, **kwargs)
        self.observer.before_forward(self.global_steps + 1)
        with self.observer.phase("forward"):
            return self.runtime.module(*args, **kwargs)

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
        """Backward of ``loss`` (a scalar tensor) divided by the accumulation steps; returns the scaled loss."""
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"backward(loss): loss must be a scalar tensor, got {shape}")
        gas = self.gradient_accumulation_steps()
        if scale_wrt_gas and gas > 1:
            loss = loss / gas
        if self.observer is None:
            self.runtime.backward(loss, is_boundary=self.is_gradient_accumulation_boundary())
            return loss
        with self.observer.phase("backward"):
            self.runtime.backward(loss, is_boundary=self.is_gradient_accumulation_boundary())
        return loss

    def step(self) -> None:
        """Count the micro-step; at the accumulation boundary step the optimizer and the scheduler, zero grads."""
        if self.is_gradient_accumulation_boundary():
            if self.observer is None:
                result = self.runtime.step()
            else:
                with self.observer.phase("step"):
                    result = self.runtime.step()
            self._grad_norm = None if result.grad_norm is None else float(result.grad_norm)
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
        """The current lr of every param group, in group order."""
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """L2 norm of the full (all-rank, unclipped) gradient at the last optimizer step; None before the first."""
        return self._grad_norm

    # --- checkpoints -------------------------------------------------------------------------------------------
    def _engine_state(self) -> dict:
        state = {"global_steps": self.global_steps, "global_samples": self.global_samples,
                 "skipped_steps": self.skipped_steps, "micro_steps": self.micro_steps}  # fmt: skip
        if self.lr_scheduler is not None:
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        scaler = getattr(self.runtime, "loss_scaler", None)
        if scaler is not None and hasattr(scaler, "state_dict"):
            state["loss_scaler"] = scaler.state_dict()
        return state

    def save_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True) -> str:  # fmt: skip
        """Collective: every rank writes its shard to ``save_dir/tag`` (default ``global_step<N>``); returns tag.

        The engine's counters, the LR scheduler and the loss scaler are saved with it; ``client_state`` comes back
        from :meth:`load_checkpoint`. Mirrors ``DeepSpeedEngine.save_checkpoint``.
        """
        tag = tag or f"global_step{self.global_steps}"
        model_config = getattr(getattr(self.module, "config", None), "to_dict", lambda: None)()
        checkpointing.save(self.runtime, str(save_dir), tag, dict(client_state or {}), self._engine_state(),
                           model_config)  # fmt: skip
        return tag

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: str | None = None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False):  # fmt: skip
        """Load ``load_dir/tag`` (default: ``load_dir/latest``); returns ``(path, client_state)`` as DeepSpeed.

        Raises: FileNotFoundError / zero_core's CheckpointError naming the missing or corrupt file.
        """
        path, client_state, state = checkpointing.load(self.runtime, str(load_dir), tag, load_optimizer_states,
                                                       load_module_only)  # fmt: skip
        if not load_module_only and state:
            for key in ("global_steps", "global_samples", "skipped_steps", "micro_steps"):
                setattr(self, key, state.get(key, getattr(self, key)))
            if load_lr_scheduler_states and self.lr_scheduler is not None and "lr_scheduler" in state:
                self.lr_scheduler.load_state_dict(state["lr_scheduler"])
                if self.lr_scheduler.last_batch_iteration >= 0:  # re-apply the lr of the restored iteration
                    self.lr_scheduler.step(self.lr_scheduler.last_batch_iteration)
            scaler = getattr(self.runtime, "loss_scaler", None)
            if scaler is not None and "loss_scaler" in state:
                scaler.load_state_dict(state["loss_scaler"])
        return path, client_state

    def save_16bit_model(self, save_dir: str | os.PathLike, save_filename: str = "model.safetensors") -> str:
        """Collective: gather the full parameters and write them (model dtype) from rank 0 as safetensors.

        Returns the file path. At stage 3 every rank must call it (parameters are gathered one at a time).
        """
        from safetensors.torch import save_file

        full = self.runtime.full_parameters()
        tensors = {n: t.detach().to("cpu").contiguous().clone() for n, t in full.items()}
        path = os.path.join(str(save_dir), save_filename)
        if self.rank == 0:
            os.makedirs(str(save_dir), exist_ok=True)
            save_file(tensors, path + ".tmp")
            os.replace(path + ".tmp", path)
        if self.world_size > 1:
            torch.distributed.barrier()
        return path
