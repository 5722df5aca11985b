"""Small DeepSpeed config sections: fp16, bf16, flops_profiler, comms_logger, checkpoint (DeepSpeed key names)."""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveInt

_STRICT = pydantic.ConfigDict(extra="forbid")


class FP16Section(pydantic.BaseModel):
    """`fp16`: half-precision training with a loss scale. ``loss_scale: 0`` means dynamic scaling.

    Dynamic scaling starts at ``2**initial_scale_power``, halves on an overflow once ``hysteresis`` overflows are
    used up, doubles after ``loss_scale_window`` clean steps, never below ``min_loss_scale`` (DeepSpeed semantics).
    """

    model_config = _STRICT
    enabled: bool = False
    auto_cast: bool = False
    loss_scale: NonNegativeFloat = 0.0
    initial_scale_power: NonNegativeInt = 16
    loss_scale_window: PositiveInt = 1000
    hysteresis: PositiveInt = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = Field(default=1.0, gt=0)


class BF16Section(pydantic.BaseModel):
    """`bf16`: bfloat16 parameters/communication with fp32 master weights; no loss scaling.

    On CPUs without bf16 matrix units zero keeps compute in fp32 and uses bf16 for storage and communication.
    """

    model_config = _STRICT
    enabled: bool = False
    immediate_grad_update: bool = Field(False, description="DeepSpeed's bf16 optimizer adds each micro-batch's "
        "gradient into the fp32 gradient during backward when true; zero adds every micro-batch's gradient into its "
        "accumulation store (data_types.grad_accum_dtype, fp32 by default) as it is produced either way: no "
        "effect here.")  # fmt: skip


class FlopsProfilerSection(pydantic.BaseModel):
    """`flops_profiler`: profile one step (``profile_step``) and print a per-module table (DeepSpeed's keys)."""

    model_config = _STRICT
    enabled: bool = False
    recompute_fwd_factor: NonNegativeFloat = 0.0
    profile_step: PositiveInt = 1
    module_depth: int = -1
    top_modules: PositiveInt = 1
    detailed: bool = True
    output_file: str | None = None


class CommsLoggerSection(pydantic.BaseModel):
    """`comms_logger`: count, bytes and latency per collective (zero-comm's logger)."""

    model_config = _STRICT
    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    debug: bool = False
    prof_ops: list[str] = Field(default_factory=list)


class CheckpointSection(pydantic.BaseModel):
    """`checkpoint`: tag validation across ranks (Ignore/Warn/Fail), loading of the universal format, and zero's own
    ``format`` key (DeepSpeed has none): ``"zero"`` (default, sharded safetensors) or ``"deepspeed"`` (DeepSpeed
    0.19.8's ZeRO layout, which DeepSpeed's ``load_checkpoint`` and ``zero_to_fp32.py`` read; stages 1-3, fp32/bf16)
    or ``"universal"`` (DeepSpeed's universal checkpoint, what its offline ``ds_to_universal`` makes, with
    ``latest_universal``: loaded with ``load_universal: true`` on any number of ranks)."""

    model_config = _STRICT
    tag_validation: Literal["Ignore", "Warn", "Fail", "ignore", "warn", "fail", "IGNORE", "WARN", "FAIL"] = "Warn"
    load_universal: bool = False
    use_node_local_storage: bool = False
    format: Literal["zero", "deepspeed", "universal"] = "zero"


class ActivationCheckpointingSection(pydantic.BaseModel):
    """`activation_checkpointing`: the options of ``zero.activation_checkpointing.api`` (DeepSpeed's
    ``deepspeed.checkpointing``), read by its ``configure(mpu, deepspeed_config=...)`` as DeepSpeed's engine leaves
    it to the script: ``partition_activations`` (inputs sliced over the model-parallel group), ``cpu_checkpointing``
    (kept in host memory), ``contiguous_memory_optimization`` (one preallocated buffer of ``number_checkpoints`` slots),
    ``synchronize_checkpoint_boundary`` (accelerator sync around each segment), ``profile`` (seconds per segment).
    """

    model_config = _STRICT
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: PositiveInt | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False
