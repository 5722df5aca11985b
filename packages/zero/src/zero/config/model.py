"""The whole DeepSpeed-style config: the top-level model and ``load_config`` (dict or JSON path -> validated)."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Literal

import pydantic
from pydantic import Field, NonNegativeFloat, PositiveFloat, PositiveInt

from zero.config.aio import AioSection
from zero.config.autocast_section import TorchAutocastSection
from zero.config.autotuning import AutotuningSection
from zero.config.batch import BatchSizes, resolve_batch
from zero.config.compile_section import CompileSection, TorchCompileSection, check_compile
from zero.config.data_types import DataTypesSection, check_data_types
from zero.config.dotted import drop_dotted_keys
from zero.config.errors import ConfigError, NotSupportedError, format_validation_error
from zero.config.expert_parallel_section import ExpertParallelSection
from zero.config.hybrid_section import HybridEngineSection
from zero.config.legacy import fill_auto, migrate_deprecated, reject_unsupported
from zero.config.offload_auto import resolve_offload_auto
from zero.config.optim_sections import OptimizerSection, SchedulerSection
from zero.config.quantization_section import QuantizationSection, check_quantization
from zero.config.recent_keys import RecentTopLevelKeys, check_recent_keys
from zero.config.sections import (
    ActivationCheckpointingSection,
    BF16Section,
    CheckpointSection,
    CommsLoggerSection,
    FlopsProfilerSection,
    FP16Section,
)
from zero.config.tensor_parallel_section import TensorParallelSection
from zero.monitoring.config import CometSection, CSVSection, TensorBoardSection, WandbSection

try:  # zero_core owns the `zero_optimization` section; embed its model, never a copy.
    from zero_core import ZeroConfig as ZeroSection
except ImportError:
    from zero_core.config import ZeroConfig as ZeroSection


class EngineConfig(RecentTopLevelKeys):
    """A DeepSpeed JSON config as zero implements it (DeepSpeed's key names and defaults).

    Build it with :func:`load_config`, which also resolves the batch triple (``.batch``) for a world size.
    Unknown keys are errors (with the nearest valid key); so are keys of features zero lacks.
    ``communication_data_type`` ("fp32"/"fp16"/"bf16", DeepSpeed's key) is the gradient reduction dtype (default:
    the parameter dtype); see ``zero.engine.precision`` for how fp16/bf16 map to zero_core's PrecisionPolicy.
    """

    model_config = pydantic.ConfigDict(extra="forbid")
    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int | None = None
    gradient_accumulation_steps: int | None = None
    optimizer: OptimizerSection | None = None
    scheduler: SchedulerSection | None = None
    fp16: FP16Section = Field(default_factory=FP16Section)
    bf16: BF16Section = Field(default_factory=BF16Section)
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = None
    data_types: DataTypesSection = Field(default_factory=DataTypesSection)
    activation_checkpointing: ActivationCheckpointingSection = Field(default_factory=ActivationCheckpointingSection)
    zero_optimization: ZeroSection = Field(default_factory=ZeroSection)
    aio: AioSection = Field(default_factory=AioSection)
    gradient_clipping: NonNegativeFloat = 1.0  # DeepSpeed 0.19.8's GRADIENT_CLIPPING_DEFAULT; 0: off
    steps_per_print: PositiveInt | None = None  # DeepSpeed 0.19.8: None, no periodic report
    wall_clock_breakdown: bool = False
    memory_breakdown: bool = False
    flops_profiler: FlopsProfilerSection = Field(default_factory=FlopsProfilerSection)
    comms_logger: CommsLoggerSection = Field(default_factory=CommsLoggerSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    tensorboard: TensorBoardSection = Field(default_factory=TensorBoardSection)  # monitors: zero.monitoring
    wandb: WandbSection = Field(default_factory=WandbSection)
    csv_monitor: CSVSection = Field(default_factory=CSVSection)
    comet: CometSection = Field(default_factory=CometSection)
    torch_autocast: TorchAutocastSection = Field(default_factory=TorchAutocastSection)
    quantization: QuantizationSection = Field(default_factory=QuantizationSection)  # subchannel FP8/INT8 Linear
    sequence_parallel_size: PositiveInt | None = None  # Ulysses: checked against initialize(mpu=...)
    tensor_parallel: TensorParallelSection = Field(default_factory=TensorParallelSection)  # AutoTP
    expert_parallel: ExpertParallelSection = Field(default_factory=ExpertParallelSection)  # AutoEP
    zero_allow_untested_optimizer: bool = False
    zero_force_ds_cpu_optimizer: bool = True
    autotuning: AutotuningSection = Field(default_factory=AutotuningSection)

    compile: CompileSection = Field(default_factory=CompileSection)
    hybrid_engine: HybridEngineSection = Field(default_factory=HybridEngineSection)  # RLHF rollouts (engine.hybrid)
    torch_compile: TorchCompileSection = Field(default_factory=TorchCompileSection)
    prescale_gradients: Literal[False] = False
    gradient_predivide_factor: PositiveFloat = Field(1.0, description="DeepSpeed divides gradients by it before "
        "summing them and multiplies after, to keep fp16 sums in range; the averaged gradient is the same, and "
        "zero's reductions average without it: no effect here.")  # fmt: skip
    _batch: BatchSizes | None = pydantic.PrivateAttr(default=None)
    _auto_resolved: dict = pydantic.PrivateAttr(default_factory=dict)  # offload "auto" keys -> resolved values

    @property
    def batch(self) -> BatchSizes:
        """The resolved batch triple (set by :func:`load_config`)."""
        if self._batch is None:
            raise ConfigError("batch sizes not resolved: build the config with zero.config.load_config(...)")
        return self._batch

    def get(self, key: str, default=None):
        """Dict-style read of a top-level section (``engine.config.get("zero_optimization", {})``): DeepSpeed's
        ``engine.config`` is the config dict, and transformers' Trainer reads it so."""
        return self.model_dump().get(key, default)

    def __getitem__(self, key: str):
        """``engine.config["zero_optimization"]["offload_optimizer"]["device"]`` (OpenRLHF reads it so): the
        section as a dict, defaults filled. Raises KeyError for a key the config has no field for."""
        return self.model_dump()[key]

    def __contains__(self, key: str) -> bool:
        """Whether the config given set ``key`` (DeepSpeed's ``engine.config`` is the dict given)."""
        return key in self.model_fields_set

    @pydantic.field_validator("steps_per_print", mode="before")
    @classmethod
    def _never_print(cls, value):
        # transformers' Trainer passes float("inf") (DeepSpeed accepts it): never print, as None does
        return None if isinstance(value, float) and value == float("inf") else value

    @pydantic.model_validator(mode="after")
    def _one_precision(self) -> EngineConfig:
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError("fp16.enabled and bf16.enabled are both true; choose one")
        check_data_types(
            self.data_types,
            "bf16" if self.bf16.enabled else "fp16" if self.fp16.enabled else "fp32",
            streamed=_streams_grads(self.zero_optimization),
        )
        return self


def _streams_grads(zo) -> bool:
    """Stage 3 with ``offload_optimizer`` and ``offload_param`` on NVMe: gradients accumulate in the swap files."""
    opt, prm = getattr(zo, "offload_optimizer", None), getattr(zo, "offload_param", None)
    return zo.stage == 3 and opt is not None and opt.device == "nvme" and prm is not None and prm.device != "none"


def reject_unimplemented(cfg: EngineConfig) -> None:
    """NotSupportedError naming a validated key whose feature zero does not implement yet.

    * ``zero_optimization.offload_param`` (cpu or nvme, built by zero_offload's parameter stores) with
      ``compile.deepcompile`` (the compiled path brings its own parameter store).
    * what AutoTP does not compose with yet (:func:`check_tensor_parallel`).
    * what the quantized Linear does not compose with yet (``quantization_section.check_quantization``).
    """
    check_compile(cfg)  # DeepCompile's exclusions name both keys, before offload's own "not supported yet"
    check_recent_keys(cfg)  # gradient_allreduce_op "sum", managed_gradient_accumulation false
    check_tensor_parallel(cfg)
    check_quantization(cfg)  # the quantized Linear with AutoTP or DeepCompile
    zo = cfg.zero_optimization
    section = getattr(zo, "offload_param", None)
    if section is not None and section.device != "none" and cfg.compile.deepcompile:
        raise NotSupportedError("config keys 'zero_optimization.offload_param' and 'compile.deepcompile' together "
                                "are not supported yet (the compiled path keeps parameter shards on the device); "
                                "drop one")  # fmt: skip


def check_tensor_parallel(cfg: EngineConfig) -> None:
    """NotSupportedError naming the key for what zero's AutoTP lacks: a vocabulary-parallel LM head (and its Liger
    loss), kernel injection; and, with ``autotp_size`` > 1, optimizer or parameter offload to NVMe, DeepCompile
    (other than ``compile.passes: ["autotp"]``), sequence parallelism. ZeRO stages 0-3 and offload to the CPU
    compose with it: ZeRO partitions each tensor-parallel rank's module (its shards are ordinary parameters there)
    over that rank's data-parallel group, as DeepSpeed 0.19.8 does."""
    tp = cfg.tensor_parallel
    if tp.vocab_parallel_lm_head:
        raise NotSupportedError("config key 'tensor_parallel.vocab_parallel_lm_head': true is not supported by zero "
                                "(no vocabulary-parallel LM head); leave it null or false (the head is replicated, "
                                "or column-split with its output gathered)")  # fmt: skip
    if tp.vocab_parallel_ce_backend != "torch":
        raise NotSupportedError("config key 'tensor_parallel.vocab_parallel_ce_backend': 'liger' needs a "
                                "vocabulary-parallel LM head, which zero lacks; use 'torch'")  # fmt: skip
    if tp.replace_with_kernel_inject:
        raise NotSupportedError("config key 'tensor_parallel.replace_with_kernel_inject': true (kernel injection) "
                                "is not supported by zero; set it false")  # fmt: skip
    if tp.size == 1:
        return
    zo = cfg.zero_optimization
    why = None
    for key in ("offload_optimizer", "offload_param"):
        section = getattr(zo, key, None)
        if why is None and section is not None and section.device == "nvme":
            why = (f"'zero_optimization.{key}.device': 'nvme'", "use device 'cpu' or 'none' (swapping to NVMe is "
                   "not checked against the split)")  # fmt: skip
    if why is None and cfg.compile.deepcompile and cfg.compile.passes != ["autotp"]:
        why = ("'compile.deepcompile': true", "set it false (the tensor-parallel layers run eagerly), or compile "
               "with compile.passes ['autotp']")  # fmt: skip
    if why is None and (cfg.sequence_parallel_size or 1) > 1:
        why = (f"'sequence_parallel_size': {cfg.sequence_parallel_size}", "use one of sequence and tensor parallelism")
    if why is not None:
        raise NotSupportedError(f"config key {why[0]} with 'tensor_parallel.autotp_size': {tp.autotp_size} is not "
                                f"supported yet by zero; {why[1]}")  # fmt: skip


def _read(config: dict | str | os.PathLike) -> dict:
    if isinstance(config, dict):
        return config
    path = pathlib.Path(config)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a JSON object, got {type(data).__name__}")
    return data


def read_config(config: dict | str | os.PathLike | EngineConfig) -> dict:
    """The raw config dict of a dict, a JSON file path or an EngineConfig (its keys as set), before any
    validation. Raises ConfigError for a missing or unreadable file."""
    if isinstance(config, EngineConfig):
        return config.model_dump(exclude_unset=True)
    return _read(config)


def load_config(
    config: dict | str | os.PathLike | EngineConfig,
    world_size: int = 1,
    auto_values: dict[str, object] | None = None,
) -> EngineConfig:
    """Validate a DeepSpeed-style config (dict, JSON file path, or an EngineConfig) for ``world_size`` ranks
    (the batch triple counts ``world_size // tensor_parallel.autotp_size`` data-parallel ranks; a
    ``train_batch_size`` counting every rank, as DeepSpeed 0.19.8 checks it under AutoTP and transformers fills it,
    is accepted and the step takes micro-batch x gradient accumulation x data-parallel ranks samples).

    Order: read -> migrate deprecated keys (warning each) -> reject unsupported features -> ``"auto"`` in the
    offload sections to their defaults (``zero.config.offload_auto``) -> fill other ``"auto"`` from
    ``auto_values`` (dotted keys) -> pydantic validation -> optimizer/scheduler params by type -> batch triple.

    Raises:
        ConfigError: one line naming the key, the value given and what is allowed (nearest valid key for typos).
        NotSupportedError: a DeepSpeed feature zero does not implement yet, named by its key.
    """
    if isinstance(config, EngineConfig):
        config = config.model_dump(exclude_unset=True)
    raw = _read(config)
    raw = drop_dotted_keys(raw, EngineConfig)  # TRL's dotted top-level keys: ignored, as DeepSpeed does
    raw = migrate_deprecated(raw)
    raw = reject_unsupported(raw)
    raw, offload_auto = resolve_offload_auto(raw)  # DeepSpeed: "auto" there means the key's default
    raw = fill_auto(raw, auto_values)
    try:
        cfg = EngineConfig.model_validate(raw)
    except pydantic.ValidationError as e:
        raise ConfigError(format_validation_error(e, EngineConfig)) from None
    cfg._auto_resolved = offload_auto
    reject_unimplemented(cfg)
    if cfg.optimizer is not None:
        cfg.optimizer.typed_params()
    if cfg.scheduler is not None:
        cfg.scheduler.typed_params()
    tp = cfg.tensor_parallel.size
    if world_size % tp:
        raise ConfigError(f"config key 'tensor_parallel.autotp_size': {tp} does not divide the world size "
                          f"{world_size}; the world is data-parallel x tensor-parallel")  # fmt: skip
    # ranks of one tensor-parallel group see the same samples: the batch triple counts data-parallel ranks
    micro, gas, train = cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps, cfg.train_batch_size
    if tp > 1 and None not in (micro, gas, train) and train == micro * gas * world_size:
        # DeepSpeed 0.19.8 checks the triple against every rank under AutoTP (its config is built before the
        # tensor-parallel groups) and transformers fills "auto" that way: accepted, the step takes micro x gas x dp
        train = None
    cfg._batch = resolve_batch(train, micro, gas, world_size // tp)
    return cfg


def check_zero_section(config: dict | str | os.PathLike) -> None:
    """Validate the ``zero_optimization`` section of ``config`` as :func:`load_config` does, so a config that
    ``initialize`` will refuse is refused before a model is built under it (``zero.Init``, DeepSpeed #5917). Keys
    still ``"auto"`` are left out: transformers fills them after the model is built.

    Raises:
        ConfigError / NotSupportedError: as :func:`load_config`, naming the key.
    """
    raw = reject_unsupported(migrate_deprecated(drop_dotted_keys(_read(config), EngineConfig)))
    section = raw.get("zero_optimization")
    if not isinstance(section, dict):
        return
    section = {k: v for k, v in section.items() if v != "auto"}
    section, _ = resolve_offload_auto({"zero_optimization": section})
    try:
        EngineConfig.model_validate(section)
    except pydantic.ValidationError as e:
        raise ConfigError(format_validation_error(e, EngineConfig)) from None
