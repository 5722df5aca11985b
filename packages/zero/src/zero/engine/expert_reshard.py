"""An expert-parallel checkpoint saved at one ``ep_size`` read for a model at another: the parts re-dealt so this
rank gets its experts (``zero.engine.expert_checkpoints`` writes the parts).

Local expert ``i`` of expert-parallel rank ``e`` is global expert ``e * L + i`` (L: that layer's local experts at
that size). For this rank's expert-parallel rank ``e'`` at the target size (L' local experts), local expert ``i``
is global ``g = e' * L' + i``, read from part ``g // L`` under local index ``g % L``; every other parameter is read
from part 0 (all parts hold the same). The result is a one-shard checkpoint in memory with one flat group per
parameter (master weights and per-element optimizer state whole; per-buffer state such as ``step``, optimizer
hyper-parameters and client/engine state from the source parameter's part), which zero_core's ``load_saved``
reshards onto the runtime as any checkpoint; the RNG is not restored.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from zero_core.checkpoint import CheckpointError
from zero_core.checkpoint.layout import CheckpointLayout
from zero_core.checkpoint.load import SavedCheckpoint, open_saved
from zero_core.checkpoint.reshard import DictShardSource, master_key, optim_key, read_param, saved_state_names
from zero_core.layout import FlatGroup

EXPERT_KEY = re.compile(r"^(.*\.deepspeed_experts\.)(\d+)(\..*)$")
"""A parameter or buffer name of a local expert: (prefix, local index, rest)."""

FUSED_KEY = re.compile(r"^(?:.*\.)?experts\.(?:gate_up_proj|down_proj)$")
"""A fused expert tensor of an AutoEP block ([local experts, ...]: expert-parallel rank e's rows e*L .. (e+1)*L)."""


def part_tag(ep_rank: int) -> str:
    """The folder of expert-parallel rank ``ep_rank``'s checkpoint inside a tag."""
    return f"ep_rank_{ep_rank:02d}"


def local_counts(names) -> dict[str, int]:
    """Expert prefix -> local experts of that MoE layer, from the names holding them."""
    counts: dict[str, int] = {}
    for name in names:
        m = EXPERT_KEY.match(name)
        if m is not None:
            counts[m[1]] = max(counts.get(m[1], 0), int(m[2]) + 1)
    return counts


def redeal(root: Path, saved_size: int, ep_rank: int, names: list[str], ep_size: int) -> SavedCheckpoint:
    """The parts ``root/ep_rank_<e>`` (e < ``saved_size``) of the checkpoint at ``root`` as one checkpoint holding
    the parameters ``names`` of expert-parallel rank ``ep_rank`` at the target size ``ep_size`` (``names``' local
    experts; an AutoEP block's fused expert tensors: every part's rows stacked, this rank's ``1 / ep_size`` of them).

    Raises:
        CheckpointError: a missing or corrupt file, or a parameter the saved parts do not hold (another number of
            experts), named.
    """
    parts = [open_saved(root / part_tag(e)) for e in range(saved_size)]
    indexes = [p.layout.param_index() for p in parts]
    saved_local, target_local = local_counts(indexes[0]), local_counts(names)
    tensors: dict[str, torch.Tensor] = {}
    nontensor: dict = {}
    groups = []
    for i, name in enumerate(names):
        key = f"param{i}"
        if FUSED_KEY.match(name):
            _fused(parts, indexes, name, key, ep_rank, ep_size, tensors, nontensor, groups)
            continue
        e, src = _source(name, ep_rank, saved_local, target_local)
        if e >= saved_size or src not in indexes[e]:
            raise CheckpointError(f"{root}: parameter {name!r} (saved as {src!r} of ep_rank {e}) is not in its "
                                  f"{saved_size} expert-parallel parts: another number of experts?")  # fmt: skip
        part, (g, slot) = parts[e], indexes[e][src]
        groups.append(FlatGroup.of(key, g.group_index, 1, [[(name, tuple(slot.shape))]]))
        tensors[master_key(key)] = read_param(part.layout, part.source, "master", src).reshape(-1)
        if g.group_index is None:
            continue
        nontensor[key] = part.rank_meta(0)["nontensor_state"].get(g.key, {})
        for state in saved_state_names(part.layout, part.source, g.key):
            if part.source.shape(0, optim_key(state, g.key)) == (g.shard_numel,):
                tensors[optim_key(state, key)] = read_param(part.layout, part.source, f"optim/{state}", src).reshape(-1)
            else:  # per buffer (a 0-dim step): the same for every parameter of the buffer
                tensors[optim_key(state, key)] = part.source.get(0, optim_key(state, g.key)).clone()
    base = parts[0]
    for k in base.source.keys(0):
        if k.startswith(("param_groups/", "nontensor/")):
            tensors[k] = base.source.get(0, k)
    model_tensors = {k: v for k, v in base.model_tensors.items() if not EXPERT_KEY.match(k)}
    for e, part in enumerate(parts):  # experts' buffers and frozen tensors, re-dealt like their parameters
        for k, v in part.model_tensors.items():
            m = EXPERT_KEY.match(k)
            if m is not None:
                g_index = e * saved_local[m[1]] + int(m[2])
                if g_index // target_local[m[1]] == ep_rank:
                    model_tensors[f"{m[1]}{g_index % target_local[m[1]]}{m[3]}"] = v
    layout = CheckpointLayout(base.layout.stage, 1, tuple(groups))
    rank0 = dict(base.rank_meta(0), nontensor_state=nontensor)
    return SavedCheckpoint(root, base.meta, model_tensors, layout, DictShardSource([tensors]), lambda r: rank0)


def _source(name: str, ep_rank: int, saved_local: dict, target_local: dict) -> tuple[int, str]:
    m = EXPERT_KEY.match(name)
    if m is None:
        return 0, name
    g = ep_rank * target_local[m[1]] + int(m[2])
    per_part = saved_local.get(m[1], 1)
    return g // per_part, f"{m[1]}{g % per_part}{m[3]}"


def _fused(parts, indexes, name: str, key: str, ep_rank: int, ep_size: int, tensors: dict, nontensor: dict,
           groups: list) -> None:  # fmt: skip
    """Re-deal AutoEP fused expert tensor ``name``: master and per-element optimizer state of every part stacked
    on dim 0, this rank's rows kept, as flat group ``key``."""
    if any(name not in index for index in indexes):
        raise CheckpointError(f"{parts[0].path}: fused expert tensor {name!r} is not in every expert-parallel "
                              "part")  # fmt: skip
    g, slot = indexes[0][name]
    rows = slot.shape[0] * len(parts) // ep_size
    span = slice(ep_rank * rows, (ep_rank + 1) * rows)

    def stacked(kind: str) -> torch.Tensor:
        whole = [read_param(p.layout, p.source, kind, name).view(idx[name][1].shape) for p, idx in zip(parts, indexes)]
        return torch.cat(whole)[span].reshape(-1)

    tensors[master_key(key)] = stacked("master")
    groups.append(FlatGroup.of(key, g.group_index, 1, [[(name, (rows, *slot.shape[1:]))]]))
    if g.group_index is None:
        return
    part = parts[0]
    nontensor[key] = part.rank_meta(0)["nontensor_state"].get(g.key, {})
    for state in saved_state_names(part.layout, part.source, g.key):
        if part.source.shape(0, optim_key(state, g.key)) == (g.shard_numel,):
            tensors[optim_key(state, key)] = stacked(f"optim/{state}")
        else:
            tensors[optim_key(state, key)] = part.source.get(0, optim_key(state, g.key)).clone()
