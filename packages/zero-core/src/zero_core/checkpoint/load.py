"""Sharded load with resharding: any saved world size and stage onto the running job's, verified as it is read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zero_comm import same_outcome
from zero_core.checkpoint import storage
from zero_core.checkpoint.codec import decode
from zero_core.checkpoint.layout import CheckpointLayout, LayoutMismatchError, check_compatible
from zero_core.checkpoint.left_out import keep_current, with_left_out
from zero_core.checkpoint.master_view import GROUP_STATE_KEYS
from zero_core.checkpoint.reshard import build_optimizer_state, build_shard, shard_index
from zero_core.checkpoint.save import current_layout, model_entries, wait_pending
from zero_core.checkpoint.target import Checkpointable, rank_and_world, restore_rng
from zero_core.checkpoint.zero_runtime import as_checkpointable


@dataclass
class LoadResult:
    """What :func:`load_checkpoint` read besides the runtime's own state.

    Attributes:
        path: the checkpoint directory; tag: its tag.
        client_state: the user's dict as saved; extra_state: the engine's dict as saved (loss scaler, schedulers,
            counters), for the engine to restore.
        saved_layout: the layout it was written with (``saved_layout.world_size``, ``.stage``).
        resharded: True when the saved world size or flat-buffer layout differs from the running job's.
    """

    path: Path
    tag: str
    client_state: dict[str, Any]
    extra_state: dict[str, Any]
    saved_layout: CheckpointLayout
    resharded: bool


def read_model_states(path: Path, manifest: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Verified ``(meta, tensors)`` of a checkpoint's model-state files."""
    meta = storage.read_json(path, f"{storage.MODEL_STATES}.json", manifest)
    if meta.get("format_version") != 1:
        raise storage.CheckpointError(f"{path}: unsupported format_version {meta.get('format_version')!r} (want 1)")
    return meta, storage.read_tensors(path, f"{storage.MODEL_STATES}.safetensors", manifest)


@dataclass
class SavedCheckpoint:
    """What a load reads from one checkpoint, from its files (:func:`open_saved`) or built in memory (a checkpoint
    of a model split over tensor-parallel ranks, re-split for another split: ``split.py``).

    Attributes:
        path: the checkpoint directory (named in errors).
        meta: the model-state JSON (``layout``, ``entries``, ``client_state``, ``extra_state``, ``excluded_frozen``).
        model_tensors: the model-state tensors (``model/<name>`` for buffers and frozen parameters, encoded
            client and engine state).
        layout: the saved :class:`CheckpointLayout`; source: its shards (a ``ShardSource``).
        rank_meta: shard ``r``'s JSON (``param_groups``, ``nontensor_state``, ``rng``).
    """

    path: Path
    meta: dict[str, Any]
    model_tensors: dict[str, torch.Tensor]
    layout: CheckpointLayout
    source: Any
    rank_meta: Callable[[int], dict[str, Any]]


def open_saved(path: Path) -> SavedCheckpoint:
    """The committed checkpoint directory ``path`` read for loading: the model-state files now (verified), the rank
    files lazily. Raises CheckpointError naming a missing or corrupt file."""
    manifest = storage.read_manifest(path)
    if storage.SPLIT_RECORD in manifest.get("files", {}):
        size = manifest.get("tensor_parallel_size")
        raise storage.CheckpointError(f"checkpoint {path} holds a model split over {size} tensor-parallel ranks; "
                                      "load it with load_split_checkpoint (engine.load_checkpoint does)")  # fmt: skip
    meta, model_tensors = read_model_states(path, manifest)
    saved = CheckpointLayout.from_dict(meta["layout"])
    source = storage.FileShardSource(path, saved.world_size, manifest)

    def rank_meta(r: int) -> dict[str, Any]:
        return storage.read_json(path, storage.optim_states_name(r) + ".json", manifest)

    return SavedCheckpoint(path, meta, model_tensors, saved, source, rank_meta)


