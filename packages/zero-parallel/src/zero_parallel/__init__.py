"""Several parallel dimensions on one torch ``DeviceMesh``: Ulysses sequence parallelism for Hugging Face models,
sequence-tiled compute (``TiledMLP``, ``TiledFusedLogitsLoss``, ``SequenceTiledCompute``) for long sequences, and
AutoTP tensor parallelism (column- and row-parallel ``Linear`` layers).

Imports torch and zero_comm; transformers (extra ``hf``) is imported when an adapter is registered with it.
"""

from importlib.metadata import version as _version

from zero_parallel.all_to_all import heads_to_sequence, sequence_to_heads
from zero_parallel.autotp import TensorParallelLayout, apply_autotp, layout_of
from zero_parallel.data import IGNORE_INDEX, UlyssesSPDataLoaderAdapter, sequence_parallel_loss
from zero_parallel.mesh import MESH_DIMS, SequenceParallelMPU, init_parallel_mesh
from zero_parallel.tiled import (
    ParamGather,
    SequenceTiledCompute,
    TiledFusedLogitsLoss,
    TiledMLP,
    no_gather,
    sequence_tiled_compute,
    tile_bounds,
)
from zero_parallel.tp_layers import ColumnParallelLinear, RowParallelLinear, ShardLayout
from zero_parallel.tp_specs import PRESETS, LayerSpec, PartitionConfig, PartitionType, resolve_specs
from zero_parallel.ulysses import UlyssesSPAttentionHF, unregister_from_transformers

__version__ = _version("zero-parallel")  # the one version lives in pyproject.toml; read from the installed metadata

__all__ = [
    "IGNORE_INDEX",
    "MESH_DIMS",
    "ParamGather",
    "SequenceParallelMPU",
    "SequenceTiledCompute",
    "TiledFusedLogitsLoss",
    "TiledMLP",
    "PRESETS",
    "ColumnParallelLinear",
    "LayerSpec",
    "PartitionConfig",
    "PartitionType",
    "RowParallelLinear",
    "SequenceParallelMPU",
    "ShardLayout",
    "TensorParallelLayout",
    "UlyssesSPAttentionHF",
    "UlyssesSPDataLoaderAdapter",
    "apply_autotp",
    "heads_to_sequence",
    "init_parallel_mesh",
    "no_gather",
    "layout_of",
    "resolve_specs",
    "sequence_parallel_loss",
    "sequence_tiled_compute",
    "sequence_to_heads",
    "tile_bounds",
    "unregister_from_transformers",
]
