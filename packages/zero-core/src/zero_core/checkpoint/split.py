"""Checkpoints of a model split over tensor-parallel ranks (AutoTP): one ordinary checkpoint per tensor-parallel
rank, holding that rank's data-parallel shards, plus a record of how each split parameter was cut.

Layout of one checkpoint ``<dir>/<tag>/``::

    manifest.json             the record's size and sha256, the tensor-parallel size, the world size
    tensor_parallel.json      the split record: size, and per split parameter its dim, full shape and sizes
    tp_rank_<t>/              tensor-parallel rank t's checkpoint (``save.py``'s format over its data-parallel group)

Loading at the same split reads ``tp_rank_<t>`` directly (bit for bit, resharded over data-parallel ranks as any
checkpoint). Loading at another tensor-parallel size, without one, or a plain checkpoint into a split model
rebuilds each parameter's full tensor (master weights and per-element optimizer state) from every rank's piece and
cuts this rank's piece of the target split, then loads that as a one-shard checkpoint (``load.load_saved``).
Consolidation (``ConsolidatedState``, ``zero_to_fp32``) reassembles the full tensors the same way. zero_core knows
only the record; which layers split how is zero_parallel's (the engine passes the record).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zero_comm import same_outcome
from zero_core.checkpoint import storage
from zero_core.checkpoint.layout import FORMAT_VERSION, CheckpointLayout
from zero_core.checkpoint.load import LoadResult, SavedCheckpoint, load_checkpoint, load_saved, open_saved
from zero_core.checkpoint.reshard import DictShardSource, master_key, optim_key, read_param, saved_state_names
from zero_core.checkpoint.save import save_checkpoint, wait_pending
from zero_core.checkpoint.target import Checkpointable
from zero_core.checkpoint.zero_runtime import as_checkpointable
from zero_core.layout import FlatGroup

SPLIT_RECORD = storage.SPLIT_RECORD


def part_tag(rank: int) -> str:
    """The folder of tensor-parallel rank ``rank``'s checkpoint inside a split checkpoint."""
    return f"tp_rank_{rank:02d}"


