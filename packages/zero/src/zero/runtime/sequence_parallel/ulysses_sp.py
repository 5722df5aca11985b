"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: DeepSpeed's module path of the Ulysses adapter, re-exporting
``zero_parallel``'s (the implementation and its docs live there)."""

from zero_parallel import SequenceParallelMPU, UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

__all__ = ["SequenceParallelMPU", "UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter"]
