"""The `quantization` section: subchannel FP8/INT8 quantized training of ``nn.Linear`` layers (DeepSpeed 0.20).

``{"quantization": {"enabled": true, "dtype": "fp8", "block_size": 128}}`` quantizes, on the fly at every call,
both operands of each selected layer's forward (``forward``), input-gradient (``dx``) and weight-gradient (``dw``)
GEMMs along their reduction dimension with fp32 scales (``zero_kernels.subchannel_linear`` has the rule);
parameters, gradients and optimizer state keep their precision. ``dtype``: "fp8" (e4m3) or "int8";
``block_size``: elements per scale (0: row scaling, one scale per operand row). ``forward`` / ``dx`` / ``dw``
configure one GEMM each: ``enabled`` false leaves it in the layer's precision, ``dtype`` / ``block_size`` (null:
the section's) override. The layers: every module whose type is exactly ``torch.nn.Linear`` and whose qualified
name matches one of ``module_name_patterns`` (``fnmatch``) and none of ``exclude_module_name_patterns``.
"""

from __future__ import annotations

from typing import Annotated, Literal

import pydantic

from zero.config.errors import NotSupportedError
from zero_kernels import GemmQuant, LinearQuantRecipe

# strict: a JSON true is not block size 1 (pydantic's lax int would take it)
BlockSize = Annotated[int, pydantic.Field(ge=0, strict=True)]


class GemmSection(pydantic.BaseModel):
    """One GEMM's settings (`quantization.forward` / `.dx` / `.dw`); null values take the section's."""

    model_config = pydantic.ConfigDict(extra="forbid")
    enabled: bool = True
    dtype: Literal["fp8", "int8"] | None = None
    block_size: BlockSize | None = None


class QuantizationSection(pydantic.BaseModel):
    """`quantization`: which Linear layers run quantized GEMMs, and how (module docstring)."""

    model_config = pydantic.ConfigDict(extra="forbid")
    enabled: bool = False
    dtype: Literal["fp8", "int8"] = "fp8"
    block_size: BlockSize = 128
    forward: GemmSection = pydantic.Field(default_factory=GemmSection)
    dx: GemmSection = pydantic.Field(default_factory=GemmSection)
    dw: GemmSection = pydantic.Field(default_factory=GemmSection)
    module_name_patterns: list[str] = pydantic.Field(default_factory=lambda: ["*"])
    exclude_module_name_patterns: list[str] = pydantic.Field(default_factory=list)

    def _gemm(self, gemm: GemmSection) -> GemmQuant | None:
        if not gemm.enabled:
            return None
        block = self.block_size if gemm.block_size is None else gemm.block_size
        return GemmQuant(gemm.dtype or self.dtype, block)

    def recipe(self) -> LinearQuantRecipe:
        """The frozen recipe every selected layer shares (backend "auto": FP8 tensor cores where the device has
        them, else the exact emulation)."""
        return LinearQuantRecipe(forward=self._gemm(self.forward), dx=self._gemm(self.dx), dw=self._gemm(self.dw))


def check_quantization(cfg) -> None:
    """NotSupportedError naming both keys for what the quantized Linear does not compose with yet: AutoTP's
    split layers (``tensor_parallel.autotp_size`` > 1: they are not ``nn.Linear``, so nothing would be quantized)
    and DeepCompile (its passes were not checked against the quantized GEMM's autograd function)."""
    if not cfg.quantization.enabled:
        return
    if cfg.tensor_parallel.size > 1:
        raise NotSupportedError(f"config key 'quantization.enabled': true with 'tensor_parallel.autotp_size': "
                                f"{cfg.tensor_parallel.autotp_size} is not supported yet by zero (AutoTP's split "
                                "layers are not quantized); drop one")  # fmt: skip
    if cfg.compile.deepcompile:
        raise NotSupportedError("config key 'quantization.enabled': true with 'compile.deepcompile': true is not "
                                "supported yet by zero; drop one")  # fmt: skip
