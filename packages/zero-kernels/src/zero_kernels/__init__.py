"""C++/CUDA ops for ZeRO training (CPU Adam, fused Adam, blockwise quantize) with pure-torch fallbacks.

Public API:
    load(name) / available(name): the op loader (prebuilt if installed with ZERO_BUILD_OPS=1, else JIT + cache).
    CPUAdam, adam_step, adam_step_reference, cpu_isa: CPU Adam/AdamW.
    empty_hugepage / advise_hugepages: CPU buffers on transparent huge pages (faster optimizer streams).
    FusedAdam: CUDA multi-tensor Adam/AdamW (torch's fused/foreach AdamW where the op is unavailable).
    quantize_blockwise / dequantize_blockwise: symmetric blockwise int8/int4 (CUDA op or torch reference).
    SubchannelLinear, subchannel_linear, LinearQuantRecipe, GemmQuant, quantized_matmul: subchannel FP8/INT8
        quantized training of Linear layers (DeepSpeed 0.20's `quantization` section); quantize_subchannel /
        dequantize_subchannel: its per-block rule.
"""

from importlib.metadata import version as _version

from zero_kernels._filelock import LockTimeout
from zero_kernels.adam_reference import adam_step_reference
from zero_kernels.cpu_adam import CPUAdam, adam_step, cpu_isa
from zero_kernels.fused_adam import FusedAdam
from zero_kernels.loader import OPS, BuildError, OpSpec, available, load
from zero_kernels.memory import advise_hugepages, empty_hugepage
from zero_kernels.quantize import dequantize_blockwise, quantize_blockwise
from zero_kernels.subchannel_linear import (
    GemmQuant,
    LinearQuantRecipe,
    SubchannelLinear,
    quantized_matmul,
    subchannel_linear,
)
from zero_kernels.subchannel_quant import dequantize_subchannel, quantize_subchannel

__version__ = _version("zero-kernels")  # the one version lives in pyproject.toml; read from the installed metadata

__all__ = [
    "OPS",
    "BuildError",
    "CPUAdam",
    "FusedAdam",
    "GemmQuant",
    "LinearQuantRecipe",
    "LockTimeout",
    "OpSpec",
    "SubchannelLinear",
    "adam_step",
    "adam_step_reference",
    "advise_hugepages",
    "available",
    "cpu_isa",
    "dequantize_blockwise",
    "dequantize_subchannel",
    "empty_hugepage",
    "load",
    "quantize_blockwise",
    "quantize_subchannel",
    "quantized_matmul",
    "subchannel_linear",
]
