"""The DeepSpeed 0.19.8 engine names zero does not serve, each with what to use instead, and the engine's
``__getattr__`` that refuses them with :class:`~zero.compat.unsupported.UnsupportedName` (a NotSupportedError, and an
AttributeError so ``hasattr`` probes answer "absent") and passes any other unknown name to the wrapped module, as
DeepSpeed's engine does (``model.id = 3`` -> ``engine.id == 3``).
"""

from __future__ import annotations

from zero.compat.unsupported import UnsupportedName

_REDUCE = ("DeepSpeed's stage-0 gradient reduction internals; zero reduces gradients inside engine.backward() at "
           "each accumulation boundary (deepspeed.comm.all_reduce for your own tensors)")  # fmt: skip
_TIMERS = ("DeepSpeed's timer objects; set \"wall_clock_breakdown\": true in the config for zero's forward / backward "
           "/ step timers (zero_profiler.Timers, logged every steps_per_print), and engine.comms_summary() reports "
           "collectives (comms_logger.enabled)")  # fmt: skip
_DEEPCOMPILE = "DeepCompile's internals; zero compiles from the config's compile section, or call engine.compile()"
_DATA_EFFICIENCY = "zero has no data efficiency library (data_efficiency is refused); order the data yourself"
_CKPT_ROLE = ("DeepSpeed's per-rank checkpoint roles; every zero rank writes its own shard in "
              "engine.save_checkpoint()")  # fmt: skip

REFUSED: dict[str, str] = {
    "all_gather_scalar": _REDUCE,
    "allreduce_and_copy": _REDUCE,
    "allreduce_bucket": _REDUCE,
    "allreduce_no_retain": _REDUCE,
    "buffered_allreduce_fallback": _REDUCE,
    "sparse_all_gather": _REDUCE,
    "sparse_allreduce": _REDUCE,
    "sparse_allreduce_bucket": _REDUCE,
    "sparse_allreduce_no_retain": _REDUCE,
    "clip_fp32_gradients": "DeepSpeed's stage-0 clipping internal; zero clips in step() by gradient_clipping",
    "all_to_all_group": "ZeRO++ qgZ's groups are internal to zero_core; set zero_optimization.zero_quantized_gradients",
    "local_all_to_all_group": "ZeRO++ qgZ's groups are internal to zero_core",
    "checkpoint_engine": "zero's checkpoints are written by engine.save_checkpoint()/load_checkpoint() (no engine "
    "object to plug in)",
    "save_non_zero_checkpoint": _CKPT_ROLE,
    "save_zero_checkpoint": _CKPT_ROLE,
    "loaded_checkpoint_dp_world_size": "zero reshards a checkpoint to the current ranks on load; the saved world "
    "size is in the checkpoint's metadata",
    "loaded_checkpoint_mp_world_size": "zero reshards a checkpoint to the current ranks on load",
    "engine_timers": _TIMERS,
    "engine_timers_cache": _TIMERS,
    "timers": _TIMERS,
    "tput_timer": _TIMERS,
    "get_wall_clock_timers": _TIMERS,
    "print_forward_breakdown": _TIMERS,
    "get_autosp_backend": _DEEPCOMPILE,
    "get_autotp_backend": _DEEPCOMPILE,
    "get_deepcompile_backend": _DEEPCOMPILE,
    "get_deepspeed_compile_backend": _DEEPCOMPILE,
    "register_compile_pass": _DEEPCOMPILE,
    "get_compile_time": _DEEPCOMPILE,
    "get_optimizer_configuration": "DeepSpeed's optimizer-building internal; give the config an 'optimizer' "
    "section or pass an optimizer to initialize()",
    "load_moe_state_dict": "zero has no expert parallelism (moe is refused); MoE layers are plain modules, loaded "
    "by load_checkpoint()",
    "curriculum_learning_config": _DATA_EFFICIENCY,
    "data_efficiency_config": _DATA_EFFICIENCY,
    "data_sampling_config": _DATA_EFFICIENCY,
    "random_ltd_config": _DATA_EFFICIENCY,
    "random_ltd_initialize": _DATA_EFFICIENCY,
    "set_data_post_process_func": "zero's training_dataloader is a torch DataLoader; apply the function in your "
    "collate_fn or loop",
    "swap_tensor_config": "zero has no swap_tensor section; NVMe offload is set in zero_optimization.offload_*",
    "module_forward_pre_hook": "DeepSpeed's internal forward hooks; register your own on engine.module",
    "module_forward_post_hook": "DeepSpeed's internal forward hooks; register your own on engine.module",
    "scale": "zero supports no manual loss.backward(); call engine.backward(loss), which applies the loss scale",
    "torch_autocast_z0_gradscaler": "zero's torch_autocast has no separate GradScaler; the loss scale is "
    "engine.optimizer.loss_scaler",
}
"""DeepSpeed engine name -> why zero lacks it and what to use instead."""


def refuse_or_forward(engine: object, module: object, name: str):
    """What ``engine.<name>`` is when the engine itself has no such attribute: UnsupportedName for a name in
    :data:`REFUSED`, the wrapped ``module``'s attribute when it has one, else AttributeError (DeepSpeed's)."""
    if name in REFUSED:
        raise UnsupportedName(f"engine.{name} (DeepSpeed's) is not supported by zero: {REFUSED[name]}")
    if module is not None and not name.startswith("__"):
        try:
            return getattr(module, name)
        except AttributeError:
            pass
    raise AttributeError(f"'{type(engine).__name__}' object has no attribute '{name}'")
