"""A pipeline checkpoint read at another pipeline degree: the stages' checkpoints (``pipe_stage_<ss>/<tag>/``,
zero's format) merged by parameter name.

A PipelineModule names its parameters by global layer index (``"<layer>.<param>"``) and tie key
(``"tied_modules.<key>.<param>"``) on whichever stage holds them, so the union of the stages' names is the
single-process module's ``state_dict()``; a tied weight held by several stages is taken from the first (the
stages hold it equal: its gradients are summed over them). Two readers:

* :func:`merged_for_stage`: a one-shard checkpoint in memory holding the given parameters (master weights and
  per-element optimizer state whole, one flat group each; per-buffer state such as ``step`` from the buffer that
  held the parameter), the client and engine state of stage 0, every stage's buffers; zero_core's ``load_saved``
  loads it as any checkpoint (resharded over the data-parallel ranks);
* :func:`load_resharded`: that loaded into an engine (a PipelineEngine of another degree, or a plain engine whose
  module names its parameters as the PipelineModule does, e.g. an ``nn.Sequential`` of the same layers);
* :func:`pipeline_fp32_state_dict`: the fp32 state dict of the whole module (``zero_to_fp32`` on a pipeline folder).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from zero_comm import same_outcome
from zero_core.checkpoint import ConsolidatedState, DictShardSource, read_param
from zero_core.checkpoint.layout import CheckpointLayout, LayoutMismatchError
from zero_core.checkpoint.load import SavedCheckpoint, load_saved, open_saved
from zero_core.checkpoint.reshard import master_key, optim_key, saved_state_names
from zero_core.checkpoint.storage import resolve
from zero_core.layout import FlatGroup

PIPELINE_RECORD = "pipeline.json"
"""The file beside the stages' folders recording the stage count and partition of a saved pipeline."""


def stage_dir(root: str | os.PathLike, stage: int) -> Path:
    """The folder of stage ``stage``'s checkpoints under a pipeline checkpoint ``root``."""
    return Path(root) / f"pipe_stage_{stage:02d}"


def read_record(root: str | os.PathLike) -> dict | None:
    """``root/pipeline.json`` (``stages``, ``virtual_stages``, ``parts``), or None when ``root`` holds none."""
    path = Path(root) / PIPELINE_RECORD
    if not path.is_file():
        return None
    with open(path) as f:
        return json.load(f)


def _stages(root: str | os.PathLike, tag: str | None) -> list[Path]:
    record = read_record(root)
    if record is None:
        raise ValueError(f"{root} is not a pipeline checkpoint (no {PIPELINE_RECORD})")
    return [resolve(stage_dir(root, s), tag) for s in range(record["stages"])]


def merged_for_stage(root: str | os.PathLike, tag: str | None, names: list[str]) -> SavedCheckpoint:
    """The parameters ``names`` of the pipeline checkpoint ``root`` (any stage count) as one in-memory checkpoint.

    Raises:
        LayoutMismatchError: a name no saved stage holds (naming it and the saved stages' count).
        zero_core's CheckpointError: a missing or corrupt file.
    """
    parts = [open_saved(p) for p in _stages(root, tag)]
    base = parts[0]
    owner: dict[str, SavedCheckpoint] = {}
    for part in parts:
        for name in part.layout.param_index():
            owner.setdefault(name, part)
    missing = [n for n in names if n not in owner]
    if missing:
        raise LayoutMismatchError(f"pipeline checkpoint {root} ({len(parts)} stages) holds no parameters "
                                  f"{missing[:8]}: build the PipelineModule from the same layers")  # fmt: skip
    tensors: dict[str, torch.Tensor] = {}
    nontensor: dict[str, Any] = {}
    groups = []
    for i, name in enumerate(names):
        part, key = owner[name], f"param{i}"
        g, slot = part.layout.param_index()[name]
        groups.append(FlatGroup.of(key, g.group_index, 1, [[(name, tuple(slot.shape))]]))
        tensors[master_key(key)] = read_param(part.layout, part.source, "master", name)
        if g.group_index is None:
            continue
        nontensor[key] = part.rank_meta(0)["nontensor_state"].get(g.key, {})
        for state in saved_state_names(part.layout, part.source, g.key):
            if part.source.shape(0, optim_key(state, g.key)) == (g.shard_numel,):
                tensors[optim_key(state, key)] = read_param(part.layout, part.source, f"optim/{state}", name)
            else:  # per buffer (a 0-dim step)
                tensors[optim_key(state, key)] = part.source.get(0, optim_key(state, g.key)).clone()
    for k in base.source.keys(0):
        if k.startswith(("param_groups/", "nontensor/")):
            tensors[k] = base.source.get(0, k)
    model_tensors = dict(base.model_tensors)
    for part in parts[1:]:
        for k, t in part.model_tensors.items():
            if k.startswith("model/"):
                model_tensors.setdefault(k, t)
    layout = CheckpointLayout(base.layout.stage, 1, tuple(groups))
    rank0 = dict(base.rank_meta(0), nontensor_state=nontensor)
    return SavedCheckpoint(base.path, base.meta, model_tensors, layout, DictShardSource([tensors]), lambda r: rank0)


def pipeline_fp32_state_dict(root: str | os.PathLike, tag: str | None = None,
                             exclude_frozen: bool = False) -> dict[str, torch.Tensor]:  # fmt: skip
    """The single-process fp32 state dict of the PipelineModule saved under ``root`` (every stage's keys, a tied
    key once). Raises ValueError when ``root`` is no pipeline checkpoint; zero_core's CheckpointError for a
    missing or corrupt file."""
    out: dict[str, torch.Tensor] = {}
    for path in _stages(root, tag):
        for name, t in ConsolidatedState(path.parent, path.name, torch.float32, exclude_frozen).items():
            out.setdefault(name, t)
    return out


def load_resharded(engine, load_dir: str | os.PathLike, tag: str | None, load_optimizer_states: bool,
                   load_lr_scheduler_states: bool, load_module_only: bool) -> tuple[str, dict]:  # fmt: skip
    """Load the pipeline checkpoint ``load_dir`` into ``engine`` (a zero ``Engine``): its module's parameters by
    name (:func:`merged_for_stage`), the engine state of saved stage 0 unless ``load_module_only``; returns
    ``(path, client_state)``. Collective over every rank; a failure on one raises on all."""
    names = [n for n, _ in engine.module.named_parameters()]
    with same_outcome("load_checkpoint"):  # every stage, not only this one's replicas, learns of a failure
        res = load_saved(engine.runtime, lambda: merged_for_stage(load_dir, tag, names),
                         load_optimizer_states=load_optimizer_states, load_module_only=load_module_only,
                         load_rng=False)  # fmt: skip
    if not load_module_only and res.extra_state:
        engine._restore_engine_state(res.extra_state, load_lr_scheduler_states)
        # a pipeline steps once per batch of gas micro-batches and saves between batches: the next micro-batch
        # starts a batch (a plain engine's accumulation boundary counts micro-steps)
        engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()
    return str(res.path), res.client_state
