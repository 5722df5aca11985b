"""``deepspeed.DeepSpeedConfig`` and ``deepspeed.add_config_arguments`` over zero's config models."""

from __future__ import annotations

import argparse
import json
import os

from zero.config import EngineConfig, NotSupportedError, load_config
from zero.distributed import rank_world


class DeepSpeedConfig:
    """A DeepSpeed config validated by zero (``deepspeed.DeepSpeedConfig(config, mpu=None, mesh_device=None)``).

    Args:
        config: a dict or a JSON path (DeepSpeed's format; "auto" values must be filled).
        mpu, mesh_device: must be None (model parallelism is not implemented).

    Attributes (DeepSpeed's names): ``train_batch_size``, ``train_micro_batch_size_per_gpu``,
    ``gradient_accumulation_steps`` (resolved for the current world size), ``zero_enabled``,
    ``zero_optimization_stage``, ``fp16_enabled``, ``bfloat16_enabled``, ``gradient_clipping``,
    ``_param_dict`` (the raw dict) and ``engine_config`` (zero's validated :class:`~zero.config.EngineConfig`).

    Raises:
        ConfigError naming the key; NotSupportedError for ``mpu`` / ``mesh_device``.
    """

    def __init__(self, config: dict | str | os.PathLike, mpu=None, mesh_device=None):
        if mpu is not None or mesh_device is not None:
            raise NotSupportedError(
                "DeepSpeedConfig(mpu=..., mesh_device=...) is not supported: zero has data parallelism only"
            )
        if isinstance(config, str | os.PathLike):
            with open(config) as f:
                config = json.load(f)
        self._param_dict = dict(config)
        cfg: EngineConfig = load_config(self._param_dict, rank_world()[1])
        self.engine_config = cfg
        self.train_batch_size = cfg.batch.train_batch_size
        self.train_micro_batch_size_per_gpu = cfg.batch.micro_batch_per_gpu
        self.gradient_accumulation_steps = cfg.batch.gradient_accumulation_steps
        self.zero_optimization_stage = int(cfg.zero_optimization.stage)
        self.zero_enabled = self.zero_optimization_stage > 0
        self.fp16_enabled = bool(cfg.fp16.enabled)
        self.bfloat16_enabled = bool(cfg.bf16.enabled)
        self.gradient_clipping = float(cfg.gradient_clipping)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's ``--deepspeed``, ``--deepspeed_config PATH``, ``--deepscale``, ``--deepscale_config``
    (a "DeepSpeed" argument group) to ``parser`` and return it; ``initialize(args=...)`` reads
    ``args.deepspeed_config``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (served by zero)")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="enable DeepSpeed (a flag for user code; zero does not read it)",
    )
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON config file")
    group.add_argument("--deepscale", default=False, action="store_true", help="deprecated name of --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="deprecated name of --deepspeed_config")
    return parser
