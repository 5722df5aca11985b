"""``deepspeed.moe``: DeepSpeed's mixture-of-experts layer with expert parallelism (``zero_parallel.moe``)."""

from zero.as_deepspeed.moe import experts, layer, sharded_moe, utils

__all__ = ["experts", "layer", "sharded_moe", "utils"]
