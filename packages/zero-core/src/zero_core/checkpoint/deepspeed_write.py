"""zero's checkpoint written in DeepSpeed 0.19.x's ZeRO layout (``global_stepN/``), so a run can go back to DeepSpeed.

The files and keys are those :mod:`zero_core.checkpoint.deepspeed_read` reads (see its docstring for the layout):

* stages 1-2: ``mp_rank_00_model_states.pt`` (rank 0: the full module state in the model dtype, ``param_shapes``,
  ``buffer_names``, ``shared_params``, ``frozen_param_shapes`` and ``frozen_param_fragments`` (the frozen
  parameters whole: DeepSpeed writes both at stage 2 only, so its ``zero_to_fp32`` leaves a stage 1 checkpoint's
  frozen parameters out; written at stage 1 too, they come out), the engine counters, ``lr_scheduler``,
  the client state at the top level), and per rank ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` with
  ``single_partition_of_fp32_groups`` (one flat fp32 buffer per optimizer param group, padded to a multiple of
  ``2 * world``, the last rank's trailing padding cut off, ``group_paddings``), ``base_optimizer_state`` (the torch
  optimizer's ``state_dict`` of the partition, padding kept), ``param_slice_mappings``, ``partition_count``.
* stage 3: per rank ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` (parameters as empty tensors, buffers whole,
  ``frozen_param_fragments``: the rank's piece of each frozen parameter) and the optimizer file with
  ``fp32_flat_groups`` (each parameter padded to a multiple of ``world`` and cut on its own) and
  ``optimizer_state_dict``.

Parameters of a param group are laid out in the group's order (``param_order``; the module's order without it), as
DeepSpeed lays them out; a parameter that does not require grad is one of DeepSpeed's frozen parameters (kept whole
in the module at stages 1-2, in ``frozen_param_fragments`` at stage 3), also when an optimizer param group lists it,
as DeepSpeed leaves it out of its flat groups. Stage 3 cuts each param group into sub-groups as DeepSpeed does
for the run's ``sub_group_size``. The loss scaler is DeepSpeed's static one at 1.0, so fp16
runs are refused. DeepSpeed's own types are pickled by name (:mod:`zero_core.checkpoint.deepspeed_pickle`).

The save first writes zero's own checkpoint into a hidden folder beside the tag (``.<tag>.zero-for-deepspeed``),
then each rank cuts its DeepSpeed files from it (reading only the element ranges it needs), rank 0 renames the
folder into place, writes ``latest`` and removes the hidden one.
"""

from __future__ import annotations

import math
import os
import shutil
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from zero_comm import same_outcome
from zero_core.checkpoint import storage
from zero_core.checkpoint.codec import decode
from zero_core.checkpoint.deepspeed_pickle import fragment_address, loss_scaler, save_deepspeed_file, zero_stage
from zero_core.checkpoint.deepspeed_read import MODEL_FILE
from zero_core.checkpoint.load import SavedCheckpoint, open_saved
from zero_core.checkpoint.reshard import build_optimizer_state, build_shard, read_param
from zero_core.checkpoint.save import save_checkpoint, wait_pending
from zero_core.checkpoint.target import Checkpointable, rank_and_world, state_dict_vars
from zero_core.checkpoint.zero_runtime import as_checkpointable
from zero_core.layout import FlatGroup, ParamSlot

DS_VERSION = "0.19.8"
_ENGINE_KEYS = ("global_steps", "global_samples", "skipped_steps")


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


