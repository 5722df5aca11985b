"""Which on-disk format a checkpoint folder is in, and the load each format does: the seam the engine loads through.

A :class:`CheckpointFormat` says whether it recognises a tag folder and loads it into a runtime. :data:`FORMATS`
lists them in the order they are asked; zero's own format (a ``manifest.json`` in the tag folder) comes first and is
also the fallback, so a folder no format recognises gets zero's errors (naming the missing ``latest`` or manifest).
DeepSpeed 0.19.x's ZeRO folders (``mp_rank_00_model_states.pt`` and ``*_optim_states.pt``, no manifest) are read
by :mod:`zero_core.checkpoint.deepspeed_read`, its universal folders (``ds_to_universal``'s ``zero/<param>/``) by
:mod:`zero_core.checkpoint.deepspeed_universal`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from zero_core.checkpoint import storage
from zero_core.checkpoint.deepspeed_read import MODEL_FILE, is_deepspeed_checkpoint
from zero_core.checkpoint.deepspeed_stage0 import open_any_stage
from zero_core.checkpoint.deepspeed_universal import is_universal_checkpoint, open_universal
from zero_core.checkpoint.load import LoadResult, SavedCheckpoint, load_saved
from zero_core.checkpoint.save import wait_pending
from zero_core.checkpoint.split import SplitRecord, load_split_checkpoint
from zero_core.checkpoint.target import Checkpointable


class CheckpointFormat(Protocol):
    """One checkpoint layout on disk."""

    name: str

    def recognizes(self, folder: Path) -> bool:
        """``folder`` (one tag) is a checkpoint of this format."""
        ...

    def load(self, runtime: Checkpointable, load_dir: Path, tag: str | None, split: SplitRecord | None, rank: int,
             param_order: list[list[str]] | None = None, **flags: Any) -> LoadResult:  # fmt: skip
        """Collective: load ``load_dir/tag`` (None: ``latest``) into ``runtime`` (split as ``split`` says, this
        process holding tensor-parallel piece ``rank``); ``param_order``: the running optimizer's parameter names
        per param group (what a format that names no parameter loads by); ``flags``: ``load_checkpoint``'s."""
        ...


class ZeroFormat:
    """zero's sharded safetensors format (``manifest.json``), any split, any rank count and stage."""

    name = "zero"

    def recognizes(self, folder: Path) -> bool:
        return (folder / storage.MANIFEST).is_file()

    def load(self, runtime: Checkpointable, load_dir: Path, tag: str | None, split: SplitRecord | None, rank: int,
             param_order: list[list[str]] | None = None, **flags: Any) -> LoadResult:  # fmt: skip
        return load_split_checkpoint(runtime, load_dir, tag, split, rank, **flags)


class DeepSpeedFormat:
    """The load of a DeepSpeed folder ``open_folder`` reads into a :class:`SavedCheckpoint`: resharded onto this job's
    ranks and stage; RNG is not restored (DeepSpeed saves none). Raises CheckpointError for a model split over
    tensor-parallel ranks."""

    def __init__(self, name: str, recognizes: Callable[[Path], bool],
                 open_folder: Callable[[Path, list[list[str]] | None], SavedCheckpoint]):  # fmt: skip
        self.name, self._recognizes, self._open = name, recognizes, open_folder

    def recognizes(self, folder: Path) -> bool:
        return not (folder / storage.MANIFEST).is_file() and self._recognizes(folder)

    def load(self, runtime: Checkpointable, load_dir: Path, tag: str | None, split: SplitRecord | None, rank: int,
             param_order: list[list[str]] | None = None, **flags: Any) -> LoadResult:  # fmt: skip
        folder = tag_folder(load_dir, tag)
        if split is not None and split.size > 1:
            raise storage.CheckpointError(f"DeepSpeed checkpoint {folder}: loading it into a model split over "
                                          f"{split.size} tensor-parallel ranks is not supported")  # fmt: skip
        wait_pending()
        flags["load_rng"] = False
        return load_saved(runtime, lambda: self._open(folder, param_order), **flags)

    def open(self, folder: Path) -> SavedCheckpoint:
        """The tag folder ``folder`` read into a :class:`SavedCheckpoint` (no process group needed)."""
        return self._open(folder, None)


