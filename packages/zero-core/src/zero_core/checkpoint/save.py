"""Sharded save: snapshot a runtime's state to host memory, write it (now or on a background thread), commit.

Mirrors DeepSpeed's ``engine.save_checkpoint`` (model states on rank 0, one optimizer-state file per rank) with
safetensors instead of pickles, a manifest, an atomic rename and an opt-in asynchronous writer.
"""

from __future__ import annotations

import atexit
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zero_comm import same_outcome
from zero_comm.objects import all_gather_object, broadcast_object
from zero_core.checkpoint import storage
from zero_core.checkpoint.codec import encode
from zero_core.checkpoint.layout import FORMAT_VERSION, CheckpointLayout
from zero_core.checkpoint.pieces import has_streamed, write_mixed
from zero_core.checkpoint.reshard import master_key, optim_key
from zero_core.checkpoint.target import Checkpointable, capture_rng, rank_and_world, state_dict_vars
from zero_core.checkpoint.zero_runtime import as_checkpointable


@dataclass
class Snapshot:
    """Everything one rank writes, already copied to host memory (safe to keep training while it is written),
    except :class:`~zero_core.checkpoint.pieces.StreamedShard` values, read from swap files as they are written."""

    rank: int
    world_size: int
    rank_tensors: dict[str, torch.Tensor]
    rank_meta: dict[str, Any]
    model_tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # rank 0 only
    model_meta: dict[str, Any] = field(default_factory=dict)  # rank 0 only


def current_layout(runtime: Checkpointable) -> CheckpointLayout:
    """The :class:`CheckpointLayout` of a running job (from ``streamed_groups``: no master on NVMe is read whole)."""
    _, world = rank_and_world(runtime.group)
    return CheckpointLayout(stage=runtime.stage, world_size=world, groups=[g for g, _ in runtime.streamed_groups()])


def model_entries(runtime: Checkpointable, layout: CheckpointLayout) -> tuple[list[dict[str, Any]], list[str]]:
    """The model's ``state_dict`` keys in order, each with its source; and the names kept in the model file.

    Source ``"flat"``: a trainable parameter in a flat buffer; ``"model"``: stored whole in the model file
    (buffers, frozen params); ``alias_of``: a key sharing storage with an earlier key (tied weights).
    """
    flat = layout.param_index()
    entries, seen, stored = [], {}, []
    for name, t in state_dict_vars(runtime.module).items():
        if id(t) in seen and name not in flat:
            entries.append({"name": name, "alias_of": seen[id(t)]})
            continue
        seen.setdefault(id(t), name)
        if name in flat:
            entries.append({"name": name, "source": "flat"})
        else:
            entries.append({"name": name, "source": "model"})
            stored.append(name)
    return entries, stored


