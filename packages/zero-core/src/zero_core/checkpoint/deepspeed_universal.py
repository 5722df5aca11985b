"""DeepSpeed's universal checkpoint (``ds_to_universal``'s output) read as zero's :class:`SavedCheckpoint`, in memory.

A universal tag folder holds every parameter whole, one folder each, so it loads on any number of ranks and at any
stage (DeepSpeed: ``checkpoint.load_universal: true``; the tag is read from ``latest_universal``)::

    mp_rank_00_model_states.pt          the model file of the converted checkpoint (counters, scheduler, buffers);
                                        from stage 3, the per-rank ``zero_pp_rank_<r>_mp_rank_00_model_states.pt``
    zero/optimizer_state.pt             the optimizer's ``param_groups`` and the ZeRO optimizer's scalars (from
                                        stage 3 also the step, in ``optimizer_state_dict``: no ``step.pt``)
    zero/<param name>/fp32.pt           {"param": full fp32 tensor, "cat_dim": ...} (from a stage 3 checkpoint: the
                                        tensor itself, flattened)
    zero/<param name>/<state>.pt        {"param": full tensor} per optimizer state (``exp_avg``, ``exp_avg_sq``);
                                        ``step.pt`` holds the step tensor itself

Here each parameter becomes a one-shard zero flat group (``param<i>``), in its optimizer param group (the model
file's ``param_shapes[j]`` are the flat groups ``param_groups[g]["params"]`` lists), and the ordinary load reshards
it. Files are read through :mod:`zero_core.checkpoint.deepspeed_files` (never unpickled).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from zero_core.checkpoint.deepspeed_files import load_deepspeed_file
from zero_core.checkpoint.deepspeed_read import MODEL_FILE, engine_meta, group_owner, rank_meta_of, whole_entries
from zero_core.checkpoint.layout import CheckpointLayout
from zero_core.checkpoint.load import SavedCheckpoint
from zero_core.checkpoint.reshard import DictShardSource, master_key, optim_key
from zero_core.checkpoint.storage import CheckpointError
from zero_core.layout import FlatGroup

PARAMS_DIR = "zero"
LATEST_UNIVERSAL = "latest_universal"


STAGE3_MODEL_FILE = f"zero_pp_rank_0_{MODEL_FILE}"


def universal_model_file(folder: Path) -> Path | None:
    """The model file of a universal folder: ``mp_rank_00_model_states.pt``, or rank 0's per-rank one where
    ``ds_to_universal`` converted a stage 3 checkpoint (it copies the per-rank model files); None when neither."""
    found = [folder / name for name in (MODEL_FILE, STAGE3_MODEL_FILE) if (folder / name).is_file()]
    return found[0] if found else None


def is_universal_checkpoint(folder: Path) -> bool:
    """``folder`` holds ``zero/optimizer_state.pt`` and a model file (``ds_to_universal``'s output)."""
    return (folder / PARAMS_DIR / "optimizer_state.pt").is_file() and universal_model_file(folder) is not None


def _param_tensor(path: Path, shape: tuple[int, ...]) -> torch.Tensor:
    """The full tensor of one universal file, flattened; CheckpointError when its shape is not ``shape``."""
    obj = load_deepspeed_file(path, expect=(dict, torch.Tensor))
    value = obj.get("param") if isinstance(obj, dict) else obj
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"universal checkpoint file {path} holds no 'param' tensor")
    flat = value.dim() == 1 and value.numel() == math.prod(shape)  # ds_to_universal of stage 3 keeps them flat
    if value.dim() and tuple(value.shape) != shape and not flat:
        raise CheckpointError(f"universal checkpoint file {path}: shape {list(value.shape)}, the model file says "
                              f"{list(shape)}")  # fmt: skip
    return value.detach().reshape(-1).clone() if value.dim() else value.detach().clone()


def saved_step(optim: dict, j: int) -> torch.Tensor | None:
    """The optimizer step of flat group ``j`` in ``zero/optimizer_state.pt``'s ``optimizer_state_dict`` (where
    ``ds_to_universal`` of a stage 3 checkpoint keeps it, writing no ``step.pt``); None where absent."""
    base = optim.get("optimizer_state_dict")
    state = base.get("state") if isinstance(base, dict) else None
    step = state.get(j, {}).get("step") if isinstance(state, dict) else None
    return step.detach().clone() if isinstance(step, torch.Tensor) else None


def open_universal(path: Path) -> SavedCheckpoint:
    """DeepSpeed's universal tag folder ``path`` as a :class:`SavedCheckpoint` with one shard.

    Raises:
        CheckpointError: a missing parameter folder or file, a parameter name that is not one path component, a
            shape that disagrees with the model file, or a refused pickled type (each named).
    """
    path = Path(path)
    model_path = universal_model_file(path)
    if model_path is None:
        raise CheckpointError(f"universal checkpoint {path} has no {MODEL_FILE} nor {STAGE3_MODEL_FILE}")
    model = load_deepspeed_file(model_path)
    optim = load_deepspeed_file(path / PARAMS_DIR / "optimizer_state.pt")
    shapes = list(model.get("param_shapes") or [])
    param_groups = optim.get("param_groups")
    if not isinstance(param_groups, list):
        raise CheckpointError(f"{path / PARAMS_DIR / 'optimizer_state.pt'} holds no optimizer param_groups")
    owner = group_owner(param_groups, len(shapes))
    groups, shard = [], {}
    for j, group_shapes in enumerate(shapes):
        for name, shape in group_shapes.items():
            folder = path / PARAMS_DIR / name
            if "/" in name or name in (".", "..") or not (folder / "fp32.pt").is_file():
                raise CheckpointError(f"universal checkpoint {path} has no parameter folder {folder} with fp32.pt")
            key = f"param{len(groups)}"
            groups.append(FlatGroup.of(key, owner[j], 1, [[(name, tuple(shape))]]))
            shard[master_key(key)] = _param_tensor(folder / "fp32.pt", tuple(shape)).float()
            for state_file in sorted(folder.glob("*.pt")):
                if state_file.name != "fp32.pt":
                    shard[optim_key(state_file.stem, key)] = _param_tensor(state_file, tuple(shape))
            step = saved_step(optim, j)
            if optim_key("step", key) not in shard and step is not None:
                shard[optim_key("step", key)] = step
    tensors = whole_entries(model)
    meta = engine_meta(model, tensors)
    layout = CheckpointLayout(stage=max(int(optim.get("zero_stage", 1)), 1), world_size=1, groups=tuple(groups))
    return SavedCheckpoint(path, meta, tensors, layout, DictShardSource([shard]), rank_meta_of(param_groups, shard))
