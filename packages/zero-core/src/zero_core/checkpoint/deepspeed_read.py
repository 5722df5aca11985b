"""A DeepSpeed 0.19.x ZeRO checkpoint folder (``global_stepN/``) read as zero's :class:`SavedCheckpoint`, in memory.

DeepSpeed's files (read through :mod:`zero_core.checkpoint.deepspeed_files`, never unpickled)::

    mp_rank_00_model_states.pt                  stages 1-2: module state (buffers, frozen params), ``param_shapes``
    zero_pp_rank_<r>_mp_rank_00_model_states.pt stage 3: one per rank, the same keys
    [bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt   rank r: fp32 master partition(s) and the torch optimizer's
                                                         state of that partition

How the flat fp32 partitions are laid out (as DeepSpeed's ``stage_1_and_2.py``, ``stage3.py`` and
``zero_to_fp32.py`` define it), expressed as zero's own ``FlatGroup`` layout so the load reshards it like any zero
checkpoint (any rank count, any stage):

* stages 1-2 (and DeepSpeed's ``BF16_Optimizer``, which it builds for bf16 at stage 1 with fp32 gradient
  accumulation: the same keys without ``zero_stage`` and ``param_alignment_paddings``): one flat buffer per optimizer
  param group, its parameters in ``param_shapes[i]`` order, each followed by its ``param_alignment_paddings``
  elements (none for ``BF16_Optimizer``), the whole padded to a multiple of ``2 * world`` and cut into
  ``world`` equal partitions. Rank r's ``single_partition_of_fp32_groups[i]`` is its partition with the group's
  trailing padding removed (``group_paddings``); its optimizer state keeps the padding. One zero bucket per group.
* stage 3: one flat buffer per sub-group (``fp32_flat_groups[j]``, ``param_shapes[j]``); every parameter is
  padded to a multiple of ``world`` and cut on its own, so rank r holds the r-th piece of each parameter in turn.
  One zero bucket per parameter. Which param group a sub-group belongs to is read from the saved optimizer's
  ``param_groups[g]["params"]`` (sub-group indices).

Every rank opens every rank's files, memory-mapped (``torch.load(mmap=True)``): the load then copies only the
element ranges of its own shard (and the partitions that need their padding put back).

The engine counters (``global_steps``, ``global_samples``, ``skipped_steps``) and ``lr_scheduler`` come back as the
extra state; every other top-level key of the model file except DeepSpeed's own comes back as the client state,
as DeepSpeed's ``load_checkpoint`` returns it. DeepSpeed saves no RNG state, so none is restored. A folder saved
with ``exclude_frozen_parameters=True`` lacks the frozen parameters: the load keeps the module's values for them
(:mod:`zero_core.checkpoint.left_out`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from zero_core.checkpoint.codec import encode
from zero_core.checkpoint.deepspeed_files import PickledRecord, load_deepspeed_file
from zero_core.checkpoint.layout import CheckpointLayout
from zero_core.checkpoint.left_out import MAY_LEAVE_OUT
from zero_core.checkpoint.load import SavedCheckpoint
from zero_core.checkpoint.reshard import DictShardSource, master_key, optim_key
from zero_core.checkpoint.storage import CheckpointError
from zero_core.layout import FlatGroup

MODEL_FILE = "mp_rank_00_model_states.pt"
# what DeepSpeed's BF16_Optimizer saves instead of a ZeRO stage: stage 1-2's flat fp32 partitions, no alignment paddings
BF16_OPTIMIZER_KEYS = frozenset({"single_partition_of_fp32_groups", "group_paddings", "base_optimizer_state",
                                 "param_slice_mappings"})  # fmt: skip
# files of a model split by tensor (mp_rank_01 ...) or pipeline (layer_NN-...) parallelism
_SPLIT_RE = re.compile(r"^(?:.*mp_rank_(?!00_)\d+_.*|layer_\d+-.*model_states)\.pt$")
_OPTIM_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
# keys of DeepSpeed's model file that are its own, not the client's (DeepSpeed's load_checkpoint leaves out these)
OWN_KEYS = frozenset({"module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size", "data_sampler",
                      "random_ltd", "lr_scheduler", "optimizer"})  # fmt: skip


def is_deepspeed_checkpoint(path: Path) -> bool:
    """``path`` holds DeepSpeed's model-state file (``mp_rank_00_model_states.pt`` or stage 3's
    ``zero_pp_rank_0_mp_rank_00_model_states.pt``)."""
    return (path / MODEL_FILE).is_file() or (path / f"zero_pp_rank_0_{MODEL_FILE}").is_file()


def optim_file_names(path: Path) -> dict[int, Path]:
    """The ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` files of folder ``path`` by rank."""
    return {int(m.group(1)): p for p in path.iterdir() if (m := _OPTIM_RE.match(p.name))}


def optim_files(path: Path) -> list[Path]:
    """Rank order of the ``*_optim_states.pt`` files. Raises CheckpointError when a rank's file is missing."""
    found = optim_file_names(path)
    if not found:
        raise CheckpointError(f"DeepSpeed checkpoint {path} has no zero_pp_rank_<r>_mp_rank_00_optim_states.pt: "
                              "only ZeRO stage 1-3 checkpoints are read")  # fmt: skip
    missing = sorted(set(range(max(found) + 1)) - set(found))
    if missing:
        raise CheckpointError(f"DeepSpeed checkpoint {path} lacks the optimizer states of ranks {missing}")
    return [found[r] for r in sorted(found)]


def _slots(shapes: dict, paddings: Sequence[int]) -> tuple[list[dict], int]:
    """zero's slot dicts of one DeepSpeed stage 1-2 group, and the group's unpadded length (paddings included)."""
    out, at = [], 0
    for (name, shape), pad in zip(shapes.items(), paddings):
        out.append({"name": name, "shape": list(shape), "offset": at})
        at += math.prod(shape) + int(pad)
    return out, at


def _padded(t: torch.Tensor, n: int, what: str, fp32: bool = True) -> torch.Tensor:
    flat = t.detach().reshape(-1).float() if fp32 else t.detach().reshape(-1)
    if flat.numel() > n:
        raise CheckpointError(f"{what}: {flat.numel()} elements, more than the partition's {n}")
    return torch.cat([flat, flat.new_zeros(n - flat.numel())]) if flat.numel() < n else flat


class _Reader:
    """One DeepSpeed checkpoint folder's files, read once; builds the layout and the per-rank shard dicts."""

    def __init__(self, path: Path):
        self.path = path
        split = sorted(p.name for p in path.iterdir() if _SPLIT_RE.match(p.name))
        if split:
            raise CheckpointError(f"DeepSpeed checkpoint {path} was written with model/tensor or pipeline "
                                  f"parallelism ({split[:3]}); only data-parallel ZeRO checkpoints are read (convert "
                                  "it with DeepSpeed's ds_to_universal and load the universal folder)")  # fmt: skip
        self.optim_paths = optim_files(path)
        self.world = len(self.optim_paths)
        self.optim = [load_deepspeed_file(p).get("optimizer_state_dict") for p in self.optim_paths]
        for p, osd in zip(self.optim_paths, self.optim):
            if not isinstance(osd, dict) or ("zero_stage" not in osd and BF16_OPTIMIZER_KEYS - set(osd)):
                raise CheckpointError(f"{p} holds no ZeRO optimizer_state_dict (zero_stage missing)")
        # DeepSpeed's BF16_Optimizer (bf16 at stage 1 with fp32 gradient accumulation) names no stage
        self.stage = int(self.optim[0].get("zero_stage", 1))
        counts = self.optim[0].get("partition_count")
        count = max(counts) if isinstance(counts, list) else counts
        if count != self.world:
            present = {int(_OPTIM_RE.match(p.name).group(1)) for p in self.optim_paths}
            missing = sorted(set(range(count)) - present)
            raise CheckpointError(f"DeepSpeed checkpoint {path} was written by {count} ranks; it lacks the optimizer "
                                  f"states of ranks {missing} (zero_pp_rank_<r>_mp_rank_00_optim_states.pt), or "
                                  f"holds {self.world} files of another run (overwritten or partial)")  # fmt: skip
        name = MODEL_FILE if self.stage < 3 else f"zero_pp_rank_0_{MODEL_FILE}"
        self.model_path = path / name
        self.model = load_deepspeed_file(self.model_path)
        self.shapes: list[dict] = list(self.model.get("param_shapes") or [])

    def base_state(self, r: int) -> dict:
        """Rank r's torch optimizer ``state_dict()`` (stage 1-2 ``base_optimizer_state``, stage 3's own key)."""
        osd = self.optim[r]
        base = osd.get("base_optimizer_state" if self.stage < 3 else "optimizer_state_dict")
        if not isinstance(base, dict) or "param_groups" not in base:
            raise CheckpointError(f"{self.optim_paths[r]}: the optimizer state is not a torch state_dict "
                                  "(zero_optimization.elastic_checkpoint checkpoints are not read)")  # fmt: skip
        return base

    def groups(self) -> tuple[list[FlatGroup], list[list[torch.Tensor]], list[int]]:
        """The flat groups, each rank's fp32 partition of each (padded to the partition), and each group's
        optimizer param group."""
        fp32 = [osd["single_partition_of_fp32_groups" if self.stage < 3 else "fp32_flat_groups"] for osd in self.optim]
        if len(self.shapes) != len(fp32[0]):
            raise CheckpointError(f"{self.model_path}: {len(self.shapes)} param_shapes groups, {len(fp32[0])} fp32 "
                                  f"flat groups in {self.optim_paths[0]}")  # fmt: skip
        owner = group_owner(self.base_state(0)["param_groups"], len(self.shapes))
        groups, parts = [], []
        for j, shapes in enumerate(self.shapes):
            key = f"group{j}"
            if self.stage < 3:
                paddings = self.optim[0].get("param_alignment_paddings") or [[0] * len(s) for s in self.shapes]
                slots, numel = _slots(shapes, paddings[j])
                chunk = fp32[0][j].numel() + int(self.optim[0]["group_paddings"][j])
                buckets = [{"params": slots, "numel": numel, "padded_numel": chunk * self.world}]
            else:
                buckets = []
                for name, shape in shapes.items():
                    n = math.prod(shape)
                    buckets.append({"params": [{"name": name, "shape": list(shape), "offset": 0}], "numel": n,
                                    "padded_numel": math.ceil(n / self.world) * self.world})  # fmt: skip
            g = FlatGroup.from_dict({"key": key, "optim_group": owner[j], "buckets": buckets, "world_size": self.world})
            parts.append([_padded(fp32[r][j], g.shard_numel, f"{self.optim_paths[r]} fp32 group {j}")
                          for r in range(self.world)])  # fmt: skip
            groups.append(g)
        frozen = self.frozen_group()
        if frozen is not None:
            groups.append(frozen[0])
            parts.append(frozen[1])
        return groups, parts, owner

    def frozen_group(self) -> tuple[FlatGroup, list[torch.Tensor]] | None:
        """The parameters in no optimizer param group (``frozen_param_shapes``) as zero's frozen flat group
        ``frozen`` (their own dtype) and each rank's shard of it: stages 1-2 keep them whole in the model file (one
        shard; stage 1 lists no ``frozen_param_shapes``: they are its module entries outside ``param_shapes`` and
        the buffers and tied aliases, ``shared_params``), stage 3 keeps each rank's piece of every one
        (``frozen_param_fragments`` of rank r's model file)."""
        shapes = {n: tuple(s) for n, s in (self.model.get("frozen_param_shapes") or {}).items()}
        module = self.model.get("module") or {}
        if not shapes and self.stage < 3:  # stage 1 records none: the module entries outside param_shapes and buffers
            known = {n for group in self.shapes for n in group} | set(self.model.get("buffer_names") or [])
            known |= set(self.model.get("shared_params") or {})  # tied aliases (name -> the parameter it shares)
            shapes = {n: tuple(t.shape) for n, t in module.items() if n not in known}
        if not shapes:
            return None
        if self.stage < 3:
            g = FlatGroup.of("frozen", None, 1, [list(shapes.items())])
            missing = [n for n in shapes if n not in module]
            if missing:
                raise CheckpointError(f"{self.model_path}: frozen parameters {missing[:4]} are not in its module")
            whole = torch.cat([module[n].detach().reshape(-1) for n in shapes])
            return g, [_padded(whole, g.shard_numel, f"{self.model_path} frozen parameters", fp32=False)]
        g = FlatGroup.of("frozen", None, self.world, [[item] for item in shapes.items()])
        parts = []
        for r in range(self.world):
            model_path = self.path / f"zero_pp_rank_{r}_{MODEL_FILE}"
            fragments = (self.model if r == 0 else load_deepspeed_file(model_path)).get("frozen_param_fragments") or {}
            pieces = []
            for b in g.buckets:
                name = b.slots[0].name
                if name not in fragments:
                    raise CheckpointError(f"{model_path}: no frozen_param_fragments entry for {name!r}")
                pieces.append(_padded(fragments[name], b.chunk, f"{model_path} frozen {name!r}", fp32=False))
            parts.append(torch.cat(pieces))
        return g, parts

    def shard_dicts(self, groups: list[FlatGroup], parts: list[list[torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """Per rank: ``master/<key>`` and ``optim/<state>/<key>`` tensors in zero's shard-file form."""
        out = []
        for r in range(self.world):
            state = self.base_state(r)["state"]
            tensors = {}
            for j, g in enumerate(groups):
                if r < len(parts[j]):  # a frozen group of stages 1-2 is one shard
                    tensors[master_key(g.key)] = parts[j][r]
                for name, value in state.get(j, {}).items() if g.group_index is not None else ():
                    if not isinstance(value, torch.Tensor):
                        continue
                    where = f"{self.optim_paths[r]} optimizer state {name!r} of group {j}"
                    tensors[optim_key(name, g.key)] = value.detach().clone() if value.dim() == 0 else _padded(
                        value, g.shard_numel, where)  # fmt: skip
            out.append(tensors)
        return out


def whole_entries(model: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``model/<name>`` of the module buffers DeepSpeed's model file ``model`` keeps (``buffer_names``)."""
    module = model.get("module") or {}
    return {f"model/{n}": module[n].detach().clone() for n in model.get("buffer_names") or [] if n in module}


def engine_meta(model: dict[str, Any], tensors: dict[str, torch.Tensor],
                loss_scaler: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """zero's model-state meta of DeepSpeed's model file ``model``: the engine counters, ``lr_scheduler`` and the
    fp16 dynamic ``loss_scaler`` state (zero's ``DynamicLossScaler.state_dict()`` keys, None: static) as the extra
    state, the keys that are not DeepSpeed's own as the client state (their tensors go into ``tensors``)."""
    extra = {k: model[k] for k in ("global_steps", "global_samples", "skipped_steps") if k in model}
    if model.get("lr_scheduler") is not None:
        extra["lr_scheduler"] = model["lr_scheduler"]
    if loss_scaler is not None:
        extra["loss_scaler"] = loss_scaler
    client = {k: v for k, v in model.items() if k not in OWN_KEYS}
    return {"client_state": encode(client, tensors, "client"), "extra_state": encode(extra, tensors, "extra"),
            "excluded_frozen": [], MAY_LEAVE_OUT: True}  # fmt: skip


def group_owner(param_groups: list[dict], count: int) -> list[int]:
    """The optimizer param group of each of DeepSpeed's ``count`` flat groups (``param_groups[g]["params"]`` lists
    the flat-group indices of group g). Raises CheckpointError when one is in no group."""
    owner: list[int | None] = [None] * count
    for g, pg in enumerate(param_groups):
        for j in pg["params"]:
            if not 0 <= j < count:
                raise CheckpointError(f"optimizer param group {g} names flat group {j}; there are {count}")
            owner[j] = g
    if None in owner:
        raise CheckpointError(f"flat groups {[j for j, g in enumerate(owner) if g is None]} are in no optimizer "
                              "param group")  # fmt: skip
    return owner


def rank_meta_of(param_groups: list[dict], rank0_tensors: dict[str, torch.Tensor]):
    """``SavedCheckpoint.rank_meta`` for DeepSpeed's saved torch ``param_groups`` (hyper-parameters from rank 0,
    no non-tensor state, no RNG)."""
    hyper = [{k: v for k, v in pg.items() if k != "params"} for pg in param_groups]
    rank0 = {"param_groups": encode(hyper, rank0_tensors, "param_groups"), "nontensor_state": {}}

    def rank_meta(r: int) -> dict[str, Any]:
        return rank0 if r == 0 else {"nontensor_state": {}}

    return rank_meta


def zero_scaler_state(osd: dict[str, Any]) -> dict[str, Any] | None:
    """zero's ``DynamicLossScaler`` state of a ZeRO optimizer state ``osd`` saved with fp16's dynamic loss scale
    (its pickled ``loss_scaler``: ``cur_scale``, ``cur_iter``, ``last_overflow_iter``, ``cur_hysteresis``); None for
    a static scale (fp32, bf16)."""
    scaler = osd.get("loss_scaler")
    if not osd.get("dynamic_loss_scale") or not isinstance(scaler, PickledRecord):
        return None
    state = scaler.state
    return {"scale": float(state["cur_scale"]), "cur_iter": int(state["cur_iter"]),
            "last_overflow_iter": int(state["last_overflow_iter"]),
            "cur_hysteresis": int(state["cur_hysteresis"])}  # fmt: skip


def open_deepspeed(path: Path) -> SavedCheckpoint:
    """DeepSpeed's checkpoint folder ``path`` (one tag) as a :class:`SavedCheckpoint` zero's load reshards.

    Raises:
        CheckpointError: a missing rank file, a refused pickled type, or files that disagree (each named).
    """
    reader = _Reader(Path(path))
    groups, parts, _ = reader.groups()
    shards = reader.shard_dicts(groups, parts)
    tensors = whole_entries(reader.model)
    meta = engine_meta(reader.model, tensors, zero_scaler_state(reader.optim[0]))
    rank_meta = rank_meta_of(reader.base_state(0)["param_groups"], shards[0])
    layout = CheckpointLayout(stage=max(reader.stage, 1), world_size=reader.world, groups=tuple(groups))
    return SavedCheckpoint(Path(path), meta, tensors, layout, DictShardSource(shards), rank_meta)
