"""Several parallel dimensions on one torch ``DeviceMesh``: Ulysses sequence parallelism for Hugging Face models,
AutoTP tensor parallelism (column- and row-parallel ``Linear`` layers).

Imports torch and zero_comm; transformers (extra ``hf``) is imported when an adapter is registered with it.
"""

from importlib.metadata import version as _version

from zero_parallel.all_to_all import heads_to_sequence, sequence_to_heads
from zero_parallel.autotp import TensorParallelLayout, apply_autotp, layout_of
from zero_parallel.data import IGNORE_INDEX, UlyssesSPDataLoaderAdapter, sequence_parallel_loss
from zero_parallel.mesh import MESH_DIMS, SequenceParallelMPU, init_parallel_mesh
from zero_parallel.tp_layers import ColumnParallelLinear, RowParallelLinear, ShardLayout
from zero_parallel.tp_specs import PRESETS, LayerSpec, PartitionConfig, PartitionType, resolve_specs
from zero_parallel.ulysses import UlyssesSPAttentionHF, unregister_from_transformers

__version__ = _version("zero-parallel")  # the one version lives in pyproject.toml; read from the installed metadata

__all__ = [
    "IGNORE_INDEX",
    "MESH_DIMS",
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
    "layout_of",
    "resolve_specs",
    "sequence_parallel_loss",
    "sequence_to_heads",
    "unregister_from_transformers",
]
