"""The DeepSpeed 0.19.8 names and integrations zero serves, with their status: the source of the README table.

``SUPPORTED``: names that resolve through ``import zero as deepspeed`` and that the compatibility test exercises
by value (``packages/zero/tests/test_deepspeed_api.py`` checks that every one of them was used).
``NOT_YET``: names that raise :class:`~zero.compat.UnsupportedName` naming what to use instead.
``INTEGRATIONS``: third-party integrations, each with the test that runs it.
"""

from __future__ import annotations

SUPPORTED = [
    "deepspeed.initialize",
    "deepspeed.tp_model_init",
    "deepspeed.init_inference",
    "deepspeed.InferenceEngine",
    "deepspeed.inference.engine.InferenceEngine",
    "deepspeed.inference.config.DeepSpeedInferenceConfig",
    "deepspeed.init_distributed",
    "deepspeed.add_config_arguments",
    "deepspeed.DeepSpeedEngine",
    "deepspeed.DeepSpeedHybridEngine",
    "deepspeed.runtime.hybrid_engine.DeepSpeedHybridEngine",
    "deepspeed.DeepSpeedConfig",
    "deepspeed.checkpointing.checkpoint",
    "deepspeed.runtime.activation_checkpointing.checkpointing.checkpoint",
    "deepspeed.zero.Init",
    "deepspeed.zero.GatheredParameters",
    "deepspeed.zero.register_external_parameter",
    "deepspeed.zero.ZeroParamStatus",
    "deepspeed.runtime.zero.partition_parameters.ZeroParamStatus",
    "deepspeed.comm.get_rank",
    "deepspeed.comm.get_world_size",
    "deepspeed.comm.get_local_rank",
    "deepspeed.comm.barrier",
    "deepspeed.comm.all_reduce",
    "deepspeed.comm.all_gather",
    "deepspeed.comm.broadcast",
    "deepspeed.comm.all_gather_into_tensor",
    "deepspeed.comm.reduce_scatter_tensor",
    "deepspeed.comm.all_to_all_single",
    "deepspeed.comm.send",
    "deepspeed.comm.recv",
    "deepspeed.comm.isend",
    "deepspeed.comm.irecv",
    "deepspeed.comm.init_distributed",
    "deepspeed.comm.is_initialized",
    "deepspeed.comm.ReduceOp",
    "deepspeed.comm.all_gather_object",
    "deepspeed.comm.broadcast_object_list",
    "deepspeed.comm.reduce",
    "deepspeed.ops.adam.DeepSpeedCPUAdam",
    "deepspeed.ops.adam.FusedAdam",
    "deepspeed.profiling.flops_profiler.get_model_profile",
    "deepspeed.profiling.flops_profiler.FlopsProfiler",
    "deepspeed.utils.safe_get_full_grad",
    "deepspeed.utils.safe_get_full_fp32_param",
    "deepspeed.utils.safe_get_full_optimizer_state",
    "deepspeed.utils.safe_set_full_fp32_param",
    "deepspeed.utils.safe_set_full_optimizer_state",
    "deepspeed.utils.safe_set_full_grad",
    "deepspeed.utils.safe_get_local_fp32_param",
    "deepspeed.utils.safe_get_local_grad",
    "deepspeed.utils.safe_get_local_optimizer_state",
    "deepspeed.utils.safe_set_local_fp32_param",
    "deepspeed.utils.safe_set_local_grad",
    "deepspeed.utils.safe_set_local_optimizer_state",
    "deepspeed.utils.set_z3_leaf_modules",
    "deepspeed.utils.unset_z3_leaf_modules",
    "deepspeed.utils.get_z3_leaf_modules",
    "deepspeed.utils.z3_leaf_module",
    "deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint",
    "deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict",
    "deepspeed.utils.zero_to_fp32.load_state_dict_from_zero_checkpoint",
    "deepspeed.accelerator.get_accelerator",
    "deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs_all_live",
    "deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_live",
    "DeepSpeedEngine.module",
    "DeepSpeedEngine.optimizer",
    "DeepSpeedEngine.lr_scheduler",
    "DeepSpeedEngine.global_steps",
    "DeepSpeedEngine.global_samples",
    "DeepSpeedEngine.is_gradient_accumulation_boundary",
    "DeepSpeedEngine.set_gradient_accumulation_boundary",
    "DeepSpeedEngine.zero_optimization_stage",
    "DeepSpeedEngine.gradient_accumulation_steps",
    "DeepSpeedEngine.train_micro_batch_size_per_gpu",
    "DeepSpeedEngine.train_batch_size",
    "DeepSpeedEngine.local_rank",
    "DeepSpeedEngine.device",
    "DeepSpeedEngine.no_sync",
    "DeepSpeedEngine.save_checkpoint",
    "DeepSpeedEngine.load_checkpoint",
    "DeepSpeedEngine.save_16bit_model",
    "DeepSpeedEngine.destroy",
    "DeepSpeedEngine.compile",
    "DeepSpeedEngine.get_lr",
    "DeepSpeedEngine.get_global_grad_norm",
    "DeepSpeedEngine.empty_partition_cache",
]

