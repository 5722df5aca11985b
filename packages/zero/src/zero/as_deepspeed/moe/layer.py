"""``deepspeed.moe.layer``: the ``MoE`` layer (``zero_parallel.moe.layer``)."""

from zero_parallel.moe.layer import MoE

__all__ = ["MoE"]
