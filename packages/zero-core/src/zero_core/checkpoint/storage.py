"""Checkpoint files on disk: names, atomic commit, manifest with sizes and sha256, the ``latest`` pointer.

Layout of one checkpoint (names chosen to read like DeepSpeed's)::

    <dir>/latest                                              text: the newest committed tag
    <dir>/zero_to_fp32.py                                     the standalone converter (DeepSpeed's script name)
    <dir>/<tag>/manifest.json                                 every file's size and sha256, world size, stage
    <dir>/<tag>/mp_rank_00_model_states.{json,safetensors}    layout, counters, client state; buffers, frozen params
    <dir>/<tag>/zero_pp_rank_<r>_mp_rank_00_optim_states.{json,safetensors}   rank r: master + optimizer shards, RNG

A model split over tensor-parallel ranks puts one such checkpoint per rank under ``<dir>/<tag>/tp_rank_<t>/`` with
``tensor_parallel.json`` beside them (``split.py``).

Every rank writes into ``<dir>/.<tag>.tmp/``; rank 0 then writes the manifest, renames the directory into place
and only then replaces ``latest`` (temp file + ``os.replace``), so a crash at any moment leaves the previous
checkpoint and pointer intact.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

MODEL_STATES = "mp_rank_00_model_states"
MANIFEST = "manifest.json"
LATEST = "latest"
RECOVERY_SCRIPT = "zero_to_fp32.py"
SPLIT_RECORD = "tensor_parallel.json"  # a checkpoint of a model split over tensor-parallel ranks (split.py)
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, truncated or otherwise unusable; the message names the file."""


def optim_states_name(rank: int) -> str:
    """Base name of rank ``rank``'s shard files (DeepSpeed: ``zero_pp_rank_<r>_mp_rank_00_optim_states``)."""
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states"


def check_tag(tag: str) -> str:
    """Return ``tag`` if it is a single safe path component; raise ValueError naming it otherwise."""
    if not isinstance(tag, str) or not _TAG_RE.match(tag):
        raise ValueError(f"checkpoint tag {tag!r} must match {_TAG_RE.pattern} (one path component, no leading dot)")
    return tag


def staging_dir(root: Path, tag: str) -> Path:
    """The hidden directory ``root/.<tag>.tmp`` every rank writes into before rank 0 renames it to ``root/<tag>``."""
    return Path(root) / f".{tag}.tmp"


@dataclass(frozen=True)
class FileRecord:
    """One file of a checkpoint: its name inside the tag directory, size in bytes, sha256 hex digest."""

    name: str
    size: int
    sha256: str


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read ``chunk`` bytes (default 4 MiB) at a time so memory stays bounded."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _read_umask()  # read once at import: os.umask can only be read by setting it


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _record(path: Path) -> FileRecord:
    _fsync(path)
    return FileRecord(path.name, path.stat().st_size, sha256_file(path))


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> FileRecord:
    """Write ``tensors`` (CPU, contiguous, unshared) as safetensors, fsync, and return its record."""
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    os.chmod(path, 0o666 & ~_UMASK)  # safetensors creates its files 0600; give them the mode of the JSON beside them
    return _record(path)


def write_json(path: Path, obj: Any) -> FileRecord:
    """Write ``obj`` as JSON, fsync, and return its record."""
    path.write_text(json.dumps(obj, indent=1, allow_nan=True))
    return _record(path)


def write_recovery_script(root: Path) -> Path:
    """Copy the ``zero_to_fp32.py`` converter into checkpoint root ``root`` (atomic, executable), as DeepSpeed copies
    its script beside every checkpoint; returns its path."""
    src = Path(__file__).with_name("zero_to_fp32_script.py")
    dst = Path(root) / RECOVERY_SCRIPT
    tmp = dst.with_name(f".{RECOVERY_SCRIPT}.tmp")
    shutil.copyfile(src, tmp)
    os.chmod(tmp, 0o777 & ~_UMASK)  # python zero_to_fp32.py or ./zero_to_fp32.py
    os.replace(tmp, dst)
    return dst


def write_part(staging: Path, rank: int, records: list[FileRecord]) -> None:
    """Rank ``rank`` announces its finished files (read by rank 0 to build the manifest)."""
    tmp = staging / f".part_{rank}.json.tmp"
    tmp.write_text(json.dumps([asdict(r) for r in records]))
    os.replace(tmp, staging / f".part_{rank}.json")


def wait_parts(staging: Path, world_size: int, timeout: float) -> list[FileRecord]:
    """Rank 0: wait until every rank's part file exists; return all records. Raises CheckpointError on timeout."""
    deadline = time.monotonic() + timeout
    records: list[FileRecord] = []
    for rank in range(world_size):
        part = staging / f".part_{rank}.json"
        while not part.exists():
            if time.monotonic() > deadline:
                raise CheckpointError(f"rank {rank} did not finish writing its files into {staging} in {timeout} s")
            time.sleep(0.01)
        records += [FileRecord(**r) for r in json.loads(part.read_text())]
    return records


