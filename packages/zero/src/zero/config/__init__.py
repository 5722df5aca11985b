"""DeepSpeed-compatible configuration: pydantic models, batch-triple resolution, migration and clear errors."""

from zero.config.batch import BatchSizes, resolve_batch
from zero.config.errors import ConfigError, NotSupportedError
from zero.config.legacy import AUTO_KEYS, fill_auto
from zero.config.model import EngineConfig, ZeroSection, load_config

__all__ = [
    "AUTO_KEYS",
    "BatchSizes",
    "ConfigError",
    "EngineConfig",
    "NotSupportedError",
    "ZeroSection",
    "fill_auto",
    "load_config",
    "resolve_batch",
]
