"""The folder of NVMe swap files that zero creates and owns under ``nvme_path``, and the start-up checks on it.

DeepSpeed removes its whole swap folder at start-up (``rmtree``) and fails mid-run when the disk is full. Here:
``<nvme_path>/zero_swap/rank<r>/`` is created by zero and marked with an ownership file (run id, pid, file names);
only files listed there as zero's are ever removed; a folder at that place without the mark is refused (never
deleted); files of a previous run are cleared at start (never read into a new run); the room needed is checked, in
bytes, before any work; a clean ``close()`` removes zero's files and its empty folders. A folder still in use, by a
live swap folder of this process (two engines, e.g. DeepSpeed-Chat's actor and critic) or by a live process (two
jobs of the same rank sharing ``nvme_path``), is left alone: the new one takes ``rank<r>.1``, ``rank<r>.2``, ...
(the files of both have the same stable names, so sharing a folder would mix them).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import uuid
import weakref
from pathlib import Path

MARK = ".zero-swap-owner.json"
_LIVE: set[str] = set()  # real paths of this process's open swap folders


class SwapFolderError(RuntimeError):
    """``nvme_path`` missing, not writable, too small, or holding a folder zero did not create."""


class SwapFolder:
    """Rank ``rank``'s swap folder under ``nvme_path``.

    Args:
        nvme_path: the configured folder (``offload_optimizer.nvme_path``); must exist and be writable.
        rank: global rank (one sub-folder each).
        bytes_needed: bytes the swap files will take; checked against the free space.
        key: the config key named in errors.
        name: the sub-folder (default ``rank<r>``; parameter offload uses ``rank<r>.params``); ``<name>.<k>`` with
            the smallest free ``k`` while ``name`` is in use (module docstring).

    Raises:
        SwapFolderError: the path is missing, not a folder, not writable, lacks ``bytes_needed`` free bytes (the
            message gives both numbers), or ``zero_swap/rank<r>`` exists without zero's ownership mark.
    """

    def __init__(self, nvme_path: str, rank: int, bytes_needed: int, key: str = "offload_optimizer.nvme_path",
                 name: str | None = None):  # fmt: skip
        root = Path(nvme_path)
        check_room(nvme_path, bytes_needed, key=key, who=f"rank {rank}")
        self.top = root / "zero_swap"
        self.path = _free_folder(self.top, name or f"rank{rank}")
        if not self.top.exists():
            self.top.mkdir(exist_ok=True)
            (self.top / MARK).write_text(json.dumps({"created_by": "zero"}))
        if self.path.exists():
            mark = self.path / MARK
            if not mark.is_file():
                raise SwapFolderError(f"{self.path} exists but was not created by zero (no {MARK}); refusing to use "
                                      f"or delete it. Move it away or choose another {key}")  # fmt: skip
            self._clear(json.loads(mark.read_text()).get("files", []))
        else:
            self.path.mkdir(parents=True)
        self.run = uuid.uuid4().hex
        self.files: list[str] = []
        self._write_mark()
        key = os.path.realpath(self.path)
        _LIVE.add(key)
        # A clean interpreter exit removes zero's files even when nobody called close() (engine not destroyed).
        self._finalizer = weakref.finalize(self, _remove_owned, self.path, self.top, self.files, key)

    def _write_mark(self) -> None:
        tmp = self.path / (MARK + ".tmp")
        tmp.write_text(json.dumps({"run": self.run, "pid": os.getpid(), "files": self.files}))
        os.replace(tmp, self.path / MARK)

    def _clear(self, names: list[str]) -> None:
        _unlink_owned(self.path, names)

    def file(self, name: str) -> str:
        """Path of swap file ``name`` (a stable name, e.g. ``group0.sg3.swp``), recorded as zero's own."""
        if name not in self.files:
            self.files.append(name)
            self._write_mark()
        return str(self.path / name)

    def close(self) -> None:
        """Remove zero's files, its mark and the folders zero created if they are empty. Idempotent."""
        self._finalizer()


