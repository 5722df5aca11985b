"""Sequence-tiled compute (Arctic Long Sequence Training) for zero's engine, served with ``zero_parallel``'s Ulysses
adapter as ``deepspeed.runtime.sequence_parallel.ulysses_sp`` (the implementation and its docs live in
``zero_parallel``). The tiled classes here gather their ``compute_params`` through zero's stage-3 store
(``zero_core.gathered_for_compute``): once per forward and once per backward of a call, not once per tile."""

from zero_core import gathered_for_compute
from zero_parallel import tiled as _tiled

__all__ = ["SequenceTiledCompute", "TiledFusedLogitsLoss", "TiledMLP", "sequence_tiled_compute"]


class TiledMLP(_tiled.TiledMLP):
    """``zero_parallel.TiledMLP`` with the ``compute_params`` gathered by zero's stage-3 store (DeepSpeed's
    ``TiledMLP.apply(fn, self, x, shards, compute_params)``)."""

    gather = staticmethod(gathered_for_compute)


class TiledFusedLogitsLoss(_tiled.TiledFusedLogitsLoss):
    """``zero_parallel.TiledFusedLogitsLoss`` with the ``compute_params`` gathered by zero's stage-3 store
    (DeepSpeed's ``TiledFusedLogitsLoss.apply(fn, self, x, y, mask, shards, compute_params, output_reduction)``)."""

    gather = staticmethod(gathered_for_compute)


class SequenceTiledCompute(_tiled.SequenceTiledCompute):
    """``zero_parallel.SequenceTiledCompute`` with the ``compute_params`` gathered by zero's stage-3 store."""

    gather = staticmethod(gathered_for_compute)


def sequence_tiled_compute(fn, seqlen, shards, kwargs_to_shard, kwargs_to_pass, grad_requiring_tensor_key,
                           compute_params=None, output_unshard_dimension=1, output_reduction="mean"):  # fmt: skip
    """DeepSpeed's ``sequence_tiled_compute`` (``zero_parallel.sequence_tiled_compute`` through this module's
    :class:`SequenceTiledCompute`); returns and raises what it does."""
    return _tiled.sequence_tiled_compute(fn, seqlen, shards, kwargs_to_shard, kwargs_to_pass,
                                         grad_requiring_tensor_key, compute_params, output_unshard_dimension,
                                         output_reduction, tiler=SequenceTiledCompute)  # fmt: skip