# a universal folder also holds mp_rank_00_model_states.pt: it is asked before the ZeRO one
DEEPSPEED_FORMATS: tuple[DeepSpeedFormat, ...] = (
    DeepSpeedFormat("deepspeed-universal", is_universal_checkpoint, lambda folder, _: open_universal(folder)),
    DeepSpeedFormat("deepspeed", is_deepspeed_checkpoint, open_any_stage),
)
FORMATS: tuple[CheckpointFormat, ...] = (ZeroFormat(), *DEEPSPEED_FORMATS)


def open_deepspeed_folder(load_dir: str | Path, tag: str | None) -> SavedCheckpoint | None:
    """``load_dir/tag`` (None: ``latest``) read into a :class:`SavedCheckpoint` when it is one of DeepSpeed's
    layouts; None for zero's own or a folder that is not there (zero's errors then name what is missing)."""
    folder = tag_folder(load_dir, tag)
    if folder is None or not folder.is_dir():
        return None
    for fmt in DEEPSPEED_FORMATS:
        if fmt.recognizes(folder):
            return fmt.open(folder)
    return None


def tag_folder(load_dir: str | Path, tag: str | None) -> Path | None:
    """``load_dir/tag``, the tag read from ``load_dir/latest`` when None; None when there is no ``latest`` or the
    tag is not one path component."""
    root = Path(load_dir)
    if tag is None:
        latest = root / storage.LATEST
        if not latest.is_file():
            return None
        tag = latest.read_text().strip()
    try:
        return root / storage.check_tag(tag)
    except ValueError:  # zero's own load names the bad tag, on every rank
        return None


def format_of(load_dir: str | Path, tag: str | None) -> CheckpointFormat:
    """The first of :data:`FORMATS` that recognises ``load_dir/tag``; zero's own when none does (or there is no
    tag to look at), so its errors name what is missing."""
    folder = tag_folder(load_dir, tag)
    if folder is not None and folder.is_dir():
        for fmt in FORMATS:
            if fmt.recognizes(folder):
                return fmt
    return FORMATS[0]


def load_any_format(runtime: Checkpointable, load_dir: str | Path, tag: str | None, split: SplitRecord | None = None,
                    rank: int = 0, param_order: list[list[str]] | None = None, **flags: Any) -> LoadResult:  # fmt: skip
    """Collective: load ``load_dir/tag`` (None: ``latest``) in whichever of :data:`FORMATS` it is.

    ``param_order``: the running optimizer's parameter names per param group, which DeepSpeed's stage 0 folders
    (whose optimizer state names no parameter) load by, as DeepSpeed loads them by position; without it such a
    folder is refused. ``flags``: :func:`zero_core.checkpoint.load_checkpoint`'s (``load_optimizer_states``,
    ``load_module_only``).

    Raises:
        CheckpointError / LayoutMismatchError: as the format's load raises them, on every rank.
    """
    return format_of(load_dir, tag).load(runtime, Path(load_dir), tag, split, rank, param_order, **flags)


def loaded_model_file(load_dir: str | os.PathLike, folder: Path, stage: int, dp_rank: int) -> str:
    """The model-states file a load of ``folder`` (a tag folder under ``load_dir``, or its ``tp_rank_<t>``) names, as
    DeepSpeed's ``load_checkpoint`` returns it: ``os.path.join(load_dir, tag, name)`` with ``load_dir`` as given.

    ``name``, as DeepSpeed 0.19.8's engine at ``stage`` picks it: ``zero_pp_rank_<dp_rank>_mp_rank_00_model_states.pt``
    at stage 3 (rank 0's in a universal folder), else ``mp_rank_00_model_states.pt``; where the folder was written at
    another stage (DeepSpeed would not load it), the model file it holds; in zero's own layout
    ``mp_rank_00_model_states.safetensors``.
    """
    names = [f"zero_pp_rank_{0 if is_universal_checkpoint(folder) else dp_rank}_{MODEL_FILE}"] if stage == 3 else []
    names += [MODEL_FILE, f"zero_pp_rank_0_{MODEL_FILE}", f"{storage.MODEL_STATES}.safetensors"]
    name = next((n for n in names if (folder / n).is_file()), names[-1])
    return os.path.join(os.fspath(load_dir), os.path.relpath(folder, load_dir), name)