def _alive(pid) -> bool:
    """Whether process ``pid`` exists (another user's counts); False for a missing or malformed pid."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _in_use(folder: Path, collect: bool = True) -> bool:
    """``folder`` belongs to an open swap folder of this process or to a live other process (its mark's pid)."""
    if os.path.realpath(folder) in _LIVE:
        if not collect:
            return True
        gc.collect()  # an engine dropped without destroy() releases its folder when collected
        return os.path.realpath(folder) in _LIVE
    try:
        pid = json.loads((folder / MARK).read_text()).get("pid")
    except (OSError, ValueError, AttributeError):
        return False
    return pid != os.getpid() and _alive(pid)


def _free_folder(top: Path, name: str) -> Path:
    for k in range(1 << 16):
        folder = top / (name if k == 0 else f"{name}.{k}")
        if not _in_use(folder):
            return folder
    raise SwapFolderError(f"no free swap folder {name}.<k> under {top}")


def reusable_bytes(nvme_path: str) -> int:
    """Bytes of a previous run's swap files under ``<nvme_path>/zero_swap/rank*/`` that a new start clears (only the
    files zero's ownership marks list; folders still in use do not count)."""
    total = 0
    for mark in Path(nvme_path, "zero_swap").glob(f"rank*/{MARK}"):
        if _in_use(mark.parent, collect=False):
            continue
        try:
            names = json.loads(mark.read_text()).get("files", [])
        except (OSError, ValueError):
            continue
        for name in names:
            if "/" not in name and not name.startswith("."):
                try:
                    total += (mark.parent / name).stat().st_size
                except OSError:
                    pass
    return total


def check_room(nvme_path: str, bytes_needed: int, *, key: str = "offload_optimizer.nvme_path", who: str = "") -> None:
    """Start-up check of ``nvme_path``: an existing, writable folder with ``bytes_needed`` bytes free, counting a
    previous run's swap files (cleared at start) as free.

    Args:
        nvme_path: the configured folder.
        bytes_needed: bytes the swap files of every rank writing there will take.
        key: the config key named in errors (under ``zero_optimization.``).
        who: whose files, for the message (e.g. ``"rank 0"``, ``"the 2 ranks of this node"``).

    Raises:
        SwapFolderError: the folder is missing, not writable, or short of room (message: bytes free and needed).
    """
    root = Path(nvme_path)
    if not root.is_dir():
        raise SwapFolderError(f"zero_optimization.{key}={nvme_path!r} does not exist or is not a folder")
    if not os.access(root, os.W_OK | os.X_OK):
        raise SwapFolderError(f"zero_optimization.{key}={nvme_path!r} is not writable by this process")
    free = shutil.disk_usage(root).free + reusable_bytes(nvme_path)
    if free < bytes_needed:
        raise SwapFolderError(f"zero_optimization.{key}={nvme_path!r} has {free} bytes free; the swap files of "
                              f"{who or 'this run'} need {bytes_needed} bytes "
                              f"({bytes_needed / 2**30:.2f} GiB)")  # fmt: skip


def _unlink_owned(path: Path, names: list[str]) -> None:
    for name in names:
        if "/" in name or name.startswith("."):
            continue  # never follow a path out of our folder
        try:
            (path / name).unlink()
        except FileNotFoundError:
            pass


def _remove_owned(path: Path, top: Path, files: list[str], key: str = "") -> None:
    _LIVE.discard(key)
    _unlink_owned(path, files)
    files.clear()
    try:
        (path / MARK).unlink(missing_ok=True)
        path.rmdir()
        if sorted(p.name for p in top.iterdir()) == [MARK]:  # zero's, and no other rank's folder left
            (top / MARK).unlink(missing_ok=True)
            top.rmdir()
    except OSError:
        pass  # not empty: someone else's files are there, or another rank is closing; leave them
