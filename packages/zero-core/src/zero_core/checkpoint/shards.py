"""Splitting a consolidated state dict into weight files of at most ``max_shard_size`` bytes, named and indexed as
transformers' ``save_pretrained`` and DeepSpeed's ``zero_to_fp32.py`` do (``model-00001-of-00003.safetensors`` plus
``model.safetensors.index.json``; one file keeps the plain name), so ``from_pretrained`` loads either form."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import torch

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")

Spec = tuple[str, torch.dtype, Sequence[int]]


def parse_size(size: int | str | None) -> int | None:
    """Bytes in ``size``: an int, or a string as huggingface_hub reads it (``"5GB"`` = 5e9, ``"500MiB"`` =
    500 * 2**20); None stays None (no limit).

    Raises:
        ValueError: a string that is not digits followed by one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; or a
            size below 1 byte.
    """
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise ValueError(f"max_shard_size must be an int (bytes) or a string like '5GB', got {size!r}")
    if isinstance(size, str):
        m = _SIZE_RE.match(size)
        if m is None or m.group(2).upper() not in _UNITS:
            raise ValueError(f"max_shard_size {size!r}: expected digits followed by a unit (B, KB, MB, GB, TB, "
                             "KiB, MiB, GiB, TiB), e.g. '5GB'")  # fmt: skip
        size = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if size < 1:
        raise ValueError(f"max_shard_size must be at least 1 byte, got {size}")
    return size


def nbytes(spec: Spec) -> int:
    """Bytes of one ``(name, dtype, shape)`` tensor."""
    n = 1
    for s in spec[2]:
        n *= int(s)
    return n * torch.empty((), dtype=spec[1]).element_size()


def plan_shards(specs: Sequence[Spec], max_bytes: int | None) -> list[list[Spec]]:
    """Consecutive groups of ``specs`` (state-dict order kept) of at most ``max_bytes`` each; a tensor larger than
    the limit gets a file of its own (huggingface_hub's ``split_torch_state_dict_into_shards`` rule). None: one
    group."""
    if max_bytes is None:
        return [list(specs)]
    shards: list[list[Spec]] = [[]]
    used = 0
    for spec in specs:
        size = nbytes(spec)
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(spec)
        used += size
    return shards


def shard_names(base: str, count: int) -> list[str]:
    """File names for ``count`` shards of ``base`` (``model.safetensors`` -> ``model-00001-of-00002.safetensors``);
    one shard keeps ``base``."""
    if count == 1:
        return [base]
    stem, dot, ext = base.rpartition(".")
    return [f"{stem}-{i + 1:05d}-of-{count:05d}{dot}{ext}" for i in range(count)]


def write_index(out: Path, base: str, names: Sequence[str], shards: Sequence[Sequence[Spec]]) -> Path:
    """Write ``<base>.index.json`` (``metadata.total_size`` in bytes, ``weight_map`` key -> file), as transformers
    reads it; returns its path."""
    weight_map = {spec[0]: name for name, shard in zip(names, shards) for spec in shard}
    total = sum(nbytes(spec) for shard in shards for spec in shard)
    path = out / f"{base}.index.json"
    text = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True)
    path.write_text(text + "\n")
    return path
