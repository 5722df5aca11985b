"""Sharded checkpoints: save/load with resharding on load, consolidation, atomic writes, async save.

Public API:
    save_checkpoint(runtime, dir, tag, ...) -> SaveHandle      sharded save (collective), optionally asynchronous;
                                                                rank 0 puts zero_to_fp32.py (zero_to_fp32_script) in dir
    load_checkpoint(runtime, dir, tag=None, ...) -> LoadResult  load at any world size / stage (collective)
    consolidate(ckpt_dir, out_dir, tag=None, fmt=...) -> Path   offline full fp32 state dict (no process group),
                                                                split by max_shard_size (shards.py)
    ConsolidatedState                                           lazy per-tensor access to a checkpoint's full state
    full_state_dict(runtime), save_model_weights(runtime, out)  full state dict of a running job (collective)
    save_split_checkpoint / load_split_checkpoint               a model split over tensor-parallel ranks: one
                                                                checkpoint per rank plus its SplitRecord; loads at
                                                                any split (split.py)
    load_any_format(runtime, dir, tag, split, rank, ...)        the engine's load: zero's format or DeepSpeed
                                                                0.19's ZeRO folders (formats.py, CheckpointFormat)
    CheckpointLayout                                            stage, world size and the flat groups (JSON-able)
    FlatGroup, Bucket, ParamSlot (zero_core.layout)             the one layout type, re-exported here
    reshard, build_shard, build_optimizer_state, read_param     pure N -> M resharding functions
    Checkpointable                                              what a runtime must provide
    CheckpointError, LayoutMismatchError                        errors naming the file / both layouts
"""

from zero_core.checkpoint.consolidate import ConsolidatedState, consolidate
from zero_core.checkpoint.formats import FORMATS, CheckpointFormat, load_any_format, loaded_model_file
from zero_core.checkpoint.layout import CheckpointLayout, LayoutMismatchError, check_compatible
from zero_core.checkpoint.live import full_state_dict, save_model_weights
from zero_core.checkpoint.load import LoadResult, load_checkpoint
from zero_core.checkpoint.reshard import DictShardSource, build_optimizer_state, build_shard, read_param, reshard
from zero_core.checkpoint.save import SaveHandle, save_checkpoint, wait_pending
from zero_core.checkpoint.split import SplitParam, SplitRecord, load_split_checkpoint, save_split_checkpoint
from zero_core.checkpoint.storage import CheckpointError
from zero_core.checkpoint.target import Checkpointable
from zero_core.layout import Bucket, FlatGroup, LayoutError, ParamSlot

__all__ = [
    "Bucket",
    "CheckpointError",
    "CheckpointFormat",
    "CheckpointLayout",
    "Checkpointable",
    "ConsolidatedState",
    "DictShardSource",
    "FORMATS",
    "FlatGroup",
    "LayoutError",
    "LayoutMismatchError",
    "LoadResult",
    "ParamSlot",
    "SaveHandle",
    "SplitParam",
    "SplitRecord",
    "build_optimizer_state",
    "build_shard",
    "check_compatible",
    "consolidate",
    "full_state_dict",
    "load_any_format",
    "loaded_model_file",
    "load_checkpoint",
    "load_split_checkpoint",
    "read_param",
    "reshard",
    "save_checkpoint",
    "save_split_checkpoint",
    "save_model_weights",
    "wait_pending",
]
