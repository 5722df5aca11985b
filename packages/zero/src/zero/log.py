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