TOP_LEVEL_UNSUPPORTED = {
    "DeepSpeedTransformerLayer": "DeepSpeed's fused transformer kernels are not implemented; use transformers",
    "compression": "the compression library is not implemented; use torch.ao.quantization",
}

NOT_YET = [f"deepspeed.{n}" for n in sorted(TOP_LEVEL_UNSUPPORTED)] + [
    "deepspeed.zero.TiledLinear",
    "deepspeed.comm.all_to_all",
    "deepspeed.ops.lamb",
    "deepspeed.ops.lion",
    "deepspeed.ops.adagrad",
    "deepspeed.utils.OnDevice",
    "deepspeed.utils.safe_update_full_grad_vectorized",
    "deepspeed.accelerator.set_accelerator",
]

IMPORT_PATHS = [
    ("deepspeed.utils.groups", "`_get_expert_parallel_*`, `_get_expert_data_parallel_*` and the other expert "
     "group getters (zero_parallel.moe.groups; made by the MoE layers at `initialize`), "
     "`_get_data_parallel_*`, `_get_sequence_parallel_group/world_size/rank`, "
     "`_get_sequence_data_parallel_*`: from the sequence-parallel mpu given to `initialize(mpu=...)` (the HF "
     "Trainer's sp loss), else the whole world with sequence parallelism of size 1 (transformers, Accelerate); "
     "`get_tensor_model_parallel_group/world_size/rank/src_rank`, `get_model_parallel_*`, "
     "`_get_model_parallel_world_size` and the data-parallel getters answer for the AutoTP mesh after "
     "`initialize` with `tensor_parallel.autotp_size` > 1"),
    ("deepspeed.utils.logger", "zero's logger (transformers)"),
    ("deepspeed.pipe.PipelineModule", "zero_parallel's pipeline module: `initialize` returns a PipelineEngine for it"),
    ("deepspeed.runtime.pipe.engine.PipelineEngine", "zero's pipeline engine (train_batch / eval_batch)"),
    ("deepspeed.moe.layer.MoE", "zero_parallel's MoE layer (Megatron-DeepSpeed): DeepSpeed's arguments and module "
     "layout, top-1/2/k gating with its capacity and drop rules, experts spread over `ep_size` ranks; "
     "`initialize` trains it at ZeRO 0-3 (also `deepspeed.moe.sharded_moe.TopKGate`, `MOELayer`, "
     "`deepspeed.moe.experts.Experts`)"),
    ("deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer", "expert parameters in optimizer "
     "groups of their own (also `is_moe_param`, `configure_moe_param_groups`, `has_moe_layers`)"),
    ("deepspeed.runtime.engine.DeepSpeedEngine", "zero's engine class (TRL, PEFT)"),
    ("deepspeed.runtime.utils.move_to_device", "DeepSpeed's helper (Accelerate)"),
    ("deepspeed.runtime.zero.partition_parameters", "stage-3 partitioning module (transformers)"),
    ("deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES", "the scheduler names (Accelerate)"),
    ("deepspeed.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME", "DeepSpeed's value (`accelerate launch`)"),
    ("deepspeed.checkpoint.utils.clone_tensors_for_torch_save", "DeepSpeed's helper (Accelerate)"),
    ("deepspeed.accelerator.get_accelerator", "CUDA or the CPU (transformers)"),
    ("deepspeed.ops.adam.DeepSpeedCPUAdam", "zero's CPU Adam (Accelerate)"),
    ("deepspeed.comm", "zero's collectives (Accelerate)"),
    ("deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF", "zero_parallel's Ulysses attention "
     "adapter: `register_with_transformers` for sdpa and flex_attention, returns the sequence-parallel mpu "
     "(Accelerate's `sp_backend=\"deepspeed\"`), which `initialize(mpu=...)` takes: ZeRO over sp x dp"),
    ("deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPDataLoaderAdapter", "zero_parallel's loader adapter: "
     "each batch sharded along the sequence, `labels` replaced by pre-shifted `shift_labels` (Accelerate)"),
    ("deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP", "zero_parallel's tiled MLP (ALST): the sequence in "
     "tiles, recomputed tile by tile in backward; `compute_params` gathered once per pass under ZeRO-3"),
    ("deepspeed.runtime.sequence_parallel.ulysses_sp.TiledFusedLogitsLoss", "zero_parallel's tiled logits loss "
     "(ALST): never the whole logits tensor; gradients taken tile by tile in forward"),
    ("deepspeed.runtime.sequence_parallel.ulysses_sp.SequenceTiledCompute", "zero_parallel's generic sequence-tiled "
     "compute (also `sequence_tiled_compute`), recomputed tile by tile in backward"),
    ("deepspeed.zero.unwrap_model_for_generation", "gathers the whole model for generation (ZeRO-3), as "
     "DeepSpeed's; zero's hooks leave gathered units alone, so none are removed"),
    ("deepspeed.runtime.zero.offload_config.OffloadStateTypeEnum", "the state kinds of `engine.offload_states()` "
     "(also `OffloadDeviceEnum`; OpenRLHF, ROLL, SkyRL): the named states' storages freed into host copies"),
    ("deepspeed.module_inject.layers.GatherReplacedLayerParams", "full tensors of an AutoTP-split layer's "
     "parameters inside, shards again on exit (at ZeRO-3 inside `zero.GatheredParameters`, as DeepSpeed nests "
     "them); kernel injection is `init_inference(replace_with_kernel_inject=True)`'s"),
    ("deepspeed.git_version_info.torch_info", "DeepSpeed's build record for the running torch (also `version`)"),
    ("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3", "an `isinstance` check true for a stage-3 "
     "engine's optimizer (also `stage_1_and_2.DeepSpeedZeroOptimizer` for stages 1-2, "
     "`parameter_offload.DeepSpeedZeRoOffload`, `utils.get_mapping_to_flat_buffer`; ROLL)"),
    ("deepspeed.runtime.activation_checkpointing.offload_activations.CheckpointHiddenStatesOffload", "zero's "
     "offload of checkpointed hidden states (ALST): each gradient-checkpointed layer's input kept in host memory "
     "until its recompute; also `get_checkpoint_hidden_states_offloading_ctx_manager`"),
]  # fmt: skip
"""Module paths that transformers, Accelerate, TRL and PEFT import, each with what zero serves there; every
``NOT_YET`` name also raises its ``NotSupportedError`` on ``from deepspeed.X import Y``."""