def _merge_nontensor(
    saved: CheckpointLayout, rank0: dict[str, Any], tensors: dict[str, torch.Tensor], dst_params: list[str]
) -> dict[str, Any]:
    index = saved.param_index()
    keys = list(dict.fromkeys(index[n][0].key for n in dst_params))
    values = [rank0["nontensor_state"].get(k, {}) for k in keys]
    for k, v in zip(keys[1:], values[1:]):
        if v != values[0]:
            raise LayoutMismatchError(f"non-tensor optimizer state differs between saved buffers {keys[0]!r} and {k!r}")
    return decode(values[0], tensors) if values else {}


def _load_optimizer(runtime: Checkpointable, ckpt: SavedCheckpoint, rank: int) -> None:
    opt = runtime.optimizer
    saved, source = ckpt.layout, ckpt.source
    rank0 = ckpt.rank_meta(0)
    rank0_tensors = {k: source.get(0, k) for k in source.keys(0) if k.startswith(("param_groups/", "nontensor/"))}
    saved_groups = decode(rank0["param_groups"], rank0_tensors)
    # hyper_groups / trainable read no master or state shard: on NVMe, param_groups and state_dict() would read
    # every one back (and hold all the state in host memory) only to learn the positions
    current = opt.hyper_groups()
    if len(saved_groups) != len(current):
        raise LayoutMismatchError(
            f"checkpoint {ckpt.path} has {len(saved_groups)} optimizer param groups, the optimizer has {len(current)}"
        )
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = [dict(sg, params=[]) for sg in saved_groups]
    for position, g in enumerate(opt.trainable()):  # the optimizer's parameter order
        entry = _merge_nontensor(saved, rank0, rank0_tensors, [p.name for p in g.slots]) if g.slots else {}
        entry.update(build_optimizer_state(saved, source, g, shard_index(g, rank)))
        if entry:
            state[position] = entry
        groups[g.group_index]["params"].append(position)
    opt.load_state_dict({"state": state, "param_groups": groups})


def _kept_groups(runtime: Checkpointable, excluded: set[str], path: Path) -> dict[str, torch.Tensor]:
    """Current shards of the flat groups whose parameters the checkpoint left out (``exclude_frozen_parameters``):
    they are loaded back unchanged, so the module keeps its values. A group holding both excluded and saved
    parameters cannot be rebuilt and raises :class:`LayoutMismatchError` naming the excluded ones."""
    keep = {}
    if not excluded:
        return keep
    for g, master in runtime.checkpoint_groups():
        names = {p.name for p in g.slots}
        if not names & excluded:
            continue
        if not names <= excluded:
            raise LayoutMismatchError(
                f"checkpoint {path} was saved with exclude_frozen_parameters=True and lacks "
                f"{sorted(names & excluded)[:8]}, which flat group {g.key!r} now holds with saved parameters "
                f"(were they unfrozen?); load it into a model with the same frozen parameters"
            )
        keep[g.key] = master.detach().clone()
    return keep


def load_checkpoint(
    runtime: Checkpointable,
    load_dir: str | Path,
    tag: str | None = None,
    *,
    load_optimizer_states: bool = True,
    load_module_only: bool = False,
    load_rng: bool = True,
) -> LoadResult:
    """Load ``load_dir/tag`` (default: the tag in ``load_dir/latest``) into ``runtime``, resharding as needed.

    Works for any saved world size and stage (resharding through per-parameter element ranges); every file read
    is first checked against the manifest. Collective only through ``runtime.load_model_state`` at stage 3.
    Parameters a checkpoint saved with ``exclude_frozen_parameters=True`` lacks keep the module's current values
    (DeepSpeed's behaviour for parameters missing from the checkpoint).

    Args:
        load_optimizer_states: False resets this runtime's optimizer state to empty (as after construction,
            so ``step`` restarts at 0, per parameter or per param group) and keeps its param-group
            hyper-parameters.
        load_module_only: load parameters and buffers only (implies ``load_optimizer_states=False``, no RNG).
            Without optimizer states the optimizer's param groups may differ from the saved run's (fine-tuning from
            a checkpoint with a new optimizer, as DeepSpeed's ``load_module_only``).
        load_rng: restore this rank's RNG states when the checkpoint has a rank of the same index.

    Returns:
        a :class:`LoadResult` with the client and engine state dicts.

    Raises:
        CheckpointError: a missing/corrupt/truncated file (named); LayoutMismatchError: the checkpoint's layout
            cannot map onto this job's (both layouts named). Raised on every rank when any rank fails (as
            zero_comm's ``GroupOperationError`` of the same class, naming the rank), never leaving one waiting.
    """
    wait_pending()
    return load_saved(runtime, lambda: open_saved(storage.resolve(Path(load_dir), tag)),
                      load_optimizer_states=load_optimizer_states, load_module_only=load_module_only,
                      load_rng=load_rng)  # fmt: skip


