"""The ``tensor_parallel`` section: AutoTP training (DeepSpeed 0.19.8's ``TPTrainingConfig`` keys).

``autotp_size`` > 1 splits the model's ``Linear`` layers over that many ranks (zero_parallel's AutoTP) and ZeRO
shards over the data-parallel ranks only (world / autotp_size). Keys zero accepts but that change nothing it does
(``keep_module_on_host``, ``tp.tp_grain_size`` (DeepSpeed does not use it in training either), ``dtype``, which is
checked against ``tp_model_init``'s) are validated all the same; features it lacks (a vocabulary-parallel LM head,
kernel injection, an ``mpu`` or ``tp_group`` object in the config) are refused naming the key.
"""

from __future__ import annotations

from typing import Literal

import pydantic
import torch
from pydantic import Field, NonNegativeInt, PositiveInt

_STRICT = pydantic.ConfigDict(extra="forbid", populate_by_name=True, arbitrary_types_allowed=True)
_DTYPES = {"fp16": torch.float16, "float16": torch.float16, "half": torch.float16, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
           "float": torch.float32}  # fmt: skip


def dtype_from(value: object, key: str) -> torch.dtype:
    """A torch floating dtype from a ``torch.dtype`` or a name ("bf16", "torch.float16", ...); ValueError naming
    ``key`` otherwise."""
    if isinstance(value, torch.dtype) and value in _DTYPES.values():
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.removeprefix("torch.")]
    raise ValueError(f"{key} must be fp16, bf16 or fp32 (a torch.dtype or its name), got {value!r}")


class TPGroupSection(pydantic.BaseModel):
    """``tensor_parallel.tp``: DeepSpeed's inner ``TPConfig``. ``tp_size`` 1 or equal to ``autotp_size``;
    ``mpu`` / ``tp_group`` must stay null (zero builds the tensor-parallel group from its ``DeviceMesh``)."""

    model_config = _STRICT
    tp_size: PositiveInt = 1
    tp_grain_size: PositiveInt = 1
    mpu: None = None
    tp_group: None = None


class LayerSpecSection(pydantic.BaseModel):
    """One ``partition_config.layer_specs`` entry (see ``zero_parallel.tp_specs.LayerSpec``)."""

    model_config = _STRICT
    patterns: list[str] = Field(min_length=1)
    partition_type: Literal["column", "row", "skip"] = "column"
    partition_dim: NonNegativeInt | None = None
    shape: list | None = None
    gather_output: bool = False
    grad_allreduce: bool = False
    model_types: list[str] | None = None

    @pydantic.field_validator("partition_type", mode="before")
    @classmethod
    def _lower(cls, value):
        return value.lower() if isinstance(value, str) else value  # DeepSpeed reads "ROW" as "row"

    @pydantic.field_validator("shape")
    @classmethod
    def _shape(cls, value):
        if value is None:
            return value
        for dim in value:
            ok = dim == -1 or (isinstance(dim, int) and dim > 0) or (
                isinstance(dim, list) and dim and all(isinstance(v, int) and v > 0 for v in dim))  # fmt: skip
            if not ok:
                raise ValueError(f"shape entries are positive ints, -1, or one list of positive ints, got {dim!r}")
        return value


class PartitionConfigSection(pydantic.BaseModel):
    """``tensor_parallel.partition_config``: custom layer specs (first match wins), merged before the preset's
    when ``use_default_specs`` (DeepSpeed's ``AutoTPConfig.from_dict`` keys)."""

    model_config = _STRICT
    use_default_specs: bool = True
    layer_specs: list[LayerSpecSection] = Field(default_factory=list)
    strict_mode: bool = False
    lm_head_patterns: list[str] = Field(default_factory=lambda: ["lm_head", "embed_out"])
    embedding_partition_dim: Literal[1] = 1  # vocabulary dim; embeddings stay whole in zero
    tp_size: PositiveInt = 1  # DeepSpeed overwrites it with autotp_size


class TensorParallelSection(pydantic.BaseModel):
    """``tensor_parallel``: AutoTP training.

    Attributes:
        autotp_size: ranks one model replica is split over (0 or 1: off); must divide the world size.
        tp_overlap_comm: overlap each column-parallel layer's backward all-reduce with its weight gradient.
        preset_model: built-in layer specs ("llama", "qwen2", "mixtral", "phi3").
        partition_config: custom layer specs (:class:`PartitionConfigSection`).
        dtype: the model dtype ``tp_model_init`` was given (checked against it; precision comes from fp16/bf16).
        vocab_parallel_lm_head: None or false (true: refused, no vocabulary-parallel head in zero).
        vocab_parallel_ce_backend: "torch".
        tensor_parallel (alias ``tp``): :class:`TPGroupSection`.
        keep_module_on_host, injection_policy_tuple, replace_with_kernel_inject (alias ``kernel_inject``):
            DeepSpeed's parser keys; the last two must stay at their defaults.
    """

    model_config = _STRICT
    autotp_size: NonNegativeInt = 0
    tp_overlap_comm: bool = False
    preset_model: str | None = None
    partition_config: PartitionConfigSection | None = None
    dtype: torch.dtype | None = None
    vocab_parallel_lm_head: bool | None = None
    vocab_parallel_ce_backend: Literal["torch", "liger"] = "torch"
    tensor_parallel: TPGroupSection = Field(default_factory=TPGroupSection, alias="tp")
    keep_module_on_host: bool = False
    injection_policy_tuple: None = None
    replace_with_kernel_inject: bool = Field(False, alias="kernel_inject")

    @pydantic.field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, value):
        return None if value is None else dtype_from(value, "dtype")

    @pydantic.field_validator("preset_model")
    @classmethod
    def _preset(cls, value):
        from zero_parallel import PRESETS

        if value is not None and value.lower() not in PRESETS:
            raise ValueError(f"{value!r} is not a built-in preset; choose one of {sorted(PRESETS)}")
        return value

    @pydantic.model_validator(mode="after")
    def _consistent(self) -> TensorParallelSection:
        tp = self.tensor_parallel.tp_size
        if tp != 1 and tp != self.autotp_size:
            raise ValueError(f"tp.tp_size ({tp}) differs from autotp_size ({self.autotp_size}); set one of them")
        return self

    @property
    def size(self) -> int:
        """The tensor-parallel size (1 when off)."""
        return max(1, self.autotp_size)
