"""zero: DeepSpeed-compatible config, Engine, ``initialize()`` and the ``zero`` CLI over the zero-* packages.

``import zero as deepspeed`` works for the common training loop: ``initialize``, ``init_distributed``, ``Init``,
``GatheredParameters`` and the engine's forward/backward/step/save_checkpoint/load_checkpoint. DeepSpeed's
namespaces (``zero.comm``, ``zero.runtime``, ``zero.utils``, ``zero.zero``, ...) are bound to the modules of
:mod:`zero.as_deepspeed`, the façade of DeepSpeed's import paths; zero's own code lives in descriptively named
modules (``zero.engine``, ``zero.config``, ``zero.partitioning``, ``zero.collectives``, ...).
"""

from importlib.metadata import version as _version  # noqa: E402, I001

__version__ = _version("zero")  # the one version lives in pyproject.toml; read from the installed metadata

from zero.as_deepspeed import (  # noqa: E402  (DeepSpeed's namespaces: the façade's modules)
    accelerator,
    checkpoint,
    checkpointing,
    comm,
    git_version_info,
    inference,
    launcher,
    module_inject,
    moe,
    ops,
    pipe,
    profiling,
    runtime,
    utils,
    zero,
)
from zero.compat.alias import install_as_deepspeed  # noqa: E402
from zero.compat.config import DeepSpeedConfig, add_config_arguments  # noqa: E402
from zero.compat.facade_paths import NAMESPACES as _NAMESPACES  # noqa: E402
from zero.compat.facade_paths import FacadeFinder as _FacadeFinder
from zero.compat.names import TOP_LEVEL_UNSUPPORTED  # noqa: E402
from zero.compat.unsupported import register_unsupported  # noqa: E402
from zero.compat.version_info import version  # noqa: E402  (deepspeed.version: DeepSpeed's version string)
from zero.config import ConfigError, EngineConfig, NotSupportedError, load_config  # noqa: E402
from zero.engine import Engine  # noqa: E402
from zero.engine.hybrid import HybridEngine  # noqa: E402  (deepspeed.DeepSpeedHybridEngine)
from zero.engine.pipeline import PipelineEngine  # noqa: E402
from zero.engine.tensor_parallel import tp_model_init  # noqa: E402  (records; initialize() splits)
from zero.initialize import initialize  # noqa: E402
from zero.process_groups import init_distributed  # noqa: E402  (DeepSpeed's full signature)
from zero_inference import InferenceEngine, init_inference  # noqa: E402  (DeepSpeed's inference entry point)
from zero_parallel.pipe import PipelineModule  # noqa: E402  (deepspeed.PipelineModule)

register_unsupported("deepspeed", TOP_LEVEL_UNSUPPORTED)  # `from deepspeed import moe` explains too
_FacadeFinder("zero", _NAMESPACES).install()  # `from zero.comm import X`: the façade's module, as before it existed

DeepSpeedEngine = Engine  # DeepSpeed's name for the engine class (isinstance checks in Accelerate)
DeepSpeedHybridEngine = HybridEngine  # initialize() returns it with hybrid_engine.enabled

_FROM_CORE = {"Init": ("zero_init", "Init"), "GatheredParameters": ("GatheredParameters",)}


def __getattr__(name: str):
    """``zero.Init`` / ``zero.GatheredParameters``: zero_core's context managers, re-exported when it has them."""
    if name in _FROM_CORE:
        import zero_core

        for attr in _FROM_CORE[name]:
            if hasattr(zero_core, attr):
                return getattr(zero_core, attr)
        raise AttributeError(f"zero.{name}: the installed zero_core does not provide it yet")
    if name in TOP_LEVEL_UNSUPPORTED:
        from zero.compat import UnsupportedName

        raise UnsupportedName(f"deepspeed.{name} is not supported by zero: {TOP_LEVEL_UNSUPPORTED[name]}")
    raise AttributeError(f"module 'zero' has no attribute {name!r}")


__all__ = ["ConfigError", "Engine", "EngineConfig", "NotSupportedError", "PipelineEngine", "PipelineModule",
           "checkpointing", "init_distributed",
           "initialize", "load_config", "tp_model_init", "__version__"]  # fmt: skip
__all__ += ["InferenceEngine", "init_inference", "inference"]  # DeepSpeed's inference: zero_inference
__all__ += ["DeepSpeedHybridEngine", "HybridEngine"]  # hybrid_engine.enabled: training and rollouts
__all__ += ["DeepSpeedConfig", "DeepSpeedEngine", "accelerator", "add_config_arguments", "checkpoint", "comm",
            "git_version_info", "install_as_deepspeed", "launcher", "module_inject", "moe", "ops", "pipe", "profiling",
            "runtime", "utils", "version", "zero"]  # fmt: skip
