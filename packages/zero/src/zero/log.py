"""zero's logger: a standard ``logging`` logger named ``zero``, and ``log_dist`` (served as ``deepspeed.utils.logger``
/ ``log_dist``)."""

from __future__ import annotations

import logging

import torch.distributed as dist

logger = logging.getLogger("zero")
"""The library logger (transformers sets its level through ``deepspeed.utils.logger.setLevel``)."""


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the given global ``ranks`` (None or [-1]: every rank), as DeepSpeed's ``log_dist``."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")


def set_level(name: str) -> None:
    """Set zero's logger and its handlers to ``name`` ("debug", "info", "warning", "error", "critical"), as
    DeepSpeed's ``set_log_level_from_string`` does for its logger (the config's ``log_level``)."""
    level = logging.getLevelName(name.upper())
    logger.setLevel(level)
    for handler in logger.handlers:
        handler.setLevel(level)
