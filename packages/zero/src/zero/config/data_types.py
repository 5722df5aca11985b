"""`data_types`: DeepSpeed 0.19.8's per-role dtype section (``grad_accum_dtype``, ``param_dtype``, ``buffer_dtype``,
``keep_in_fp32_modules``), validated against the ``fp16`` / ``bf16`` sections.

What each key does in zero (``zero.engine.precision`` applies them):

* ``grad_accum_dtype``: dtype of the gradient accumulation buffers across micro-batches (the gradient shards the
  optimizer reads). Absent or ``"fp32"``: fp32 accumulation, zero's default at every stage (DeepSpeed's default is
  the model dtype). ``"bf16"`` / ``"fp16"``: the low-precision buffers of DeepSpeed's ``grad_accum_dtype``, half
  the gradient bytes; only the enabled model dtype may be chosen (DeepSpeed refuses other mixes).
* ``param_dtype``: must name the dtype the ``fp16`` / ``bf16`` flags give (DeepSpeed asserts the same); it changes
  nothing on its own.
* ``buffer_dtype``: floating-point module buffers are cast to it at ``initialize()``; absent, buffers keep the dtype
  they were built with.
* ``keep_in_fp32_modules``: under bf16 / fp16, buffers whose full names match are kept in (and raised to) fp32;
  ``"auto"`` reads transformers' ``_keep_in_fp32_modules_strict`` (and ``_keep_in_fp32_modules`` under fp16) from
  the model's modules, a list gives name patterns (``*`` any characters, matched anywhere in the name), ``[]`` none.
"""

from __future__ import annotations

from typing import Literal

import pydantic

DTYPE_NAMES = Literal["fp32", "fp16", "bf16"]


class DataTypesSection(pydantic.BaseModel):
    """`data_types` (DeepSpeed 0.19.8's keys and defaults; see the module docstring for what each does).

    Raises (through ``load_config``):
        ConfigError: an unknown key, a dtype other than "fp32"/"fp16"/"bf16", or ``keep_in_fp32_modules`` neither
            "auto" nor a list of strings.
    """

    model_config = pydantic.ConfigDict(extra="forbid")
    grad_accum_dtype: DTYPE_NAMES | None = None
    param_dtype: DTYPE_NAMES | None = None
    buffer_dtype: DTYPE_NAMES | None = None
    keep_in_fp32_modules: Literal["auto"] | list[str] = "auto"


def check_data_types(section: DataTypesSection, model_dtype: str, streamed: bool = False) -> None:
    """Raise ValueError naming the key when ``section`` asks for a dtype mix zero (like DeepSpeed) does not run.

    ``model_dtype``: "bf16", "fp16" or "fp32", from the ``bf16`` / ``fp16`` sections. ``streamed``: gradients
    accumulate in NVMe swap files (stage 3, ``offload_optimizer`` and ``offload_param`` on nvme), which hold fp32.
    """
    if section.param_dtype is not None and section.param_dtype != model_dtype:
        raise ValueError(f"data_types.param_dtype {section.param_dtype!r} conflicts with the enabled precision "
                         f"({model_dtype!r}); set the matching fp16/bf16 'enabled' flag or omit "
                         "data_types.param_dtype")  # fmt: skip
    accum = section.grad_accum_dtype
    if accum is not None and accum not in ("fp32", model_dtype):
        raise ValueError(f"data_types.grad_accum_dtype {accum!r} with {model_dtype!r} parameters is not supported "
                         f"(as in DeepSpeed): accumulate in 'fp32' or in the model dtype {model_dtype!r}")  # fmt: skip
    if accum not in (None, "fp32") and streamed:
        raise ValueError(f"data_types.grad_accum_dtype {accum!r} is not supported with zero_optimization."
                         "offload_optimizer and offload_param on nvme at stage 3: gradients accumulate in the swap "
                         "files in fp32; use 'fp32' or drop an nvme offload")  # fmt: skip