def load_saved(
    runtime: Checkpointable,
    opener: Callable[[], SavedCheckpoint],
    *,
    load_optimizer_states: bool = True,
    load_module_only: bool = False,
    load_rng: bool = True,
) -> LoadResult:
    """:func:`load_checkpoint` of the checkpoint ``opener()`` returns (called once, where a failure on one rank is
    agreed by every rank). The arguments and errors are :func:`load_checkpoint`'s."""
    runtime = as_checkpointable(runtime)
    rank, _ = rank_and_world(runtime.group)
    # Each rank reads files on its own, so one can fail (a file missing on its node, a corrupt shard) while the
    # others go on into a collective: every rank learns the outcome before the next collective.
    with same_outcome("load_checkpoint", runtime.group):
        current = current_layout(runtime)
        ckpt, left_out = with_left_out(opener(), current, runtime.module)
        path, meta, model_tensors, saved = ckpt.path, ckpt.meta, ckpt.model_tensors, ckpt.layout
        check_compatible(saved, current, same_groups=load_optimizer_states and not load_module_only)
        excluded = set(meta.get("excluded_frozen", []))
        _, stored = model_entries(runtime, current)
        have = {k[len("model/") :] for k in model_tensors if k.startswith("model/")}
        missing = [n for n in stored if n not in have]
        if missing:
            raise LayoutMismatchError(
                f"checkpoint {path} lacks model entries {missing[:8]} (buffers or frozen parameters); "
                f"saved: {saved.describe()}; current: {current.describe()}"
            )
        keep = _kept_groups(runtime, excluded, path)
        client_state = decode(meta["client_state"], model_tensors)
        extra_state = decode(meta["extra_state"], model_tensors)
    runtime.load_model_state({n: model_tensors[f"model/{n}"] for n in stored})
    with same_outcome("load_checkpoint", runtime.group):
        source = ckpt.source
        shards = {
            g.key: keep[g.key] if g.key in keep else build_shard(saved, source, "master", g, shard_index(g, rank))
            for g in current.groups
        }
        if left_out:  # frozen parameters DeepSpeed's files left out keep this rank's current values
            for g, master in runtime.checkpoint_groups():
                keep_current(g, shard_index(g, rank), shards[g.key], master, left_out)
    runtime.load_master_shards(shards)  # collective (refreshes the parameters)
    with same_outcome("load_checkpoint", runtime.group):
        if load_optimizer_states and not load_module_only:
            _load_optimizer(runtime, ckpt, rank)
        else:  # state as after construction: none per parameter, no per-group step count
            opt = runtime.optimizer
            groups = [{k: v for k, v in pg.items() if k not in GROUP_STATE_KEYS} for pg in opt.hyper_groups()]
            opt.load_state_dict({"state": {}, "param_groups": groups})
        rank_meta = ckpt.rank_meta(rank) if load_rng and not load_module_only and rank < saved.world_size else {}
        if "rng" in rank_meta:  # a checkpoint of another format may hold none (DeepSpeed's)
            rng_tensors = {k: source.get(rank, k) for k in source.keys(rank) if k.startswith("rng/")}
            restore_rng(decode(rank_meta["rng"], rng_tensors))
    return LoadResult(
        path=path,
        tag=path.name,
        client_state=client_state,
        extra_state=extra_state,
        saved_layout=saved,
        resharded=not saved.same_groups(current),
    )