def snapshot(
    runtime: Checkpointable,
    client_state: dict[str, Any] | None,
    extra_state: dict[str, Any] | None,
    model_config: dict[str, Any] | None,
    exclude_frozen: bool = False,
) -> Snapshot:
    """Copy this rank's share of the state to host memory. Collective at stage 3 (gathers frozen params).

    ``exclude_frozen`` leaves out the frozen-only flat groups (``group_index is None``); their parameter names
    are listed under ``excluded_frozen`` in the model meta."""
    rank, world = rank_and_world(runtime.group)
    # a master store whose state lives in swap files hands over pieces, written as they are read (pieces.py)
    groups = runtime.streamed_groups()
    layout = CheckpointLayout(stage=runtime.stage, world_size=world, groups=[g for g, _ in groups])
    tensors: dict[str, torch.Tensor] = {}
    nontensor: dict[str, dict[str, Any]] = {}
    excluded = [p.name for g, _ in groups if exclude_frozen and g.group_index is None for p in g.slots]
    for g, master in groups:
        if exclude_frozen and g.group_index is None:
            continue
        if rank >= g.partitions:
            continue  # a whole (unsharded) buffer is written by rank 0 only
        if isinstance(master, dict):  # streamed: the master and each optimizer-state tensor, piece by piece
            streamed = dict(master)
            tensors[master_key(g.key)] = values = streamed.pop("master")
            if tuple(values.shape) != (g.shard_numel,):
                raise ValueError(f"streamed master shard of flat group {g.key!r} has shape {tuple(values.shape)}, "
                                 f"expected ({g.shard_numel},)")  # fmt: skip
            for name, value in streamed.items():
                tensors[optim_key(name, g.key)] = value
            continue
        if tuple(master.shape) != (g.shard_numel,):
            raise ValueError(f"master shard of flat group {g.key!r} has shape {tuple(master.shape)}, "
                             f"expected ({g.shard_numel},)")  # fmt: skip
        # fp32 master for trainable buffers; frozen buffers keep their dtype (restored bit for bit)
        tensors[master_key(g.key)] = master.detach().to("cpu", copy=True)
        for name, value in runtime.optimizer.state.get(master, {}).items():
            if isinstance(value, torch.Tensor):
                tensors[optim_key(name, g.key)] = value.detach().to("cpu", copy=True).contiguous()
            else:
                nontensor.setdefault(g.key, {})[name] = encode(value, tensors, f"nontensor/{g.key}/{name}")
    param_groups = runtime.optimizer.hyper_groups()
    meta = {
        "rank": rank,
        "param_groups": encode(param_groups, tensors, "param_groups"),
        "nontensor_state": nontensor,
        "rng": encode(capture_rng(), tensors, "rng"),
    }
    snap = Snapshot(rank, world, tensors, meta)
    entries, stored = model_entries(runtime, layout)
    gathered = runtime.gathered_model_state(stored)
    for name, value in gathered:
        if rank == 0:
            snap.model_tensors[f"model/{name}"] = value.detach().to("cpu", copy=True).contiguous()
    if rank == 0:
        snap.model_meta = {
            "format_version": FORMAT_VERSION,
            "torch_version": torch.__version__,
            "layout": layout.to_dict(),
            "entries": entries,
            "shapes": {n: list(v.shape) for n, v in _by_model_name(snap.model_tensors).items()}
            | {p.name: list(p.shape) for g in layout.groups for p in g.slots},
            "dtypes": {n: str(v.dtype).removeprefix("torch.") for n, v in _by_model_name(snap.model_tensors).items()}
            | {p.name: p.dtype for g in layout.groups for p in g.slots},
            "client_state": encode(client_state or {}, snap.model_tensors, "client"),
            "extra_state": encode(extra_state or {}, snap.model_tensors, "extra"),
            "model_config": model_config,
            "excluded_frozen": excluded,
        }
    return snap


def _by_model_name(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k[len("model/") :]: v for k, v in tensors.items() if k.startswith("model/")}


def write_rank_files(staging: Path, snap: Snapshot) -> list[storage.FileRecord]:
    """Write this rank's files (and rank 0's model files) into the staging directory; return their records."""
    base = storage.optim_states_name(snap.rank)
    write = write_mixed if has_streamed(snap.rank_tensors) else storage.write_tensors
    records = [
        write(staging / f"{base}.safetensors", snap.rank_tensors),
        storage.write_json(staging / f"{base}.json", snap.rank_meta),
    ]
    if snap.rank == 0:
        records.append(storage.write_tensors(staging / f"{storage.MODEL_STATES}.safetensors", snap.model_tensors))
        records.append(storage.write_json(staging / f"{storage.MODEL_STATES}.json", snap.model_meta))
    return records


