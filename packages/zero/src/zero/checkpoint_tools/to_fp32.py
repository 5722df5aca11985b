"""A sharded checkpoint consolidated into one fp32 state dict: DeepSpeed's ``zero_to_fp32`` functions (served as
``deepspeed.utils.zero_to_fp32``) on zero's checkpoints (zero_core.checkpoint does the reading).

Signatures follow DeepSpeed 0.19.8. zero's checkpoints hold fp32 master shards and a layout, so any world size
and stage consolidates directly; no process group is needed.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from zero.config import NotSupportedError


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, torch.Tensor]:
    """The full fp32 state dict (every ``state_dict()`` key, tied keys included) of ``checkpoint_dir/tag``; for a
    pipeline checkpoint (``PipelineEngine.save_checkpoint``'s folder) the single-process PipelineModule's, every
    stage's keys merged.

    Args:
        checkpoint_dir: the folder ``save_checkpoint`` wrote (holding ``latest`` and the tag folders).
        tag: e.g. ``"global_step14"``; default: the tag in ``checkpoint_dir/latest``.
        exclude_frozen_parameters: omit the frozen parameters outside the optimizer (zero's frozen-only flat
            groups; buffers stay). Parameters a checkpoint saved with ``exclude_frozen_parameters=True`` lacks are
            omitted either way, as DeepSpeed's ``zero_to_fp32``.
        lazy_mode: must be False (NotSupportedError otherwise).

    Returns:
        name -> CPU tensor: floating tensors fp32, integer buffers as stored. Loads with ``strict=True`` unless
        frozen parameters were left out. A checkpoint of DeepSpeed MoE layers with ``ep_size`` > 1 gives the
        state dict of the same model with ``ep_size`` 1 (every expert under its global index).

    Raises:
        zero_core.checkpoint.CheckpointError / FileNotFoundError naming the missing or corrupt file.
    """
    if lazy_mode:
        raise NotSupportedError(
            "get_fp32_state_dict_from_zero_checkpoint(lazy_mode=True) is not supported; use "
            "zero_core.checkpoint.ConsolidatedState for per-tensor reads"
        )
    from zero.engine.expert_checkpoints import dense_state_dict, expert_parallel_root
    from zero.engine.pipeline_reshard import pipeline_fp32_state_dict, read_record
    from zero_core.checkpoint import ConsolidatedState

    experts = expert_parallel_root(checkpoint_dir, tag)  # MoE layers of ep_size > 1: the ep_size 1 model's names
    if experts is not None:
        return dense_state_dict(experts, torch.float32, exclude_frozen_parameters)
    if read_record(checkpoint_dir) is not None:  # a PipelineEngine's folder: its stages merged
        return pipeline_fp32_state_dict(checkpoint_dir, tag, exclude_frozen_parameters)
    return dict(ConsolidatedState(checkpoint_dir, tag, torch.float32, exclude_frozen_parameters).items())


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    max_shard_size: str = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> str:
    """Write the checkpoint's full fp32 state dict into ``output_dir`` (streamed tensor by tensor).

    ``safe_serialization=True``: ``model.safetensors``; False: ``pytorch_model.bin`` (DeepSpeed's names), plus
    ``config.json`` for transformers models. Files of at most ``max_shard_size`` (``"5GB"`` = 5e9 bytes, an int
    in bytes, None: one file; a checkpoint of MoE layers or AutoEP blocks with ``ep_size`` > 1: one file of the
    ``ep_size`` 1 model's state dict, the transformers model's own for AutoEP): a larger state dict is split into
    ``model-00001-of-0000N.safetensors`` ... with
    ``model.safetensors.index.json`` (``pytorch_model-...bin``, ``pytorch_model.bin.index.json``), as DeepSpeed.

    Returns:
        the written file's path (the index file's when split; DeepSpeed returns None).

    Raises:
        CheckpointError naming a missing/corrupt file; ValueError: ``max_shard_size`` is not a size;
        NotSupportedError: a pipeline checkpoint (use :func:`get_fp32_state_dict_from_zero_checkpoint`).
    """
    from zero.engine.expert_checkpoints import expert_parallel_root, write_dense
    from zero.engine.pipeline_reshard import read_record
    from zero_core.checkpoint import consolidate

    experts = expert_parallel_root(checkpoint_dir, tag)  # MoE layers of ep_size > 1: one file, every expert
    if experts is not None:
        return str(write_dense(experts, Path(output_dir), safe_serialization, exclude_frozen_parameters))
    if read_record(checkpoint_dir) is not None:
        raise NotSupportedError(f"convert_zero_checkpoint_to_fp32_state_dict: {checkpoint_dir} is a pipeline "
                                "checkpoint (pipeline.json); get_fp32_state_dict_from_zero_checkpoint gives its "
                                "whole state dict, to save as you like")  # fmt: skip
    fmt = "safetensors" if safe_serialization else "torch"
    return str(consolidate(Path(checkpoint_dir), Path(output_dir), tag=tag, fmt=fmt, dtype=torch.float32,
                           exclude_frozen=exclude_frozen_parameters, max_shard_size=max_shard_size))  # fmt: skip


def load_state_dict_from_zero_checkpoint(
    model: torch.nn.Module, checkpoint_dir: str | os.PathLike, tag: str | None = None
) -> torch.nn.Module:
    """Move ``model`` to the CPU, load the checkpoint's fp32 state dict into it (``strict=False``, as DeepSpeed),
    and return it. The model must be a plain module (not one being trained by an engine)."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model
