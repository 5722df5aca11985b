"""``deepspeed.utils.logging``: ``logger`` and ``log_dist`` (``zero.log``)."""

from zero.log import log_dist, logger

__all__ = ["log_dist", "logger"]