@dataclass(frozen=True)
class SplitParam:
    """How one parameter is cut over the tensor-parallel ranks (zero_parallel's ``ShardLayout``, as JSON).

    Attributes:
        dim: the cut dim of the full tensor; full_shape: the full tensor's shape.
        sizes: ``sizes[s][r]``: elements along ``dim`` of sub-parameter ``s`` (a packed weight has several) that
            rank ``r`` holds; a rank's piece is the concatenation of its part of every sub-parameter.
    """

    dim: int
    full_shape: tuple[int, ...]
    sizes: tuple[tuple[int, ...], ...]

    def rank_shape(self, rank: int) -> tuple[int, ...]:
        """The shape of ``rank``'s piece."""
        shape = list(self.full_shape)
        shape[self.dim] = sum(sub[rank] for sub in self.sizes)
        return tuple(shape)

    def shard(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s piece of ``full`` (contiguous)."""
        pieces, start = [], 0
        for sub in self.sizes:
            pieces.append(full.narrow(self.dim, start + sum(sub[:rank]), sub[rank]))
            start += sum(sub)
        return torch.cat(pieces, self.dim).contiguous()

    def unshard(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's piece, in rank order (the inverse of :meth:`shard`)."""
        out, offsets = [], [0] * len(pieces)
        for sub in self.sizes:
            for r, piece in enumerate(pieces):
                out.append(piece.narrow(self.dim, offsets[r], sub[r]))
                offsets[r] += sub[r]
        return torch.cat(out, self.dim)


@dataclass(frozen=True)
class SplitRecord:
    """A model's tensor-parallel split: ``size`` ranks; ``params`` maps each split parameter's name to its
    :class:`SplitParam` (every other parameter is the same on every rank). ``size`` 1 with no params: not split."""

    size: int
    params: dict[str, SplitParam]

    def to_dict(self) -> dict[str, Any]:
        """The JSON form written as ``tensor_parallel.json``."""
        return {"size": self.size, "params": {n: {"dim": p.dim, "full_shape": list(p.full_shape),
                                                   "sizes": [list(s) for s in p.sizes]}
                                               for n, p in self.params.items()}}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SplitRecord:
        """Read the JSON form. Raises CheckpointError naming what is malformed."""
        try:
            params = {n: SplitParam(int(p["dim"]), tuple(int(x) for x in p["full_shape"]),
                                    tuple(tuple(int(x) for x in s) for s in p["sizes"]))
                      for n, p in d["params"].items()}  # fmt: skip
            size = int(d["size"])
        except (KeyError, TypeError, ValueError) as e:
            raise storage.CheckpointError(f"{SPLIT_RECORD}: malformed: {type(e).__name__}: {e}") from e
        bad = [n for n, p in params.items() if any(len(s) != size for s in p.sizes)]
        if size < 1 or bad:
            raise storage.CheckpointError(f"{SPLIT_RECORD}: size {size} and the sizes of {bad[:4]} disagree")
        return cls(size, params)

    def piece_shape(self, name: str, full_shape: tuple[int, ...], rank: int) -> tuple[int, ...]:
        """The shape rank ``rank`` holds of parameter ``name`` whose full shape is ``full_shape``."""
        return self.params[name].rank_shape(rank) if name in self.params else tuple(full_shape)


UNSPLIT = SplitRecord(1, {})


def read_split_record(path: Path, manifest: dict[str, Any]) -> SplitRecord | None:
    """The split record of committed checkpoint ``path`` (verified), or None for a checkpoint that is not split."""
    if SPLIT_RECORD not in manifest.get("files", {}):
        return None
    return SplitRecord.from_dict(storage.read_json(path, SPLIT_RECORD, manifest))


def save_split_checkpoint(runtime: Checkpointable, save_dir: str | Path, tag: str, record: SplitRecord, rank: int,
                          *, timeout: float = 600.0, save_latest: bool = True, recovery_script: bool = True,
                          **kwargs: Any) -> Path:  # fmt: skip
    """Save ``save_dir/tag`` from a model split over ``record.size`` tensor-parallel ranks. Collective over the whole
    world; ``runtime.group`` is this rank's data-parallel group (the ranks holding the same pieces).

    Each tensor-parallel rank's group writes ``tp_rank_<rank>/`` with :func:`save_checkpoint` (``kwargs``:
    ``client_state``, ``extra_state``, ``model_config``, ``exclude_frozen_parameters``); global rank 0 then writes
    the record and the manifest, renames the folder into place and updates ``latest`` (unless ``save_latest`` is
    False), so a crash leaves the previous checkpoint whole.

    Returns:
        the checkpoint directory.

    Raises:
        ValueError: a bad tag; CheckpointError / UnsupportedStateError: as :func:`save_checkpoint`; raised on every
            rank when any rank fails.
    """
    wait_pending()
    root = Path(save_dir)
    staging = storage.staging_dir(root, tag)
    world_rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    with same_outcome("save_checkpoint", None, timeout):
        storage.check_tag(tag)
        if world_rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)  # left by a crashed save
            staging.mkdir()
            if recovery_script:
                storage.write_recovery_script(root)
    with same_outcome("save_checkpoint", None, timeout):  # one tensor-parallel rank's failure is every rank's
        save_checkpoint(runtime, staging, part_tag(rank), timeout=timeout, save_latest=False, recovery_script=False,
                        **kwargs).wait()  # fmt: skip
    with same_outcome("save_checkpoint", None, timeout):
        if world_rank == 0:
            written = storage.write_json(staging / SPLIT_RECORD, record.to_dict())
            info = {"tensor_parallel_size": record.size, "world_size": world, "format_version": FORMAT_VERSION}
            storage.commit(root, tag, [written], info, save_latest)
    return root / tag


