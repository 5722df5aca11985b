"""DeepSpeed 0.19.8's engine config getters (``engine.zero_overlap_comm()``, ``engine.flops_profiler_enabled()``, ...)
generated from one table, :data:`GETTERS`, over the engine's validated :class:`~zero.config.EngineConfig`.

Each getter returns what DeepSpeed's returns for the same config: the key's value, or DeepSpeed's default for a key
zero does not take (``zero_legacy_stage1()`` is False, ``zero_model_persistence_threshold()`` ``sys.maxsize``).
Getters whose answer is not a plain config read (batch sizes, precision, loss scale) live on the engine itself.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch

# DeepSpeed lowercases these optimizer types in its config (its DEEPSPEED_OPTIMIZERS); others keep their spelling
_DEEPSPEED_OPTIMIZERS = ("adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon")


def _zo(cfg):
    return cfg.zero_optimization


def _offload_opt(cfg):
    return cfg.zero_optimization.offload_optimizer


def _offload_device(cfg, key: str) -> str:
    section = getattr(cfg.zero_optimization, key)
    return "none" if section is None else section.device


def _optimizer_name(cfg) -> str | None:
    if cfg.optimizer is None:
        return None
    name = cfg.optimizer.type
    return name.lower() if name.lower() in _DEEPSPEED_OPTIMIZERS else name


def _autotuning_path(value: str | None, default: str) -> str:
    return value or os.path.join(os.getcwd(), default)


def _passes(cfg) -> list[str]:
    return list(cfg.compile.passes or [])


_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "float32": torch.float32,
           "float16": torch.float16, "bfloat16": torch.bfloat16}  # fmt: skip


def _model_dtype(cfg) -> torch.dtype:
    return torch.float16 if cfg.fp16.enabled else torch.bfloat16 if cfg.bf16.enabled else torch.float32


def _data_types(cfg) -> tuple[torch.dtype, torch.dtype]:
    model = _model_dtype(cfg)
    accum = cfg.data_types.grad_accum_dtype
    return model, model if accum is None else _DTYPES[accum]


GETTERS: dict[str, tuple[Callable, str]] = {
    # name: (config -> value, what it returns)
    "aio_config": (lambda c: c.aio.model_dump(), "the `aio` section as a dict"),
    "autotuning_enabled": (lambda c: c.autotuning.enabled, "`autotuning.enabled`"),
    "autotuning_start_profile_step": (lambda c: c.autotuning.start_profile_step, "`autotuning.start_profile_step`"),
    "autotuning_end_profile_step": (lambda c: c.autotuning.end_profile_step, "`autotuning.end_profile_step`"),
    "autotuning_metric": (lambda c: c.autotuning.metric, "`autotuning.metric`"),
    "autotuning_metric_path": (
        lambda c: _autotuning_path(c.autotuning.metric_path, "autotuning_metric.json"),
        "`autotuning.metric_path`, default ./autotuning_metric.json",
    ),  # fmt: skip
    "autotuning_model_info_path": (
        lambda c: _autotuning_path(c.autotuning.model_info_path, "autotuning_model_info.json"),
        "`autotuning.model_info_path`, default ./autotuning_model_info.json",
    ),  # fmt: skip
    "autotuning_profile_model_info": (
        lambda c: bool(c.autotuning.enabled and c.autotuning.model_info and c.autotuning.model_info.profile),
        "autotuning on and `autotuning.model_info.profile`",
    ),  # fmt: skip
    "bf16_master_weights_and_gradients": (lambda c: False, "False: master weights and gradients are fp32"),
    "bf16_optimizer_states": (lambda c: False, "False: optimizer states are fp32"),
    "checkpoint_serialization_enabled": (lambda c: True, "True (DeepSpeed's default: serialized checkpoint files)"),
    "checkpoint_writer_enabled": (lambda c: False, "False: no decoupled checkpoint writer is configured"),
    "checkpoint_tag_validation_enabled": (
        lambda c: c.checkpoint.tag_validation.lower() != "ignore",
        "`checkpoint.tag_validation` is not Ignore",
    ),  # fmt: skip
    "checkpoint_tag_validation_fail": (
        lambda c: c.checkpoint.tag_validation.lower() == "fail",
        "`checkpoint.tag_validation` is Fail",
    ),  # fmt: skip
    "compile_autosp": (lambda c: "autosp" in _passes(c), "'autosp' is in `compile.passes`"),
    "compile_autotp": (lambda c: "autotp" in _passes(c), "'autotp' is in `compile.passes`"),
    "compile_zero_optimization_stage": (
        lambda c: "z1" in _passes(c) or "z3" in _passes(c),
        "'z1' or 'z3' is in `compile.passes`",
    ),  # fmt: skip
    "uses_parallelization_pass_only": (
        lambda c: "autosp" in _passes(c) or "autotp" in _passes(c),
        "'autosp' or 'autotp' is in `compile.passes`",
    ),  # fmt: skip
    "is_deepcompile_enabled": (lambda c: c.compile.deepcompile, "`compile.deepcompile`"),
    "cpuadam_cores_perc": (
        lambda c: 0.9 if _offload_opt(c) is None else _offload_opt(c).cpuadam_cores_perc,
        "`offload_optimizer.cpuadam_cores_perc` (0.9 without the section)",
    ),  # fmt: skip
    "super_offload": (
        lambda c: _offload_opt(c) is not None and _offload_opt(c).super_offload,
        "`offload_optimizer.super_offload`",
    ),  # fmt: skip
    "curriculum_learning_enabled": (lambda c: False, "False: zero refuses an enabled curriculum_learning"),
    "data_efficiency_enabled": (lambda c: False, "False: zero refuses an enabled data_efficiency"),
    "data_sampling_enabled": (lambda c: False, "False: zero refuses an enabled data_efficiency"),
    "random_ltd_enabled": (lambda c: False, "False: zero refuses an enabled data_efficiency (random-LTD)"),
    "dataloader_drop_last": (lambda c: False, "False: zero refuses dataloader_drop_last true"),
    "dump_state": (lambda c: False, "False (DeepSpeed's default)"),
    "flops_profiler_enabled": (
        lambda c: c.flops_profiler.enabled or c.autotuning.enabled,
        "`flops_profiler.enabled` or autotuning on",
    ),  # fmt: skip
    "flops_profiler_recompute_fwd_factor": (
        lambda c: c.flops_profiler.recompute_fwd_factor,
        "`flops_profiler.recompute_fwd_factor`",
    ),  # fmt: skip
    "flops_profiler_profile_step": (
        lambda c: c.autotuning.start_profile_step if c.autotuning.enabled else c.flops_profiler.profile_step,
        "`flops_profiler.profile_step` (autotuning's start step when autotuning)",
    ),  # fmt: skip
    "flops_profiler_module_depth": (lambda c: c.flops_profiler.module_depth, "`flops_profiler.module_depth`"),
    "flops_profiler_top_modules": (lambda c: c.flops_profiler.top_modules, "`flops_profiler.top_modules`"),
    "flops_profiler_detailed": (
        lambda c: False if c.autotuning.enabled else c.flops_profiler.detailed,
        "`flops_profiler.detailed` (False when autotuning)",
    ),  # fmt: skip
    "flops_profiler_output_file": (lambda c: c.flops_profiler.output_file, "`flops_profiler.output_file`"),
    "fp16_auto_cast": (lambda c: c.fp16.auto_cast, "`fp16.auto_cast`"),
    "fp16_master_weights_and_gradients": (lambda c: False, "False: master weights and gradients are fp32"),
    "get_data_types": (_data_types, "(model dtype, gradient accumulation dtype) as torch dtypes"),
    "gradient_predivide_factor": (lambda c: c.gradient_predivide_factor, "`gradient_predivide_factor`"),
    "postscale_gradients": (lambda c: not c.prescale_gradients, "not `prescale_gradients`"),
    "is_sanity_checks_enabled": (lambda c: False, "False (DeepSpeed's default enable_sanity_checks)"),
    "load_universal_checkpoint": (lambda c: c.checkpoint.load_universal, "`checkpoint.load_universal`"),  # fmt: skip
    "use_node_local_storage": (
        lambda c: c.checkpoint.use_node_local_storage,
        "`checkpoint.use_node_local_storage`",
    ),  # fmt: skip
    "log_level": (lambda c: c.log_level, "`log_level` (None: unset)"),
    "managed_gradient_accumulation": (
        lambda c: c.managed_gradient_accumulation,
        "`managed_gradient_accumulation`",
    ),  # fmt: skip
    "memory_breakdown": (lambda c: c.memory_breakdown, "`memory_breakdown`"),
    "steps_per_print": (lambda c: c.steps_per_print, "`steps_per_print` (None: never)"),
    "wall_clock_breakdown": (lambda c: c.wall_clock_breakdown, "`wall_clock_breakdown`"),
    "optimizer_params": (
        lambda c: None if c.optimizer is None else dict(c.optimizer.params),
        "`optimizer.params` (None without the section)",
    ),  # fmt: skip
    "optimizer_legacy_fusion": (lambda c: False, "False (DeepSpeed's default `optimizer.legacy_fusion`)"),
    "scheduler_name": (lambda c: None if c.scheduler is None else c.scheduler.type, "`scheduler.type`"),
    "scheduler_params": (lambda c: None if c.scheduler is None else dict(c.scheduler.params), "`scheduler.params`"),
    "tensor_parallel_config": (lambda c: c.tensor_parallel, "the `tensor_parallel` section"),
    "torch_autocast_enabled": (lambda c: c.torch_autocast.enabled, "`torch_autocast.enabled`"),
    "torch_autocast_dtype": (
        lambda c: _DTYPES.get(c.torch_autocast.dtype, torch.bfloat16),
        "`torch_autocast.dtype` as a torch dtype",
    ),  # fmt: skip
    "zenflow_config": (lambda c: c.zero_optimization.zenflow, "the `zero_optimization.zenflow` section or None"),
    "zero_allow_untested_optimizer": (lambda c: c.zero_allow_untested_optimizer, "`zero_allow_untested_optimizer`"),
    "zero_force_ds_cpu_optimizer": (lambda c: c.zero_force_ds_cpu_optimizer, "`zero_force_ds_cpu_optimizer`"),
    "zero_allgather_bucket_size": (lambda c: _zo(c).allgather_bucket_size, "`allgather_bucket_size`"),
    "zero_allgather_partitions": (lambda c: _zo(c).allgather_partitions, "`allgather_partitions`"),
    "zero_allgather_sequential": (lambda c: False, "False (DeepSpeed's default stage3_allgather_sequential)"),
    "zero_compute_grad_norm": (lambda c: True, "True: the gradient norm is always computed"),
    "zero_contiguous_gradients": (lambda c: _zo(c).contiguous_gradients, "`contiguous_gradients`"),
    "zero_cpu_offload": (lambda c: _offload_device(c, "offload_optimizer") == "cpu", "optimizer offload to cpu"),
    "zero_use_cpu_optimizer": (
        lambda c: _offload_device(c, "offload_optimizer") in ("cpu", "nvme"),
        "optimizer offload to cpu or nvme",
    ),  # fmt: skip
    "zero_nvme_offload_optimizer": (
        lambda c: _offload_device(c, "offload_optimizer") == "nvme",
        "optimizer states swapped to NVMe",
    ),  # fmt: skip
    "zero_offload_optimizer": (lambda c: _zo(c).offload_optimizer, "the `offload_optimizer` section or None"),
    "zero_offload_param": (lambda c: _zo(c).offload_param, "the `offload_param` section or None"),
    "zero_partial_offload": (
        lambda c: 1.0 if _offload_opt(c) is None else _offload_opt(c).ratio,
        "`offload_optimizer.ratio` (1.0 without the section)",
    ),  # fmt: skip
    "zero_elastic_checkpoint": (lambda c: _zo(c).elastic_checkpoint, "`elastic_checkpoint`"),
    "zero_hpz_partition_size": (lambda c: _zo(c).zero_hpz_partition_size, "`zero_hpz_partition_size`"),
    "zero_ignore_unused_parameters": (lambda c: _zo(c).ignore_unused_parameters, "`ignore_unused_parameters`"),
    "zero_legacy_stage1": (lambda c: False, "False (DeepSpeed's default legacy_stage1)"),
    "zero_load_from_fp32_weights": (lambda c: _zo(c).load_from_fp32_weights, "`load_from_fp32_weights`"),
    "zero_log_trace_cache_warnings": (lambda c: False, "False (DeepSpeed's default log_trace_cache_warnings)"),
    "zero_max_live_parameters": (lambda c: _zo(c).stage3_max_live_parameters, "`stage3_max_live_parameters`"),
    "zero_max_reuse_distance": (lambda c: _zo(c).stage3_max_reuse_distance, "`stage3_max_reuse_distance`"),
    "zero_model_persistence_threshold": (
        lambda c: sys.maxsize,
        "sys.maxsize (DeepSpeed's default stage3_model_persistence_threshold)",
    ),
    "zero_module_granularity_threshold": (
        lambda c: _zo(c).stage3_module_granularity_threshold,
        "`stage3_module_granularity_threshold`",
    ),  # fmt: skip
    "zero_multi_rank_bucket_allreduce": (lambda c: True, "True (DeepSpeed's default)"),
    "zero_overlap_comm": (lambda c: _zo(c).overlap, "`overlap_comm` (default True at stage 3, else False)"),
    "zero_param_persistence_threshold": (
        lambda c: _zo(c).stage3_param_persistence_threshold,
        "`stage3_param_persistence_threshold`",
    ),  # fmt: skip
    "zero_parameter_alignment": (lambda c: False, "False (DeepSpeed's default parameter_alignment)"),
    "zero_prefetch_bucket_size": (lambda c: _zo(c).stage3_prefetch_bucket_size, "`stage3_prefetch_bucket_size`"),
    "zero_quantized_gradients": (lambda c: _zo(c).zero_quantized_gradients, "`zero_quantized_gradients`"),
    "zero_quantized_nontrainable_weights": (
        lambda c: _zo(c).zero_quantized_nontrainable_weights,
        "`zero_quantized_nontrainable_weights`",
    ),  # fmt: skip
    "zero_quantized_weights": (lambda c: _zo(c).zero_quantized_weights, "`zero_quantized_weights`"),
    "zero_reduce_bucket_size": (lambda c: _zo(c).reduce_bucket_size, "`reduce_bucket_size`"),
    "zero_reduce_scatter": (lambda c: _zo(c).reduce_scatter, "`reduce_scatter`"),
    "zero_round_robin_gradients": (lambda c: _zo(c).round_robin_gradients, "`round_robin_gradients`"),
    "zero_save_muon_momentum_buffer_in_memory": (
        lambda c: _zo(c).save_muon_momentum_buffer_in_memory,
        "`save_muon_momentum_buffer_in_memory`",
    ),  # fmt: skip
    "zero_sub_group_size": (lambda c: _zo(c).sub_group_size, "`sub_group_size`"),
}
"""DeepSpeed getter name -> (function of the EngineConfig, what it returns; backticked keys are config keys,
``zero_*`` ones inside ``zero_optimization``)."""


def _getter(name: str, read: Callable, what: str):
    def getter(self):
        return read(self.config)

    getter.__name__ = getter.__qualname__ = name
    getter.__doc__ = f"DeepSpeed's ``engine.{name}()``: {what}."
    return getter


ConfigGettersMixin = type(
    "ConfigGettersMixin",
    (),
    {
        "__doc__": "DeepSpeed's config getters (:data:`GETTERS`) on the engine; expects ``self.config``.",
        "__module__": __name__,
        **{name: _getter(name, read, what) for name, (read, what) in GETTERS.items()},
    },
)
