"""The `torch_autocast` section (DeepSpeed >= 0.16: ZeRO with ``torch.autocast`` instead of its fp16/bf16 modes)."""

from __future__ import annotations

import importlib

import pydantic
import torch

_BF16, _FP16 = torch.bfloat16, torch.float16
_DTYPES = {"bfloat16": _BF16, "bf16": _BF16, "torch.bfloat16": _BF16, "float16": _FP16, "fp16": _FP16, "half": _FP16,
           "torch.float16": _FP16}  # fmt: skip
DEFAULT_SAFE_MODULES = ["torch.nn.Linear", "torch.nn.Conv1d", "torch.nn.Conv2d", "torch.nn.Conv3d"]


class TorchAutocastSection(pydantic.BaseModel):
    """`torch_autocast`: run the forward under ``torch.autocast(device, dtype)``; parameters, master weights,
    gradients and their reduction stay fp32; with float16 a dynamic gradient scaler is used at every stage.

    ``dtype``: DeepSpeed's names ("bfloat16"/"bf16", "float16"/"fp16"/"half", "torch.*"), default bfloat16.
    ``lower_precision_safe_modules``: dotted class names (default Linear and Conv1d/2d/3d). DeepSpeed reduces the
    gradients of these modules' parameters in ``dtype``; zero validates the names (each must import) and reduces
    every gradient in fp32.
    """

    model_config = pydantic.ConfigDict(extra="forbid")
    enabled: bool = False
    dtype: str = "bfloat16"
    lower_precision_safe_modules: list[str] | None = None

    @pydantic.field_validator("dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        if v not in _DTYPES:
            raise ValueError(f"must be one of {', '.join(_DTYPES)}")
        return v

    @pydantic.field_validator("lower_precision_safe_modules")
    @classmethod
    def _importable(cls, v: list[str] | None) -> list[str] | None:
        for name in v or ():
            module, _, attr = name.rpartition(".")
            try:
                ok = isinstance(getattr(importlib.import_module(module), attr), type)
            except (ImportError, AttributeError, ValueError):
                ok = False
            if not ok:
                raise ValueError(f"{name!r} is not an importable class (give 'package.module.Class')")
        return v

    @property
    def torch_dtype(self) -> torch.dtype:
        """The autocast dtype as a torch dtype."""
        return _DTYPES[self.dtype]
