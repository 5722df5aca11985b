"""``Init`` with DeepSpeed's keywords over zero_core's ``zero_init`` context (served as ``deepspeed.zero.Init`` and
``deepspeed.runtime.zero.partition_parameters.Init``).

transformers imports ``partition_parameters`` to wrap ``zero_wrapper_for_fp_tensor_constructor`` around
``torch.arange`` (``prevent_arange_dtype_change``) so that DeepSpeed's ``Init`` does not cast rotary tables. zero's
``Init`` patches no tensor constructor (see ``zero_core.zero_init``): the wrapper here returns the constructor
unchanged and is never installed, so that patch has nothing to undo.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from zero.config import ConfigError, NotSupportedError
from zero.config.model import check_zero_section
from zero_core import zero_init
from zero_core.frozen_quant import ask_int8_if_frozen
from zero_core.partition_records import partitioned_record

_orig_torch_arange = torch.arange  # transformers compares torch.arange with it (DeepSpeed's name)


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype=None, target_device=None):
    """DeepSpeed wraps floating-point tensor constructors with this; zero does not, so ``fn`` comes back as is."""
    return fn


def _read_config(config) -> dict | None:
    """The config as a dict (None without one).

    Raises:
        ConfigError: neither a dict nor a JSON path.
    """
    if config is None:
        return None
    if isinstance(config, str | os.PathLike):
        with open(config) as f:
            config = json.load(f)
    if not isinstance(config, dict):
        raise ConfigError(
            f"zero.Init(config_dict_or_path=...): expected a dict or a JSON path, got {type(config).__name__}"
        )
    return config


def _quantize_frozen_from_config(config: dict | None) -> bool:
    """``zero_optimization.zero_quantized_nontrainable_weights`` of the config (DeepSpeed's Init reads it too)."""
    section = (config or {}).get("zero_optimization")
    return bool(isinstance(section, dict) and section.get("zero_quantized_nontrainable_weights", False))


def _dtype_from_config(config: dict | None) -> torch.dtype | None:
    """DeepSpeed's rule: bf16 enabled -> bfloat16, fp16 enabled -> float16, else float32 (None without config)."""
    if config is None:
        return None
    enabled = {}
    for key, names in (("bf16", ("bf16", "bfloat16")), ("fp16", ("fp16",))):
        value = next((config[n].get("enabled", False) for n in names if isinstance(config.get(n), dict)), False)
        if value == "auto":
            raise ConfigError(
                f"zero.Init: config key '{key}.enabled' is still \"auto\"; fill it (transformers' "
                "Trainer does) before building the model"
            )
        enabled[key] = bool(value)
    if enabled["bf16"] and enabled["fp16"]:
        raise ConfigError("zero.Init: config enables both 'bf16' and 'fp16'; enable one")
    return torch.bfloat16 if enabled["bf16"] else torch.float16 if enabled["fp16"] else torch.float32


class Init(zero_init):
    """Partition the parameters of modules built inside the context over the data-parallel group (ZeRO-3).

    ``with zero.zero.Init(config_dict_or_path=ds_config): model = MyModel()``: each rank keeps only its shard of
    every parameter (``param.data`` becomes empty; the shape lives in zero_core's record) and the engine's stage-3
    runtime takes the shards over. Mirrors ``deepspeed.zero.Init`` (DeepSpeed 0.19.8), keywords as there.

    Args:
        module: an already-built ``nn.Module`` to partition now, as if built inside the context.
        data_parallel_group: the process group to partition over (default: WORLD; the default process group is
            initialised from torchrun's environment, or as one rank, when absent, as DeepSpeed does).
        mem_efficient_linear: accepted for compatibility; zero never patches ``torch.nn.functional.linear``.
        remote_device: ``None``, ``"cpu"`` or the parameters' own device type: the shards stay where the
            parameters were built. ``"nvme"`` raises ``NotSupportedError`` (use the config's offload sections).
        pin_memory: accepted; shards are not pinned (they stay where the parameters were built).
        config_dict_or_path: the DeepSpeed config (dict or JSON path); its ``bf16``/``fp16`` section sets the
            shard dtype when ``dtype`` is None (DeepSpeed's rule: bf16 > fp16 > fp32).
        config: the old name of ``config_dict_or_path`` (give one of them).
        enabled: False makes the context a no-op.
        dtype: cast floating parameters to this dtype when partitioning (default: from the config; without a
            config, parameters keep their dtype, where DeepSpeed would pick fp16 on an accelerator).
        mpu: must be None (model parallelism is not implemented; pass ``data_parallel_group``).
        zero_quantized_nontrainable_weights: the parameters partitioned here that end up frozen (in no optimizer
            param group) are held by the stage-3 runtime as int8 blocks (``zero_core.frozen_quant``), as with the
            config key ``zero_optimization.zero_quantized_nontrainable_weights`` (read from the config here too).
        zero_param_parallel_group, zero_quantized_weights, sequence_data_parallel_group, param_swapper: must be left
            at their defaults (NotSupportedError otherwise).

    Raises:
        ConfigError: both ``config`` and ``config_dict_or_path``, a config that is not a dict / JSON path, or a
            ``zero_optimization`` section ``initialize`` would refuse (named by key, before any module is built).
        NotSupportedError: ``mpu``, ``remote_device="nvme"`` or one of the unsupported keywords set.
    """

    def __init__(
        self,
        module: torch.nn.Module | None = None,
        data_parallel_group=None,
        mem_efficient_linear=True,
        remote_device=None,
        pin_memory=False,
        config_dict_or_path=None,
        config=None,
        enabled=True,
        dtype=None,
        mpu=None,
        zero_param_parallel_group=None,
        zero_quantized_weights=False,
        zero_quantized_nontrainable_weights=False,
        sequence_data_parallel_group=None,
        param_swapper=None,
        tensor_overrides=None,
    ):
        if config is not None and config_dict_or_path is not None:
            raise ConfigError("zero.Init: give the config once, as config_dict_or_path (config is its old name)")
        unsupported = {
            "mpu": mpu,
            "zero_param_parallel_group": zero_param_parallel_group,
            "zero_quantized_weights": zero_quantized_weights or None,
            "sequence_data_parallel_group": sequence_data_parallel_group,
            "param_swapper": param_swapper,
            "tensor_overrides": tensor_overrides,
        }
        for name, value in unsupported.items():
            if value is not None:
                raise NotSupportedError(
                    f"zero.Init({name}=...) is not supported by zero; leave it at its default "
                    "(ZeRO++ and offload are set in the config's zero_optimization section)"
                )
        if remote_device not in (None, "cpu", "cuda", "none"):
            raise NotSupportedError(
                f"zero.Init(remote_device={remote_device!r}) is not supported by zero; shards "
                "stay where parameters are built (configure NVMe offload in the config)"
            )
        cfg = _read_config(config_dict_or_path if config_dict_or_path is not None else config) if enabled else None
        if cfg is not None:
            check_zero_section(cfg)  # what initialize() will refuse, refused before any module is built
        if dtype is None and enabled:
            dtype = _dtype_from_config(cfg)
        quantize_frozen = bool(zero_quantized_nontrainable_weights) or _quantize_frozen_from_config(cfg)
        if enabled and not dist.is_initialized():
            from zero.distributed import init_distributed

            init_distributed()
        on_partition = ask_int8_if_frozen if quantize_frozen else None  # the stage-3 runtime reads the mark
        super().__init__(group=data_parallel_group, dtype=dtype, on_partition=on_partition, enabled=enabled)
        self.mem_efficient_linear = mem_efficient_linear
        self.remote_device = remote_device
        self.pin_memory = pin_memory
        if module is not None and enabled:
            self.group = self.group or dist.group.WORLD
            self._partition(module)

    @staticmethod
    def is_partitioned(param: torch.Tensor) -> bool:
        """True when ``param`` holds only this rank's shard (partitioned by ``Init``, not yet owned by a runtime)."""
        return partitioned_record(param) is not None