def commit(root: Path, tag: str, records: list[FileRecord], info: dict[str, Any], update_latest: bool = True) -> Path:
    """Rank 0: write the manifest, rename the staging directory to ``root/tag``, then point ``latest`` at it.

    Args:
        info: JSON-able facts stored in the manifest (world size, stage, save id, ...).
        update_latest: False leaves ``root/latest`` as it is (DeepSpeed's ``save_latest=False``).

    Returns:
        the committed checkpoint directory.
    """
    root = Path(root)
    staging = staging_dir(root, tag)
    for part in staging.glob(".part_*.json"):
        part.unlink()
    manifest = dict(info, tag=tag, files={r.name: {"size": r.size, "sha256": r.sha256} for r in records})
    write_json(staging / MANIFEST, manifest)
    _fsync(staging)
    final = root / tag
    old = root / f".{tag}.old"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(staging, final)
    _fsync(root)
    shutil.rmtree(old, ignore_errors=True)
    if not update_latest:
        return final
    tmp = root / f".{LATEST}.tmp"
    tmp.write_text(tag)
    _fsync(tmp)
    os.replace(tmp, root / LATEST)
    _fsync(root)
    return final


def resolve(root: Path, tag: str | None) -> Path:
    """The directory of checkpoint ``tag`` under ``root`` (``None``: the tag in ``root/latest``).

    Raises:
        CheckpointError: no ``latest`` file, or the tag's directory or manifest is missing.
    """
    root = Path(root)
    if tag is None:
        latest = root / LATEST
        if not latest.is_file():
            raise CheckpointError(f"no tag given and no '{LATEST}' file in {root}")
        tag = latest.read_text().strip()
    path = root / check_tag(tag)
    if not (path / MANIFEST).is_file():
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST} (not a committed checkpoint)")
    return path


def read_manifest(path: Path) -> dict[str, Any]:
    """The parsed ``manifest.json`` of a tag directory. Raises CheckpointError naming the file if unreadable."""
    try:
        return json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {Path(path) / MANIFEST}: {e}") from e


def verify(path: Path, names: list[str], manifest: dict[str, Any] | None = None) -> None:
    """Check the size and sha256 of files ``names`` in checkpoint ``path`` against its manifest.

    Raises:
        CheckpointError: naming the first missing, truncated or corrupt file, with expected and found values.
    """
    manifest = manifest or read_manifest(path)
    for name in names:
        file = Path(path) / name
        entry = manifest["files"].get(name)
        if entry is None:
            raise CheckpointError(f"{file} is not listed in the checkpoint's manifest")
        if not file.is_file():
            raise CheckpointError(f"{file} is missing (listed in the manifest with {entry['size']} bytes)")
        size = file.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(f"{file} is truncated or altered: {size} bytes, manifest says {entry['size']}")
        digest = sha256_file(file)
        if digest != entry["sha256"]:
            raise CheckpointError(
                f"{file} is corrupt: sha256 {digest[:16]}..., manifest says {entry['sha256'][:16]}..."
            )


def read_json(path: Path, name: str, manifest: dict[str, Any]) -> Any:
    """Verify then parse JSON file ``name`` of checkpoint ``path``."""
    verify(path, [name], manifest)
    return json.loads((Path(path) / name).read_text())


def read_tensors(path: Path, name: str, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Verify then load every tensor of safetensors file ``name`` of checkpoint ``path`` (CPU)."""
    verify(path, [name], manifest)
    out = {}
    with safe_open(str(Path(path) / name), "pt") as f:
        for k in f.keys():
            out[k] = f.get_tensor(k)
    return out


class FileShardSource:
    """A :class:`~zero_core.checkpoint.reshard.ShardSource` over the N rank files of a checkpoint.

    Files are verified against the manifest when first opened and then read lazily (slices only).
    """

    def __init__(self, path: Path, world_size: int, manifest: dict[str, Any]):
        self.path, self.world_size, self.manifest = Path(path), world_size, manifest
        self._open: dict[int, Any] = {}

    def _file(self, rank: int):
        if rank not in self._open:
            if not 0 <= rank < self.world_size:
                raise CheckpointError(f"shard {rank} requested from a checkpoint saved with {self.world_size} ranks")
            name = optim_states_name(rank) + ".safetensors"
            verify(self.path, [name], self.manifest)
            self._open[rank] = safe_open(str(self.path / name), "pt")
        return self._open[rank]

    def keys(self, rank: int) -> list[str]:
        return list(self._file(rank).keys())

    def shape(self, rank: int, key: str) -> tuple[int, ...]:
        return tuple(self._file(rank).get_slice(key).get_shape())

    def get(self, rank: int, key: str) -> torch.Tensor:
        return self._file(rank).get_tensor(key)

    def read(self, rank: int, key: str, start: int, end: int) -> torch.Tensor:
        return self._file(rank).get_slice(key)[start:end]
