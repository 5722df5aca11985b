"""DeepSpeed-compatible inference: ``init_inference`` and its ``InferenceEngine``, a model converted to the inference
dtype and split over a tensor-parallel group by AutoTP (zero_parallel's column/row-parallel ``Linear`` layers).

Imports torch, zero_comm and zero_parallel; transformers models are used through their own methods.
"""

from importlib.metadata import version as _version

from zero_inference.api import init_inference
from zero_inference.compiled import CompileError
from zero_inference.config import DeepSpeedInferenceConfig, DeepSpeedTPConfig, InferenceConfigError, parse_dtype
from zero_inference.device import supported_dtypes
from zero_inference.engine import DEFAULT_SYNC_TIMEOUT, BeamSearchError, InferenceEngine, PartialGenerateError
from zero_inference.fused_block import FUSED_LAYERS, has_fused_blocks
from zero_inference.tensor_parallel import ModelParallelUnit

__version__ = _version("zero-inference")  # the one version lives in pyproject.toml; read from the installed metadata

__all__ = [
    "BeamSearchError",
    "CompileError",
    "DEFAULT_SYNC_TIMEOUT",
    "DeepSpeedInferenceConfig",
    "DeepSpeedTPConfig",
    "FUSED_LAYERS",
    "InferenceConfigError",
    "InferenceEngine",
    "ModelParallelUnit",
    "PartialGenerateError",
    "has_fused_blocks",
    "init_inference",
    "parse_dtype",
    "supported_dtypes",
]