class SaveHandle:
    """A save in progress (or finished). ``wait()`` blocks until the checkpoint is committed and re-raises."""

    def __init__(self, path: Path, thread: threading.Thread | None = None):
        self.path = path
        self._thread = thread
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Path:
        """Block until committed; returns the checkpoint directory. Raises the writer's error, or TimeoutError."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"checkpoint {self.path} still being written after {timeout} s")
        if self.error is not None:
            raise storage.CheckpointError(f"asynchronous save of {self.path} failed: {self.error}") from self.error
        return self.path


_PENDING: list[SaveHandle] = []


def wait_pending(timeout: float | None = None) -> None:
    """Wait for every asynchronous save started by this process (run before each save/load and at exit)."""
    while _PENDING:
        _PENDING.pop(0).wait(timeout)


atexit.register(wait_pending)


def _wait_committed(final: Path, save_id: str, timeout: float, save_latest: bool = True) -> None:
    """Ranks > 0 of an async save: wait until rank 0 has renamed the directory into place and updated ``latest``
    (the last step of a commit; only the rename with ``save_latest=False``)."""
    deadline = time.monotonic() + timeout
    latest = final.parent / storage.LATEST
    while True:
        try:
            if storage.read_manifest(final).get("save_id") == save_id and (
                not save_latest or latest.read_text() == final.name
            ):
                return
        except (storage.CheckpointError, OSError):
            pass
        if time.monotonic() > deadline:
            raise storage.CheckpointError(f"checkpoint {final} was not committed by rank 0 within {timeout} s")
        time.sleep(0.01)


def save_checkpoint(
    runtime: Checkpointable,
    save_dir: str | Path,
    tag: str,
    *,
    client_state: dict[str, Any] | None = None,
    extra_state: dict[str, Any] | None = None,
    model_config: dict[str, Any] | None = None,
    async_save: bool = False,
    timeout: float = 600.0,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
    recovery_script: bool = True,
) -> SaveHandle:
    """Save a sharded checkpoint to ``save_dir/tag`` and point ``save_dir/latest`` at it. Collective.

    Args:
        runtime: a :class:`Checkpointable` (e.g. ``ZeroRuntime``).
        save_dir: the checkpoint root (shared by every rank).
        tag: the checkpoint's name (one path component), e.g. ``"global_step100"``.
        client_state: the user's JSON-able dict (tensors allowed), returned by :func:`load_checkpoint`.
        extra_state: the engine's state dicts (loss scaler, schedulers, counters), returned on load.
        model_config: e.g. a transformers ``config.to_dict()``; written as ``config.json`` by consolidation.
        async_save: snapshot to host memory now, write on a background thread; the returned handle's ``wait()``
            (or the next save/load, or interpreter exit) waits for it.
        timeout: seconds to wait for the other ranks' files and for the commit.
        save_latest: False leaves ``save_dir/latest`` naming the previous tag (DeepSpeed's argument of this name),
            e.g. to keep a "best" checkpoint beside the ones a resume should use.
        exclude_frozen_parameters: True writes no shard of the flat groups that hold only frozen parameters
            (``requires_grad=False`` and in no optimizer param group); their names are recorded as
            ``excluded_frozen`` in the model meta, and :func:`load_checkpoint` keeps the values the module holds.
            Frozen parameters inside an optimizer param group's flat group are still saved (DeepSpeed's argument
            of this name, used by transformers' Trainer for PEFT models; DeepSpeed likewise keeps parameters of
            its optimizer groups).
        recovery_script: rank 0 copies the standalone converter ``zero_to_fp32.py`` into ``save_dir`` (DeepSpeed
            copies its script of this name there): ``python zero_to_fp32.py save_dir out_dir`` writes the full
            fp32 state dict (:mod:`zero_core.checkpoint.zero_to_fp32_script`; needs zero-core installed).

    Returns:
        a :class:`SaveHandle` (already finished unless ``async_save``).

    Raises:
        ValueError: bad tag; UnsupportedStateError: a value of ``client_state``/``extra_state`` on any rank cannot
            be stored (both raised on every rank, as zero_comm's ``GroupOperationError`` naming the rank, before
            anything is written); CheckpointError: a rank failed to write (raised on every rank for synchronous
            saves).
    """
    wait_pending()
    runtime = as_checkpointable(runtime)
    root = Path(save_dir)
    rank, world = rank_and_world(runtime.group)
    save_id, src = _begin_save(runtime, root, tag, client_state, extra_state, recovery_script, timeout)
    snap = snapshot(runtime, client_state, extra_state, model_config, exclude_frozen_parameters)
    info = {"save_id": save_id, "world_size": world, "stage": runtime.stage, "format_version": FORMAT_VERSION}
    job = _SaveJob(root, tag, rank, world, save_id, info, timeout, save_latest)
    if async_save:
        return job.start(snap)
    job.write(snap, runtime.group, src)
    return SaveHandle(job.final)


def _begin_save(runtime, root: Path, tag: str, client_state, extra_state, recovery_script: bool,
                timeout: float) -> tuple[str, int | None]:  # fmt: skip
    """Check what can fail on one rank only, then let every rank learn the outcome (a value that cannot be stored
    is the same error on every rank, before anything is written); rank 0 makes the staging folder. Returns the
    save id (the same on every rank) and the global rank of the group's rank 0 (None for one process)."""
    import torch.distributed as dist

    rank, world = rank_and_world(runtime.group)
    with same_outcome("save_checkpoint", runtime.group, timeout):
        storage.check_tag(tag)
        encode(client_state or {}, None, "client")
        encode(extra_state or {}, None, "extra")
    staging = storage.staging_dir(root, tag)
    save_id = None
    with same_outcome("save_checkpoint", runtime.group, timeout):
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)  # left by a crashed save
            staging.mkdir()
            if recovery_script:
                storage.write_recovery_script(root)
            save_id = uuid.uuid4().hex
    src = dist.get_process_group_ranks(runtime.group)[0] if world > 1 else None  # the group's rank 0
    if world > 1:
        save_id = broadcast_object(save_id if rank == 0 else None, src, runtime.group)  # mkdir before writes
    return save_id, src