HF = "packages/zero/tests/test_hf_integration.py"
INTEGRATIONS = [
    (
        "`zero.install_as_deepspeed()` / `zero run --as-deepspeed`: `import deepspeed` served by zero, opt-in",
        "supported",
        "packages/zero/tests/test_as_deepspeed.py",
    ),
    (
        "transformers `is_deepspeed_available()`, Accelerate's DeepSpeed version checks",
        "supported",
        "packages/zero/tests/test_as_deepspeed.py",
    ),
    (
        'HF Trainer, `TrainingArguments(deepspeed=config)` at ZeRO-2 and 3 with "auto" values (equal its DDP run)',
        "supported",
        HF,
    ),
    ("HF Trainer `save_model` (consolidated weights) loading with `from_pretrained`", "supported", HF),
    ("HF Trainer `resume_from_checkpoint` (bitwise), with gradient checkpointing", "supported", HF),
    ("`from_pretrained` under ZeRO-3 (partitioned loading through `zero.Init`)", "supported", HF),
    (
        "Accelerate `DeepSpeedPlugin` at ZeRO-2: `prepare`, `backward`, `save_state` (equals its DDP run)",
        "supported",
        HF,
    ),
    (
        "`engine.save_checkpoint(..., exclude_frozen_parameters=True)` (what Trainer passes for PEFT models): frozen "
        "parameters left out, kept by load, omitted by `zero_to_fp32`",
        "supported",
        "tests-integration/test_checkpoint_frozen.py",
    ),
    (
        "`initialize()` without an optimizer (ZeRO-Inference: TRL's reference/teacher models), stage 3 partitioned "
        "with offload_param; several engines in one process (student/teacher, policy/reference)",
        "supported",
        "packages/zero/tests/test_inference_engine.py, packages/zero/tests/test_two_engines.py",
    ),
    ("HF Trainer `evaluate()` without training at ZeRO-3 (equals the unsharded eval loss)", "supported", HF),
    (
        "HF Trainer with Accelerate's DeepSpeed sequence parallelism, `TrainingArguments(parallelism_config="
        'ParallelismConfig(sp_backend="deepspeed", sp_size=2, sp_handler=DeepSpeedSequenceParallelConfig(...)))` '
        "at ZeRO-3 on 2 ranks (equals the run without sp; the dataset must give `position_ids`)",
        "supported",
        "packages/zero/tests/test_hf_sequence_parallel.py",
    ),
    (
        "PEFT at ZeRO-3: parameter count through `ds_numel`; `ds_*` attributes and `ZeroParamStatus` as TRL and "
        "PEFT read them; `copy.deepcopy` of a partitioned module (`modules_to_save`)",
        "supported",
        "packages/zero/tests/test_partitioned_param_attrs.py, packages/zero/tests/test_partitioned_copy.py",
    ),
    (
        "TRL's `unwrap_model_for_generation` at ZeRO-3 (`GatheredParameters`, `optimizer.parameter_offload` hooks), "
        "device or CPU-Adam optimizer",
        "supported",
        "packages/zero/tests/test_generation_stage3.py",
    ),
    (
        "TRL `SFTTrainer` at ZeRO-3 and `DPOTrainer` with a reference model (TRL's `prepare_deepspeed`: whole at "
        "ZeRO-2, partitioned at ZeRO-3) at ZeRO-2 and 3, the config in `SFTConfig`/`DPOConfig(deepspeed=...)`, "
        "under `zero run --as-deepspeed` (equal their DDP runs)",
        "supported",
        "packages/zero/tests/test_trl_trainers.py",
    ),
    (
        "`accelerate launch --use_deepspeed` / `--config_file` with a DeepSpeed section, after "
        "`PYTHONPATH=$(python -m zero.compat):$PYTHONPATH` (equals its DDP run; without CUDA the script needs "
        '`PartialState(backend="gloo")` first)',
        "supported",
        "packages/zero/tests/test_accelerate_launch.py",
    ),
    ("Accelerate at ZeRO-3; Trainer with a PEFT model end to end", "not yet tested", "-"),
    (
        "Trainer with a DeepSpeed config on a machine without CUDA: pass `use_cpu=True` to `TrainingArguments` "
        '(equals its DDP run); Accelerate alone: `PartialState(backend="gloo")` first (their own limit, with a '
        "real DeepSpeed too)",
        "workaround",
        "packages/zero/tests/test_hf_cpu_trainer.py",
    ),
]


def status_table() -> str:
    """The README's compatibility table (markdown), from the lists above."""
    lines = ["| DeepSpeed name | status |", "|---|---|"]
    lines += [f"| `{n}` | supported |" for n in SUPPORTED]
    lines += [f"| `{n}` | not yet (raises `NotSupportedError` naming the alternative) |" for n in NOT_YET]
    lines += ["", "| module path integrations import | what zero serves |", "|---|---|"]
    lines += [f"| `{path}` | {what} |" for path, what in IMPORT_PATHS]
    lines += ["", "| integration | status | test |", "|---|---|---|"]
    lines += [f"| {what} | {status} | `{test}` |" for what, status, test in INTEGRATIONS]
    return "\n".join(lines)