class _AnyRankState:
    """The saved shards, where a state tensor only some ranks hold is answered for every rank: zero makes a rank's
    optimizer state at its first gradient, so a rank whose shard of a param group holds only frozen parameters has
    none (per element it reads as zeros, the state those elements never got)."""

    def __init__(self, source, world: int):
        self.source = source
        self.held = [set(source.keys(r)) for r in range(world)]
        self.union = list(dict.fromkeys(k for r in range(world) for k in source.keys(r)))

    def _owner(self, rank: int, key: str) -> int:
        return rank if key in self.held[rank] else next(r for r, keys in enumerate(self.held) if key in keys)

    def keys(self, rank: int) -> list[str]:
        return self.union

    def shape(self, rank: int, key: str) -> tuple[int, ...]:
        return self.source.shape(self._owner(rank, key), key)

    def get(self, rank: int, key: str) -> torch.Tensor:
        return self.source.get(self._owner(rank, key), key)

    def read(self, rank: int, key: str, start: int, end: int) -> torch.Tensor:
        if key in self.held[rank]:
            return self.source.read(rank, key, start, end)
        return torch.zeros(end - start, dtype=self.get(rank, key).dtype)


def _sub_groups(slots: list[ParamSlot], world: int, size: int) -> list[list[ParamSlot]]:
    """Stage 3's sub-groups of one param group, cut as DeepSpeed cuts them: whole when its partition holds at most
    ``size`` (``sub_group_size``) elements, else a new one after each parameter that brings the running count of
    partition elements (``ceil(numel / world)`` each) to ``size``."""
    if size >= sum(math.ceil(p.numel / world) for p in slots):
        return [slots]
    out, current, count = [], [], 0
    for p in slots:
        current.append(p)
        count += math.ceil(p.numel / world)
        if count >= size or p is slots[-1]:
            out.append(current)
            current, count = [], 0
    return out