class _SaveJob:
    """Writing one rank's part of checkpoint ``root/tag`` and committing it (rank 0), now or on a thread."""

    def __init__(self, root: Path, tag: str, rank: int, world: int, save_id: str, info: dict, timeout: float,
                 save_latest: bool):  # fmt: skip
        self.root, self.tag, self.rank, self.world = root, tag, rank, world
        self.save_id, self.info, self.timeout, self.save_latest = save_id, info, timeout, save_latest
        self.staging = storage.staging_dir(root, tag)
        self.final = root / tag

    def _commit(self) -> None:
        parts = storage.wait_parts(self.staging, self.world, self.timeout)
        storage.commit(self.root, self.tag, parts, self.info, self.save_latest)

    def start(self, snap) -> SaveHandle:
        """Write on a background thread; the handle's ``wait()`` raises what the thread met."""
        handle = SaveHandle(self.final)
        # pieces streamed from swap files are read now: the next step rewrites those files
        written = None
        if has_streamed(snap.rank_tensors):
            try:
                written = write_rank_files(self.staging, snap)
            except Exception as e:  # handed to wait(), as the writer thread's errors are
                handle.error = e
                _PENDING.append(handle)
                return handle

        def run() -> None:
            try:
                storage.write_part(self.staging, self.rank, written or write_rank_files(self.staging, snap))
                if self.rank == 0:
                    self._commit()
                else:
                    _wait_committed(self.final, self.save_id, self.timeout, self.save_latest)
            except BaseException as e:  # noqa: BLE001 - handed to wait()
                handle.error = e

        handle._thread = threading.Thread(target=run, name=f"zero-ckpt-save-{self.tag}", daemon=False)
        handle._thread.start()
        _PENDING.append(handle)
        return handle

    def write(self, snap, group, src: int | None) -> None:
        """Write now; every rank learns every rank's failure (none waits forever).

        Raises:
            CheckpointError: naming each rank that failed to write, or rank 0's commit."""
        error = None
        try:
            storage.write_part(self.staging, self.rank, write_rank_files(self.staging, snap))
        except Exception as e:  # reported to every rank below, so none waits forever
            error = f"rank {self.rank}: {type(e).__name__}: {e}"
        errors = [error]
        if self.world > 1:
            errors = all_gather_object(error, group)
        failed = [e for e in errors if e]
        if not failed and self.rank == 0:
            try:
                self._commit()
            except Exception as e:
                failed = [f"rank 0 commit: {type(e).__name__}: {e}"]
        if self.world > 1:
            failed = broadcast_object(failed, src, group) or failed
        if failed:
            raise storage.CheckpointError(f"saving checkpoint {self.final} failed: " + "; ".join(failed))
