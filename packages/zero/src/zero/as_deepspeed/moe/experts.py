"""``deepspeed.moe.experts``: a rank's local experts (``zero_parallel.moe.experts``)."""

from zero_parallel.moe.experts import Experts

__all__ = ["Experts"]