def load_split_checkpoint(runtime: Checkpointable, load_dir: str | Path, tag: str | None, record: SplitRecord | None,
                          rank: int, **kwargs: Any) -> LoadResult:  # fmt: skip
    """Load ``load_dir/tag`` (default: ``latest``) into a model split as ``record`` says (None: not split), this
    process holding tensor-parallel piece ``rank``; the checkpoint may be split at any size, or not at all.
    ``kwargs``: :func:`load_checkpoint`'s flags.

    Same split: this rank's ``tp_rank_<rank>`` loads as any checkpoint (RNG included). Another split: every
    parameter's master weights and per-element optimizer state are rebuilt whole from the saved pieces and cut for
    ``record`` (this rank's data-parallel group holds one tensor-parallel rank's whole state in host memory while
    loading); per-buffer state (``step``), hyper-parameters and buffers come from saved rank 0; RNG is not restored.

    Raises:
        CheckpointError: a missing or corrupt file; LayoutMismatchError: parameters or shapes that do not map
            (both named). Raised on every rank of ``runtime.group`` when one fails.
    """
    record = record or UNSPLIT
    wait_pending()
    # a split model's every rank agrees (its tensor-parallel peers load from other folders of the same tag)
    with same_outcome("load_checkpoint", None if record.size > 1 else as_checkpointable(runtime).group):
        path = storage.resolve(Path(load_dir), tag)
        saved = read_split_record(path, storage.read_manifest(path)) or UNSPLIT
    if saved == record:
        if saved.size == 1 and not saved.params:
            return load_checkpoint(runtime, path.parent, path.name, **kwargs)
        return load_checkpoint(runtime, path, part_tag(rank), **kwargs)
    kwargs["load_rng"] = False  # a rank of another split: its RNG states belong to no rank here
    return load_saved(runtime, lambda: resplit(path, saved, record, rank), **kwargs)


def _parts(path: Path, saved: SplitRecord) -> list[SavedCheckpoint]:
    if saved.size == 1 and not saved.params:
        return [open_saved(path)]
    return [open_saved(path / part_tag(t)) for t in range(saved.size)]


def resplit(path: Path, saved: SplitRecord, target: SplitRecord, rank: int) -> SavedCheckpoint:
    """Split checkpoint ``path`` (cut as ``saved``) as a one-shard checkpoint in memory holding tensor-parallel
    piece ``rank`` of ``target``: one flat group per parameter (``param<i>``), its master weights and optimizer
    state whole. Raises CheckpointError / LayoutMismatchError from the files read."""
    parts = _parts(path, saved)
    base = parts[0]
    indexes = [p.layout.param_index() for p in parts]
    saved_rank0 = base.rank_meta(0)
    excluded = set(base.meta.get("excluded_frozen", []))
    tensors: dict[str, torch.Tensor] = {}
    nontensor: dict[str, Any] = {}
    groups = []

    def whole(kind: str, name: str) -> torch.Tensor:
        pieces = [read_param(p.layout, p.source, kind, name).view(index[name][1].shape)
                  for p, index in zip(parts, indexes)]  # fmt: skip
        full = saved.params[name].unshard(pieces) if name in saved.params else pieces[0]
        return target.params[name].shard(full, rank) if name in target.params else full

    for i, (name, (g, slot)) in enumerate(base.layout.param_index().items()):
        key = f"param{i}"
        full_shape = saved.params[name].full_shape if name in saved.params else tuple(slot.shape)
        groups.append(FlatGroup.of(key, g.group_index, 1, [[(name, target.piece_shape(name, full_shape, rank))]]))
        if name in excluded:
            continue  # saved without values: the module keeps its own (load_saved's kept groups)
        tensors[master_key(key)] = whole("master", name).reshape(-1)
        if g.group_index is None:
            continue
        nontensor[key] = saved_rank0["nontensor_state"].get(g.key, {})
        for state in saved_state_names(base.layout, base.source, g.key):
            if base.source.shape(0, optim_key(state, g.key)) == (g.shard_numel,):
                tensors[optim_key(state, key)] = whole(f"optim/{state}", name).reshape(-1)
            else:  # per buffer (a 0-dim step): the same for every parameter of the buffer
                tensors[optim_key(state, key)] = base.source.get(0, optim_key(state, g.key)).clone()
    for k in base.source.keys(0):
        if k.startswith(("param_groups/", "nontensor/")):
            tensors[k] = base.source.get(0, k)
    model_tensors = dict(base.model_tensors)
    for k in base.model_tensors:
        name = k[len("model/") :] if k.startswith("model/") else None
        if name in saved.params or name in target.params:
            full = saved.params[name].unshard([p.model_tensors[k] for p in parts]) if name in saved.params else \
                base.model_tensors[k]  # fmt: skip
            model_tensors[k] = target.params[name].shard(full, rank) if name in target.params else full
    layout = CheckpointLayout(base.layout.stage, 1, tuple(groups))
    rank0 = dict(saved_rank0, nontensor_state=nontensor)
    return SavedCheckpoint(path, base.meta, model_tensors, layout, DictShardSource([tensors]), lambda r: rank0)
