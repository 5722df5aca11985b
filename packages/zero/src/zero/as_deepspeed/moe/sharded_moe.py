"""``deepspeed.moe.sharded_moe``: the gate and the dispatching layer (``zero_parallel.moe.gate`` and ``.layer``)."""

from zero_parallel.moe.gate import TopKGate
from zero_parallel.moe.layer import MOELayer

__all__ = ["MOELayer", "TopKGate"]
