"""The rest of DeepSpeed 0.19.8's engine surface (``deepspeed_engine_names.txt`` in zero's tests lists it): ranks,
groups and sizes from the process groups, the data loader DeepSpeed builds, the module's state dict, batch-size
setters, optimizer views, and DeepSpeed's attributes whose answer is fixed for zero (no MoE, no pipeline).

Config getters are :mod:`zero.engine.config_getters`'; the names zero refuses are :mod:`zero.engine.surface_refused`'s,
whose ``refuse_or_forward`` answers any other unknown name from the wrapped module, as DeepSpeed's ``__getattr__``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, default_collate

from zero import parallel_groups as groups
from zero.config import NotSupportedError
from zero.engine.expert_parallel import moe_layers
from zero.engine.surface_refused import refuse_or_forward
from zero_parallel.moe import EXPERT_GROUPS, MOELayer, TopKGate


class EngineSurfaceMixin:
    """DeepSpeed engine attributes over the Engine's ``runtime``, ``config``, ``module``, ``optimizer``,
    ``lr_scheduler`` and ``training_dataloader`` (see the module docstring)."""

    flatten = staticmethod(_flatten_dense_tensors)
    unflatten = staticmethod(_unflatten_dense_tensors)
    # DeepSpeed's fixed answers where zero has no such feature (no MoE layers, no pipeline, torch.distributed comms)
    pipeline_parallelism = False
    use_ds_comm = False
    dont_change_device = False
    optimized_linear_lora_enabled = False
    optimized_linear_base_weight_sharding = False
    warn_unscaled_loss = True
    mesh_device = None
    losses = None  # DeepSpeed 0.19.8 resets it to None and never fills it

    def __getattr__(self, name: str):
        runtime = self.__dict__.get("runtime")  # not self.module: __getattr__ must not recurse during __init__
        return refuse_or_forward(self, None if runtime is None else runtime.module, name)

    # --- ranks, groups and sizes (DeepSpeed's _configure_distributed_model) ----------------------------------------
    @property
    def global_rank(self) -> int:
        """This process's rank in the whole world (0 without a process group)."""
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def dist_backend(self) -> str:
        """The process group's backend name (``"nccl"``, ``"gloo"``)."""
        return dist.get_backend()

    @property
    def data_parallel_group(self):
        """The data-parallel process group (``deepspeed.utils.groups._get_data_parallel_group()``)."""
        return groups._get_data_parallel_group()

    @property
    def dp_world_size(self) -> int:
        """Ranks in the data-parallel group (the world over sequence and tensor parallelism)."""
        return groups._get_data_parallel_world_size()

    @property
    def mp_world_size(self) -> int:
        """Model-parallel ranks: AutoTP's tensor-parallel size, else 1."""
        return groups._get_model_parallel_world_size()

    @property
    def seq_data_parallel_group(self):
        """The sequence x data-parallel group (what ZeRO shards over with a sequence-parallel mpu)."""
        return groups._get_sequence_data_parallel_group()

    @property
    def seq_dp_world_size(self) -> int:
        """Ranks in the sequence x data-parallel group."""
        return groups._get_sequence_data_parallel_world_size()

    @property
    def sequence_parallel_size(self) -> int:
        """Ranks sharing one sequence (Ulysses): the mpu's size, 1 without one."""
        return groups._get_sequence_parallel_world_size()

    def get_sequence_parallel_group(self):
        """The sequence-parallel group. Raises KeyError without a sequence-parallel mpu (DeepSpeed has none then)."""
        return groups._get_sequence_parallel_group()

    @property
    def checkpoint_mp_rank(self) -> int:
        """The model-parallel rank checkpoints are named by (0 without tensor parallelism)."""
        return self.get_model_parallel_rank()

    @property
    def expert_parallel_group(self) -> dict:
        """Name -> this rank's expert-parallel group (``{}`` without DeepSpeed MoE layers)."""
        return dict(EXPERT_GROUPS.expert_parallel) if self.has_moe_layers else {}

    @property
    def expert_data_parallel_group(self) -> dict:
        """Name -> this rank's expert-data-parallel group (``{}`` without DeepSpeed MoE layers)."""
        return dict(EXPERT_GROUPS.expert_data_parallel) if self.has_moe_layers else {}

    @property
    def moe_layers(self) -> list:
        """The model's ``MOELayer`` modules (each MoE layer's ``deepspeed_moe``), in module order."""
        return [m for m in self.module.modules() if isinstance(m, MOELayer)]

    @property
    def num_experts(self) -> list:
        """Experts (all ranks together) of each DeepSpeed MoE layer, in module order."""
        return [m.num_experts for m in moe_layers(self.module)]

    @property
    def gate_modules(self) -> list:
        """The DeepSpeed MoE layers' gates (``TopKGate``), in module order."""
        return [m for m in self.module.modules() if isinstance(m, TopKGate)] if self.has_moe_layers else []

    @property
    def has_moe_layers(self) -> bool:
        """True when the model holds a DeepSpeed MoE layer (``deepspeed.moe.layer.MoE``)."""
        return bool(moe_layers(self.module))

    def is_first_weights_partition_group(self) -> bool:
        """True at stage 3, as DeepSpeed's."""
        return self.zero_optimization_partition_weights()

    # --- precision and reduction ----------------------------------------------------------------------------------
    @property
    def communication_data_type(self) -> torch.dtype:
        """The gradient reduction dtype: ``communication_data_type`` when set, else fp16/bf16/fp32 as enabled."""
        names = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
        if self.config.communication_data_type is not None:
            return names[self.config.communication_data_type]
        if self.config.fp16.enabled:
            return torch.float16
        return torch.bfloat16 if self.config.bf16.enabled else torch.float32

    @property
    def gradient_average(self) -> bool:
        """True: gradients are averaged over the data-parallel ranks (``gradient_allreduce_op`` "mean")."""
        return self.config.gradient_allreduce_op == "mean"

    @property
    def enable_backward_allreduce(self) -> bool:
        """True: ``engine.backward`` reduces gradients (zero always does; use ``no_sync`` to hold them)."""
        return True

    @property
    def scale_wrt_gas(self) -> bool:
        """True: ``engine.backward`` divides the loss by the accumulation steps by default."""
        return True

    @property
    def zenflow(self) -> bool:
        """True when ``zero_optimization.zenflow`` is set."""
        return self.config.zero_optimization.zenflow is not None

    def torch_autocast_lower_precision_safe_modules(self) -> list[str]:
        """``torch_autocast.lower_precision_safe_modules``, or DeepSpeed's default list (torch's Linear and Conv)."""
        names = self.config.torch_autocast.lower_precision_safe_modules
        if names is not None:
            return list(names)
        return [f"{c.__module__}.{c.__name__}" for c in (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d,
                                                          torch.nn.Conv3d)]  # fmt: skip

    def is_deepcompile_active(self) -> bool:
        """DeepCompile is enabled and the forward was compiled (zero compiles it at initialize)."""
        return bool(self.config.compile.deepcompile)

    def allreduce_gradients(self, bucket_size: int | None = None) -> None:
        """DeepSpeed's ``engine.allreduce_gradients()``: reduce the accumulated gradients at the boundary. zero's
        ``engine.backward`` already reduced them (as DeepSpeed's backward calls this itself), so nothing is left to
        do, at any stage and micro-batch; ``bucket_size`` is accepted for the signature. (DeepSpeed 0.19.8 called
        after a backward: nothing changes at stages 0 and 3; IndexError from ``reduce_ipg_grads`` at 1-2.)"""

    @contextlib.contextmanager
    def coalesce_grad_reduction(self):
        """DeepSpeed's context for several ``engine.backward`` calls making one optimizer step with one reduction.

        Inside, ``step()`` raises AssertionError (as DeepSpeed's) and the gradients accumulate; zero reduces each
        backward's gradients as its boundary says, so the summed gradient after the block equals DeepSpeed's
        (reduction is linear) while the communication is not coalesced.

        Raises:
            AssertionError: ``managed_gradient_accumulation`` is false, or inside ``no_sync`` (DeepSpeed's).
            NotSupportedError: at stage 0 (DeepSpeed refuses it there with NotImplementedError).
        """
        if not self.managed_gradient_accumulation():
            raise AssertionError("coalesce_grad_reduction is not supported with managed_gradient_accumulation=False")
        if self.zero_optimization_stage() == 0:
            raise NotSupportedError("coalesce_grad_reduction requires ZeRO stage 1/2/3, got stage 0 (DeepSpeed's "
                                    "refusal); accumulate with plain engine.backward() calls")  # fmt: skip
        if self.inside_no_sync_ctxt:
            raise AssertionError("coalesce_grad_reduction cannot be nested inside another no_sync context")
        self.inside_no_sync_ctxt = True
        try:
            yield
        finally:
            self.inside_no_sync_ctxt = False

    # --- optimizer and scheduler views --------------------------------------------------------------------------
    @property
    def basic_optimizer(self):
        """The torch optimizer stepping the master weights (what DeepSpeed wraps)."""
        return self.optimizer

    @property
    def client_optimizer(self):
        """The optimizer given to ``initialize`` (None when the config's ``optimizer`` section built it, or none)."""
        return self.optimizer if self.config.client_optimizer_given else None

    @property
    def client_lr_scheduler(self):
        """The scheduler given to ``initialize`` (None when the config's ``scheduler`` section built it)."""
        return self.lr_scheduler if self.config.scheduler is None else None

    def optimizer_name(self) -> str | None:
        """The client optimizer's class name, else the config's ``optimizer.type`` (lowercased for DeepSpeed's
        own optimizers, as DeepSpeed), None without either."""
        from zero.engine.config_getters import _optimizer_name

        client = self.client_optimizer
        return type(client).__name__ if client is not None else _optimizer_name(self.config)

    def _param_group_values(self, key: str) -> list:
        if self.optimizer is None:
            return []
        return [g.get(key, 0.0) for g in self.optimizer.param_groups]

    def get_type(self) -> list:
        """Each param group's ``"type"`` (0.0 where absent), as DeepSpeed's."""
        return self._param_group_values("type")

    def get_mom(self) -> list:
        """Each param group's ``momentum`` for SGD/RMSprop, else its ``betas`` (0.0 where absent), as DeepSpeed's."""
        return self._param_group_values("momentum" if self.optimizer_name() in ("SGD", "RMSprop") else "betas")

    @property
    def param_names(self) -> dict:
        """``{parameter: name}`` over the module's parameters."""
        return {p: n for n, p in self.module.named_parameters()}

    @property
    def training(self) -> bool:
        """The module's training mode."""
        return self.module.training

    def collect_python_gc(self) -> int:
        """Run Python's cyclic garbage collector now; returns the number of objects it found unreachable."""
        return gc.collect()

    # --- batch sizes ------------------------------------------------------------------------------------------
    def get_batch_info(self) -> tuple:
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``: the three bound
        methods, as DeepSpeed returns them (call each for its value)."""
        return self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch by changing the accumulation steps (the micro-batch stays).

        Raises:
            ValueError: ``train_batch_size`` is not a multiple of micro-batch x data-parallel ranks (DeepSpeed's).
        """
        batch = self.config.batch
        per_step = batch.micro_batch_per_gpu * batch.world_size
        if train_batch_size % per_step != 0:
            raise ValueError("Train batch size must be divisible by micro-batch data parallelism")
        self.config._batch = dataclasses.replace(batch, train_batch_size=train_batch_size,
                                                 gradient_accumulation_steps=train_batch_size // per_step)  # fmt: skip

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Change the micro-batch keeping the accumulation steps; the global batch follows (DeepSpeed's)."""
        batch = self.config.batch
        self.config._batch = dataclasses.replace(
            batch, micro_batch_per_gpu=micro_batch_size,
            train_batch_size=micro_batch_size * batch.gradient_accumulation_steps * batch.world_size)  # fmt: skip

    # --- data ---------------------------------------------------------------------------------------------------
    @property
    def training_data(self):
        """The dataset given to ``initialize`` (None when none was)."""
        return None if self.training_dataloader is None else self.training_dataloader.dataset

    @property
    def collate_fn(self):
        """The ``collate_fn`` given to ``initialize`` (None when none was)."""
        loader = self.training_dataloader
        if loader is None or loader.collate_fn is default_collate:
            return None
        return loader.collate_fn

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: dict) -> None:
        """A no-op, as DeepSpeed's without curriculum learning (which zero refuses when enabled)."""

    @staticmethod
    def is_map_style_dataset(obj) -> bool:
        """The object has ``__getitem__`` and ``__len__`` (a map-style dataset)."""
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj) -> bool:
        """The object is a ``torch.utils.data.IterableDataset``."""
        return isinstance(obj, IterableDataset)

    def deepspeed_io(self, dataset, batch_size=None, route="train", pin_memory=True, data_sampler=None,
                     collate_fn=None, num_local_io_workers=None) -> DataLoader:  # fmt: skip
        """A loader of this rank's micro-batches of ``dataset``, as DeepSpeed's: ``batch_size`` default the
        micro-batch, a ``DistributedSampler`` over the data-parallel ranks (shuffled for ``route="train"``, in
        order for "eval"/"predict") unless ``data_sampler`` is given; ``pin_memory`` only where CUDA is.

        Raises:
            ValueError: ``dataset`` is not a torch Dataset (map- or iterable-style).
        """
        if not (self.is_map_style_dataset(dataset) or self.is_iterable_style_dataset(dataset)):
            raise ValueError("Training data must be a torch Dataset")
        if data_sampler is None and not self.is_iterable_style_dataset(dataset):
            rank = groups._get_data_parallel_rank()
            data_sampler = DistributedSampler(dataset, self.dp_world_size, rank, shuffle=route == "train")
        return DataLoader(dataset, batch_size=batch_size or self.train_micro_batch_size_per_gpu(),
                          sampler=data_sampler, collate_fn=collate_fn or self.collate_fn,
                          pin_memory=pin_memory and torch.cuda.is_available(),
                          num_workers=num_local_io_workers or 0)  # fmt: skip

    # --- the module's weights -------------------------------------------------------------------------------------
    def module_state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict:  # fmt: skip
        """The module's ``state_dict`` (at stage 3 its parameters hold this rank's shards, as DeepSpeed's);
        ``exclude_frozen_parameters`` leaves out parameters with ``requires_grad=False``."""
        state = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, p in self.module.named_parameters():
                if not p.requires_grad:
                    state.pop(prefix + name, None)
        return state

    def load_module_state_dict(self, checkpoint: dict, strict: bool = True, custom_load_fn=None,
                               fetch_z3_params: bool = False, z3_params_to_fetch=None,
                               allowed_missing_keys=None) -> None:  # fmt: skip
        """Load ``checkpoint["module"]`` into the module, as DeepSpeed's. With ``fetch_z3_params`` (or
        ``z3_params_to_fetch``) at stage 3 the parameters are gathered, loaded and re-partitioned from rank 0's
        values (every rank must call it); ``custom_load_fn(src=state_dict, dst=module)`` replaces the load.

        Raises:
            RuntimeError: missing or unexpected keys with ``strict`` (torch's), other than ``allowed_missing_keys``.
        """
        from zero.partitioning.gathered import GatheredParameters

        fetch = list(z3_params_to_fetch) if z3_params_to_fetch is not None else (
            list(self.module.parameters()) if fetch_z3_params else [])  # fmt: skip
        with GatheredParameters(fetch, modifier_rank=0, enabled=bool(fetch)):
            state = checkpoint["module"]
            if custom_load_fn is not None:
                custom_load_fn(src=state, dst=self.module)
                return
            result = self.module.load_state_dict(state, strict=strict and allowed_missing_keys is None)
            if strict and allowed_missing_keys is not None:
                missing = set(result.missing_keys) - set(allowed_missing_keys)
                if missing or result.unexpected_keys:
                    raise RuntimeError(f"load_module_state_dict: missing keys {sorted(missing)}, unexpected keys "
                                       f"{sorted(result.unexpected_keys)}")  # fmt: skip

    def save_fp16_model(self, save_dir, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's older name of :meth:`save_16bit_model` (same call)."""
        return self.save_16bit_model(save_dir, save_filename)
