"""``deepspeed.runtime.sequence_parallel``: DeepSpeed's Ulysses sequence parallelism, served by zero_parallel
(``ulysses_sp.UlyssesSPAttentionHF``, what Accelerate's ``sp_backend="deepspeed"`` imports)."""

from zero.runtime.sequence_parallel import ulysses_sp

__all__ = ["ulysses_sp"]
