"""zero's checkpoint written as DeepSpeed's universal checkpoint, the folder ``ds_to_universal`` makes offline.

The layout is the one :mod:`zero_core.checkpoint.deepspeed_universal` reads and DeepSpeed 0.19.8 loads with
``checkpoint.load_universal: true`` (on any number of ranks, at stages 1-2; at stage 3 DeepSpeed wants the per-rank
model files of a stage 3 conversion)::

    <save_dir>/latest_universal         the tag (``ds_to_universal`` writes it beside its output folder)
    <tag>/mp_rank_00_model_states.pt    the stage 1-2 model file ``ds_to_universal`` copies (module state, counters,
                                        ``lr_scheduler``, ``param_shapes``: one dict per optimizer param group)
    <tag>/zero/optimizer_state.pt       rank 0's ZeRO optimizer dict without its partitions (loss scaler, ``clip_grad``,
                                        ``zero_stage``, paddings) plus the torch ``param_groups``
    <tag>/zero/<param>/fp32.pt          {"param": the whole fp32 master, in the parameter's shape, "cat_dim": 0}
    <tag>/zero/<param>/exp_avg.pt ...   the same per optimizer state; ``step.pt`` holds the step tensor itself

As ``ds_to_universal`` does, every module entry without optimizer state (frozen parameters, buffers) also gets a
``fp32.pt`` of its value. The tensors are cut from one world-size view of zero's checkpoint (each param group one
flat group, as a one-rank DeepSpeed run holds it); rank r writes the folders of flat groups ``j % world == r``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from zero_comm import same_outcome
from zero_core.checkpoint import storage
from zero_core.checkpoint.deepspeed_pickle import save_deepspeed_file
from zero_core.checkpoint.deepspeed_read import MODEL_FILE
from zero_core.checkpoint.deepspeed_universal import LATEST_UNIVERSAL, PARAMS_DIR
from zero_core.checkpoint.deepspeed_write import _engine_meta, _scalar_step, _Writer, check_writable
from zero_core.checkpoint.load import open_saved
from zero_core.checkpoint.reshard import build_optimizer_state, build_shard
from zero_core.checkpoint.save import save_checkpoint, wait_pending
from zero_core.checkpoint.target import Checkpointable, rank_and_world
from zero_core.checkpoint.zero_runtime import as_checkpointable

# the partitioned entries ds_to_universal leaves out of optimizer_state.pt
_SHARDED = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")


def _param_folders(writer: _Writer, j: int, folder: Path) -> None:
    """Write ``folder/<param>/{fp32,<state>}.pt`` of every parameter of flat group ``j`` (one rank's view)."""
    g = writer.groups[j]
    master = build_shard(writer.layout, writer.source, "master", g, 0)
    states = _scalar_step(build_optimizer_state(writer.layout, writer.source, g, 0))
    for p in g.slots:
        where = folder / p.name
        where.mkdir(parents=True, exist_ok=True)
        at = slice(p.bucket_offset, p.bucket_offset + p.numel)
        torch.save({"cat_dim": 0, "param": master[at].clone().reshape(p.shape)}, where / "fp32.pt")
        for name, value in states.items():
            if value.dim() == 0:  # ``step``: the tensor itself, as ds_to_universal merges it
                torch.save(value.clone(), where / f"{name}.pt")
            else:
                torch.save({"cat_dim": 0, "param": value[at].clone().reshape(p.shape)}, where / f"{name}.pt")


def _optimizer_state(writer: _Writer, clip_grad: float) -> dict[str, Any]:
    """``zero/optimizer_state.pt``: the optimizer file's common entries and the torch ``param_groups``."""
    osd = writer.optim_file(clip_grad)
    out = {k: v for k, v in osd.items() if k not in _SHARDED}
    out["param_groups"] = osd["base_optimizer_state"]["param_groups"]
    return out


def save_universal_checkpoint(runtime: Checkpointable, save_dir: str | Path, tag: str, *,
                              client_state: dict[str, Any] | None = None, extra_state: dict[str, Any] | None = None,
                              save_latest: bool = True, clip_grad: float = 0.0,
                              param_order: Sequence[Sequence[str]] = (), timeout: float = 600.0) -> Path:  # fmt: skip
    """Collective: write ``save_dir/tag`` as DeepSpeed's universal checkpoint and point ``save_dir/latest_universal``
    at it (what ``ds_to_universal`` makes of a DeepSpeed checkpoint of this run).

    Args:
        runtime: a :class:`Checkpointable` at stage 1-3, fp32 or bf16 (the masters are written in fp32).
        client_state / extra_state / clip_grad / param_order: as :func:`save_deepspeed_checkpoint`'s (the client's
            keys and ``global_steps``, ``global_samples``, ``skipped_steps``, ``lr_scheduler`` go to the model file).
        save_latest: False leaves ``latest_universal`` as it was.

    Returns:
        the tag folder.

    Raises:
        CheckpointError: stage 0 or fp16 (before anything is written), or a rank failed to write; on every rank.
        ValueError: a bad tag.
    """
    wait_pending()
    runtime = as_checkpointable(runtime)
    rank, world = rank_and_world(runtime.group)
    root = Path(save_dir)
    with same_outcome("save_checkpoint", runtime.group, timeout):
        storage.check_tag(tag)
        check_writable(runtime, "universal")
    work = root / f".{tag}.zero-for-universal"
    save_checkpoint(runtime, work, "zero", client_state=client_state, extra_state=extra_state, save_latest=False,
                    recovery_script=False, timeout=timeout)  # fmt: skip
    staging = storage.staging_dir(root, tag)
    with same_outcome("save_checkpoint", runtime.group, timeout):
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)  # left by a crashed save
            (staging / PARAMS_DIR).mkdir(parents=True)
    with same_outcome("save_checkpoint", runtime.group, timeout):
        saved = open_saved(work / "zero")
        # one rank's view: each param group one flat group holding its parameters whole
        writer = _Writer(saved, runtime.module, min(runtime.stage, 2), 0, 1, param_order)
        for j in range(rank, len(writer.groups), world):
            _param_folders(writer, j, staging / PARAMS_DIR)
        if rank == 0:
            save_deepspeed_file(_optimizer_state(writer, clip_grad), staging / PARAMS_DIR / "optimizer_state.pt")
            model = writer.model_file(_engine_meta(saved))
            model["dp_world_size"] = world
            save_deepspeed_file(model, staging / MODEL_FILE)
            trained = {p.name for g in writer.groups for p in g.slots}
            for name, value in model["module"].items():  # ds_to_universal: the entries with no optimizer state
                where = staging / PARAMS_DIR / name
                if name not in trained and "/" not in name:
                    where.mkdir(exist_ok=True)
                    torch.save({"param": value.float()}, where / "fp32.pt")
    final = root / tag
    with same_outcome("save_checkpoint", runtime.group, timeout):
        if rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(staging, final)
            if save_latest:
                tmp = root / f".{LATEST_UNIVERSAL}.tmp"
                tmp.write_text(tag)
                os.replace(tmp, root / LATEST_UNIVERSAL)
            shutil.rmtree(work, ignore_errors=True)
    return final