class _Writer:
    """One rank's DeepSpeed files cut from zero's checkpoint ``saved``."""

    def __init__(self, saved: SavedCheckpoint, module: torch.nn.Module, stage: int, rank: int, world: int,
                 param_order: Sequence[Sequence[str]] = (), sub_group_size: int = 1_000_000_000):  # fmt: skip
        self.saved, self.stage, self.rank, self.world = saved, stage, rank, world
        self.layout, self.source = saved.layout, _AnyRankState(saved.source, saved.layout.world_size)
        order = {n: i for i, n in enumerate(state_dict_vars(module))}
        # DeepSpeed's flat groups hold the params that require grad; the others are its frozen params
        trains = {n for n, p in module.named_parameters() if p.requires_grad}
        owned: dict[int, list[ParamSlot]] = {}
        self.frozen: list[ParamSlot] = []
        for g in self.layout.groups:
            for p in g.slots:
                mine = g.group_index is not None and p.name in trains
                (owned.setdefault(g.group_index, []) if mine else self.frozen).append(p)
        self.owner: list[int] = []  # the param group of each of DeepSpeed's flat groups (stage 3: sub-groups)
        self.trainable: list[list[ParamSlot]] = []
        for g in sorted(owned):
            at = {n: i for i, n in enumerate(param_order[g])} if g < len(param_order) else {}
            slots = sorted(owned[g], key=lambda p: (at.get(p.name, len(at)), order.get(p.name, 0)))
            for sub in _sub_groups(slots, world, sub_group_size) if stage == 3 else [slots]:
                self.owner.append(g)
                self.trainable.append(sub)
        self.frozen.sort(key=lambda p: order.get(p.name, 0))
        rank0 = saved.rank_meta(0)
        tensors = {k: self.source.get(0, k) for k in self.source.keys(0) if k.startswith("param_groups/")}
        self.hyper = decode(rank0["param_groups"], tensors)
        self.groups = [self._group(j, slots) for j, slots in enumerate(self.trainable)]

    def _group(self, j: int, slots: list[ParamSlot]) -> FlatGroup:
        """DeepSpeed's flat group ``j`` as zero's FlatGroup (one bucket at stages 1-2, one per parameter at 3)."""
        if self.stage < 3:
            params, at = [], 0
            for p in slots:
                params.append({"name": p.name, "shape": list(p.shape), "offset": at})
                at += p.numel
            align = 2 * self.world  # DeepSpeed's nccl_start_alignment_factor times the partition count
            buckets = [{"params": params, "numel": at, "padded_numel": math.ceil(at / align) * align}]
        else:
            buckets = [{"params": [{"name": p.name, "shape": list(p.shape), "offset": 0}], "numel": p.numel,
                        "padded_numel": math.ceil(p.numel / self.world) * self.world} for p in slots]  # fmt: skip
        return FlatGroup.from_dict({"key": f"deepspeed{j}", "optim_group": self.owner[j], "buckets": buckets,
                                    "world_size": self.world})  # fmt: skip

    def _torch_state(self, states: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        """The torch optimizer ``state_dict`` of this rank's partitions (flat group j is torch param j)."""
        groups = [dict(self.hyper[g], params=[j for j, o in enumerate(self.owner) if o == g])
                  for g in dict.fromkeys(self.owner)]  # fmt: skip
        return {"state": {j: s for j, s in enumerate(states) if s}, "param_groups": groups}

    def optim_file(self, clip_grad: float) -> dict[str, Any]:
        """The ``optimizer_state_dict`` of this rank's ``*_optim_states.pt``."""
        masters = [build_shard(self.layout, self.source, "master", g, self.rank) for g in self.groups]
        states = [_scalar_step(build_optimizer_state(self.layout, self.source, g, self.rank)) for g in self.groups]
        common = {"loss_scaler": loss_scaler(), "dynamic_loss_scale": False, "overflow": False,
                  "zero_stage": zero_stage(self.stage)}  # fmt: skip
        if self.stage == 3:
            return {**common, "partition_count": self.world, "optimizer_state_dict": self._torch_state(states),
                    "fp32_flat_groups": masters}  # fmt: skip
        last = self.rank == self.world - 1
        paddings = [g.buckets[0].padded_numel - g.buckets[0].numel if last else 0 for g in self.groups]
        lean = [m[: max(m.numel() - pad, 0)].clone() for m, pad in zip(masters, paddings)]
        return {**common, "clip_grad": float(clip_grad), "base_optimizer_state": self._torch_state(states),
                "single_partition_of_fp32_groups": lean, "group_paddings": paddings,
                "param_alignment_paddings": [[0] * len(s) for s in self.trainable],
                "partition_count": [self.world] * len(self.groups), "ds_version": DS_VERSION,
                "param_slice_mappings": [self._slice_mappings(g) for g in self.groups]}  # fmt: skip

    def _slice_mappings(self, g: FlatGroup) -> OrderedDict:
        """Each parameter's elements in this rank's partition of stage 1-2 group ``g``: name -> fragment_address."""
        lo, hi = g.buckets[0].chunk_range(self.rank)
        out = OrderedDict()
        for p in g.slots:
            a, b = max(lo, p.bucket_offset), min(hi, p.bucket_offset + p.numel)
            if a < b:
                out[p.name] = fragment_address(b - a, a - lo)
        return out

    def _whole(self, p: ParamSlot) -> torch.Tensor:
        value = read_param(self.layout, self.source, "master", p.name, 0, p.numel)
        return value.to(_torch_dtype(p.dtype)).reshape(p.shape)

    def model_file(self, meta: dict[str, Any], exclude_frozen: bool = False) -> dict[str, Any]:
        """This rank's model-state dict: the module state and DeepSpeed's bookkeeping, then ``meta`` (engine
        counters, ``lr_scheduler``, the client's keys). ``exclude_frozen`` leaves the frozen parameters out of the
        module and writes no ``frozen_param_*`` (DeepSpeed's ``exclude_frozen_parameters``)."""
        index = self.layout.param_index()
        module: OrderedDict[str, torch.Tensor] = OrderedDict()
        shared, buffers = {}, []
        left_out = {p.name for p in self.frozen} if exclude_frozen else set()
        for e in self.saved.meta["entries"]:
            name = e["name"]
            if name in left_out or e.get("alias_of") in left_out:
                continue
            if "alias_of" in e:
                module[name] = module[e["alias_of"]]
                shared[name] = e["alias_of"]
            elif name in index:
                slot = next(p for p in index[name][0].slots if p.name == name)
                module[name] = torch.empty(0, dtype=_torch_dtype(slot.dtype)) if self.stage == 3 else self._whole(slot)
            else:
                module[name] = self.saved.model_tensors[f"model/{name}"]
                buffers.append(name)
        frozen_shapes = OrderedDict((p.name, torch.Size(p.shape)) for p in self.frozen)
        out = {"module": module, "buffer_names": buffers, "optimizer": None,
               "param_shapes": [OrderedDict((p.name, torch.Size(p.shape)) for p in s) for s in self.trainable],
               "frozen_param_shapes": None if exclude_frozen else frozen_shapes, "shared_params": shared,
               "frozen_param_fragments": None if exclude_frozen else self._frozen_fragments(),
               "lr_scheduler": None, "data_sampler": None, "random_ltd": None, "skipped_steps": 0, "global_steps": 0,
               "global_samples": 0, "dp_world_size": self.world, "mp_world_size": 1}  # fmt: skip
        out.update(meta)
        out["ds_version"] = DS_VERSION
        return out

    def _frozen_fragments(self) -> OrderedDict:
        """Each frozen parameter whole (stages 1-2), or this rank's piece of it (stage 3: ``ceil(numel / world)``
        elements, zero-padded)."""
        out = OrderedDict()
        for p in self.frozen if self.stage < 3 else ():
            out[p.name] = self._whole(p)
        for p in self.frozen if self.stage == 3 else ():
            chunk = math.ceil(p.numel / self.world)
            lo, hi = min(self.rank * chunk, p.numel), min((self.rank + 1) * chunk, p.numel)
            piece = read_param(self.layout, self.source, "master", p.name, lo, hi).to(_torch_dtype(p.dtype))
            out[p.name] = torch.cat([piece, piece.new_zeros(chunk - piece.numel())])
        return out


def _scalar_step(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """torch's Adam ``step`` as one value: zero keeps it per element in a param group that lists a frozen parameter
    (which may be unfrozen later); DeepSpeed's group holds only trainable ones, which share the largest count."""
    step = state.get("step")
    if step is not None and step.dim() == 1:
        state["step"] = step.max() if step.numel() else step.new_zeros(())
    return state


def _engine_meta(saved: SavedCheckpoint) -> dict[str, Any]:
    """The model file's top-level keys from zero's extra and client state (DeepSpeed puts the client's keys there)."""
    extra = decode(saved.meta.get("extra_state") or {}, saved.model_tensors)
    client = decode(saved.meta.get("client_state") or {}, saved.model_tensors)
    meta = {k: extra[k] for k in _ENGINE_KEYS if k in extra}
    if extra.get("lr_scheduler") is not None:
        meta["lr_scheduler"] = extra["lr_scheduler"]
    return {**client, **meta}


def check_writable(runtime: Checkpointable, fmt: str = "deepspeed") -> None:
    """Raises CheckpointError when DeepSpeed's layout (``fmt``: ``checkpoint.format``, named in the message) cannot
    hold this run: stage 0, or fp16 parameters."""
    if runtime.stage not in (1, 2, 3):
        raise storage.CheckpointError(f"checkpoint.format '{fmt}' writes ZeRO stages 1-3; this run is at stage "
                                      f"{runtime.stage} (use checkpoint.format 'zero')")  # fmt: skip
    if any(p.dtype == torch.float16 for p in runtime.module.parameters()):
        raise storage.CheckpointError(
            f"checkpoint.format '{fmt}' writes fp32 and bf16 runs; this one holds "
            "fp16 parameters, whose dynamic loss scale it does not carry (use 'zero')"
        )


def save_deepspeed_checkpoint(runtime: Checkpointable, save_dir: str | Path, tag: str, *,
                              client_state: dict[str, Any] | None = None, extra_state: dict[str, Any] | None = None,
                              save_latest: bool = True, clip_grad: float = 0.0, recovery_script: bool = True,
                              param_order: Sequence[Sequence[str]] = (), exclude_frozen_parameters: bool = False,
                              sub_group_size: int = 1_000_000_000, timeout: float = 600.0) -> Path:  # fmt: skip
    """Collective: write ``save_dir/tag`` in DeepSpeed 0.19.8's ZeRO layout and point ``save_dir/latest`` at it.

    Args:
        runtime: a :class:`Checkpointable` at stage 1-3, fp32 or bf16.
        client_state: the user's dict; its keys go to the model file's top level (DeepSpeed's ``client_state``).
        extra_state: the engine's dict; ``global_steps``, ``global_samples``, ``skipped_steps`` and
            ``lr_scheduler`` are written as DeepSpeed's keys (the rest has no place in DeepSpeed's layout).
        save_latest: False leaves ``latest`` as it was. clip_grad: the run's ``gradient_clipping``, which
            DeepSpeed's stage 1-2 load takes from the checkpoint. recovery_script: copy zero's ``zero_to_fp32.py``
            into ``save_dir``, as zero's own format does.
        param_order: each optimizer param group's parameter names in the group's order, which DeepSpeed's flat
            groups follow (empty: the module's order, what groups built from ``named_parameters()`` give).
        sub_group_size: ``zero_optimization.sub_group_size``: stage 3 cuts each param group into sub-groups of
            about this many partition elements, as DeepSpeed does (its loader expects the same cut).
        exclude_frozen_parameters: leave the parameters that do not require grad out of the model files
            (DeepSpeed's argument of this name); a load then keeps the values the module holds.

    Returns:
        the tag folder.

    Raises:
        CheckpointError: stage 0 or fp16 (before anything is written), or a rank failed to write; on every rank.
        ValueError: a bad tag (as :func:`zero_core.checkpoint.save_checkpoint`).
    """
    wait_pending()
    runtime = as_checkpointable(runtime)
    rank, world = rank_and_world(runtime.group)
    root = Path(save_dir)
    with same_outcome("save_checkpoint", runtime.group, timeout):
        storage.check_tag(tag)
        check_writable(runtime)
    work = root / f".{tag}.zero-for-deepspeed"
    save_checkpoint(runtime, work, "zero", client_state=client_state, extra_state=extra_state, save_latest=False,
                    recovery_script=False, timeout=timeout)  # fmt: skip
    staging = storage.staging_dir(root, tag)
    with same_outcome("save_checkpoint", runtime.group, timeout):
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)  # left by a crashed save
            staging.mkdir()
    with same_outcome("save_checkpoint", runtime.group, timeout):
        saved = open_saved(work / "zero")
        writer = _Writer(saved, runtime.module, runtime.stage, rank, world, param_order, sub_group_size)
        bf16 = any(p.dtype == torch.bfloat16 for p in runtime.module.parameters())
        optim = f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        file_meta = {"ds_version": DS_VERSION}
        save_deepspeed_file({"optimizer_state_dict": writer.optim_file(clip_grad), **file_meta}, staging / optim)
        if runtime.stage == 3 or rank == 0:
            model = writer.model_file(_engine_meta(saved), exclude_frozen_parameters)
            name = MODEL_FILE if runtime.stage < 3 else f"zero_pp_rank_{rank}_{MODEL_FILE}"
            save_deepspeed_file(model, staging / name)
    final = root / tag
    with same_outcome("save_checkpoint", runtime.group, timeout):
        if rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(staging, final)
            if save_latest:
                tmp = root / f".{storage.LATEST}.tmp"
                tmp.write_text(tag)
                os.replace(tmp, root / storage.LATEST)
            if recovery_script:
                storage.write_recovery_script(root)
            shutil.rmtree(work, ignore_errors=True)
    return final
