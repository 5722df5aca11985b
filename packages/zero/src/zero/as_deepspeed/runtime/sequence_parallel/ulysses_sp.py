"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: DeepSpeed's Ulysses adapter (``zero_parallel``, what
Accelerate's ``sp_backend="deepspeed"`` imports) and the sequence-tiled compute of Arctic Long Sequence Training
(``zero.sequence_tiling``: the ``compute_params`` gathered by zero's stage-3 store)."""

from zero.sequence_tiling import SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute
from zero_parallel import SequenceParallelMPU, UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

__all__ = [
    "sequence_tiled_compute",
    "SequenceParallelMPU",
    "SequenceTiledCompute",
    "TiledFusedLogitsLoss",
    "TiledMLP",
    "UlyssesSPAttentionHF",
    "UlyssesSPDataLoaderAdapter",
]
