"""A DeepSpeed 0.19.x checkpoint written without ZeRO (stage 0) read as zero's :class:`SavedCheckpoint`, in memory.

Without ZeRO DeepSpeed writes one file, ``mp_rank_00_model_states.pt``: the whole module under ``module`` (in the
run's dtype) and the optimizer's ``state_dict()`` under ``optimizer``, with no ``param_shapes``:

* fp32: the torch optimizer's own ``state_dict()`` (``state`` keyed by the parameter's position over the param
  groups, ``param_groups``); the module holds the fp32 weights.
* fp16 and bf16 (DeepSpeed's ``FP16_UnfusedOptimizer`` / ``FP16_Optimizer``, which it also builds for bf16 at stage
  0): ``optimizer_state_dict`` (the torch one), the fp32 master weights ``fp32_groups[g][i]`` per param group and
  position, and the loss scaler's ``cur_scale``, ``cur_iter``, ``last_overflow_iter`` (``dynamic_loss_scale``).

The file names no parameter of the optimizer state: DeepSpeed loads it by position into the running optimizer, and so
does this reader, given the running optimizer's parameter names per param group (``param_order``). Each parameter
becomes a one-shard zero flat group (``param<i>``) and the ordinary load reshards it onto any rank count and stage.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from zero_core.checkpoint.deepspeed_files import load_deepspeed_file
from zero_core.checkpoint.deepspeed_read import (
    MODEL_FILE,
    engine_meta,
    open_deepspeed,
    optim_file_names,
    rank_meta_of,
    whole_entries,
)
from zero_core.checkpoint.layout import CheckpointLayout
from zero_core.checkpoint.load import SavedCheckpoint
from zero_core.checkpoint.reshard import DictShardSource, master_key, optim_key
from zero_core.checkpoint.storage import CheckpointError
from zero_core.layout import FlatGroup


def is_stage0(model: dict[str, Any]) -> bool:
    """DeepSpeed's model file ``model`` holds the optimizer state itself (no ZeRO optimizer files beside it)."""
    return model.get("param_shapes") is None and isinstance(model.get("optimizer"), dict)


def scaler_state(opt: dict[str, Any]) -> dict[str, Any] | None:
    """zero's ``DynamicLossScaler`` state of DeepSpeed's fp16 optimizer state ``opt``; None for a static scale."""
    if not opt.get("dynamic_loss_scale"):
        return None
    return {"scale": float(opt["cur_scale"]), "cur_iter": int(opt["cur_iter"]),
            "last_overflow_iter": int(opt["last_overflow_iter"])}  # fmt: skip


def open_any_stage(path: Path, param_order: list[list[str]] | None = None) -> SavedCheckpoint:
    """DeepSpeed's ZeRO (stages 1-3, :func:`~zero_core.checkpoint.deepspeed_read.open_deepspeed`) or stage 0 tag
    folder ``path`` as a :class:`SavedCheckpoint`; ``param_order`` serves stage 0 (:func:`open_stage0`)."""
    path = Path(path)
    model_path = path / MODEL_FILE
    if model_path.is_file() and not optim_file_names(path):
        model = load_deepspeed_file(model_path)
        if is_stage0(model):
            return open_stage0(path, model_path, model, param_order)
    return open_deepspeed(path)


def open_stage0(path: Path, model_path: Path, model: dict[str, Any],
                param_order: list[list[str]] | None) -> SavedCheckpoint:  # fmt: skip
    """DeepSpeed's stage 0 tag folder ``path`` (its model file ``model`` read from ``model_path``) as a one-shard
    :class:`SavedCheckpoint`; ``param_order``: the running optimizer's parameter names per param group.

    Raises:
        CheckpointError: no ``param_order`` (a stage 0 file names no parameter), param groups that differ in number
            or size from the running optimizer's, a parameter missing from ``module``, or a master of another size.
    """
    opt = model["optimizer"]
    wrapped = "optimizer_state_dict" in opt  # DeepSpeed's fp16/bf16 optimizer around the torch one
    base = opt["optimizer_state_dict"] if wrapped else opt
    param_groups = base.get("param_groups")
    if not isinstance(param_groups, list):
        raise CheckpointError(f"{model_path}: its optimizer state holds no param_groups")
    if param_order is None:
        raise CheckpointError(f"{model_path} is a DeepSpeed checkpoint without ZeRO (stage 0): its optimizer "
                              "state names no parameter, so it loads only into an engine (by position, as "
                              "DeepSpeed)")  # fmt: skip
    saved_sizes, sizes = [len(pg["params"]) for pg in param_groups], [len(names) for names in param_order]
    if saved_sizes != sizes:
        raise CheckpointError(f"{model_path}: the saved optimizer's param groups hold {saved_sizes} parameters, "
                              f"the running optimizer's {sizes}; DeepSpeed loads stage 0 optimizer state by "
                              "position")  # fmt: skip
    module = model.get("module") or {}
    groups, shard = [], {}
    for g, (pg, names) in enumerate(zip(param_groups, param_order)):
        for i, (index, name) in enumerate(zip(pg["params"], names)):
            if name not in module:
                raise CheckpointError(f"{model_path}: parameter {name!r} of param group {g} is not in its module")
            shape = tuple(module[name].shape)
            master = opt["fp32_groups"][g][i] if wrapped else module[name]
            if master.numel() != math.prod(shape):
                raise CheckpointError(f"{model_path}: the fp32 master of {name!r} (param group {g}, position {i}) "
                                      f"holds {master.numel()} elements, the module's {list(shape)}")  # fmt: skip
            key = f"param{len(groups)}"
            groups.append(FlatGroup.of(key, g, 1, [[(name, shape)]]))
            shard[master_key(key)] = master.detach().reshape(-1).float().clone()
            for state, value in base["state"].get(index, {}).items():
                if isinstance(value, torch.Tensor):
                    shard[optim_key(state, key)] = value.detach().reshape(-1 if value.dim() else ()).clone()
    known = {n for names in param_order for n in names} | set(model.get("buffer_names") or [])
    frozen = {n: tuple(t.shape) for n, t in module.items() if n not in known}
    if frozen:  # parameters in no param group: kept whole in the module, as zero's frozen group
        key = f"param{len(groups)}"
        groups.append(FlatGroup.of(key, None, 1, [list(frozen.items())]))
        whole = torch.cat([module[n].detach().reshape(-1) for n in frozen])
        shard[master_key(key)] = torch.cat([whole, whole.new_zeros(groups[-1].shard_numel - whole.numel())])
    tensors = whole_entries(model)
    meta = engine_meta(model, tensors, scaler_state(opt) if wrapped else None)
    layout = CheckpointLayout(stage=1, world_size=1, groups=tuple(groups))
    return SavedCheckpoint(path, meta, tensors, layout, DictShardSource([shard]), rank_meta_of(param_groups, shard))
