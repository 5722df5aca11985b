"""Shards a checkpoint writes piece by piece, for master stores whose state does not live in memory.

A master store that keeps its fp32 master and optimizer state in swap files (zero_offload's NVMe store,
ZeRO-Infinity) answers ``checkpoint_pieces(flat_group)`` with a dict ``name -> StreamedShard | Tensor``
(``"master"`` and torch's optimizer-state names): each :class:`StreamedShard` yields the shard's bytes in order,
a sub-group at a time, through one reusable buffer. The save writes them straight into the rank's safetensors
file (same tensors, names and layout as an in-memory shard, so loading, N-to-M resharding and consolidation do not
change), and host memory holds one piece instead of the whole shard (DeepSpeed's NVMe checkpoints first swap each
whole partition into host memory). The pieces are read when the file is written, so a save that holds any is
written before ``save_checkpoint`` returns, also with ``async_save``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from zero_core.checkpoint import storage
from zero_core.checkpoint.stream import write_streaming


@dataclass(frozen=True)
class StreamedShard:
    """A 1-D shard of ``numel`` elements of ``dtype`` whose values come from ``pieces()``: contiguous CPU tensors
    of ``dtype`` whose concatenation is the shard (each valid until the next one is requested)."""

    dtype: torch.dtype
    numel: int
    pieces: Callable[[], Iterator[torch.Tensor]]

    @property
    def shape(self) -> tuple[int]:
        return (self.numel,)


def has_streamed(tensors: dict) -> bool:
    """True when some value of ``tensors`` is a :class:`StreamedShard`."""
    return any(isinstance(v, StreamedShard) for v in tensors.values())


def write_mixed(path: Path, tensors: dict) -> storage.FileRecord:
    """Write tensors and :class:`StreamedShard` values as one safetensors file (names in sorted order), fsync,
    and return its record (as ``storage.write_tensors``).

    Raises:
        ValueError: a piece of another dtype, or pieces that do not add up to their shard's ``numel`` (named).
    """
    names = sorted(tensors)
    specs = [(n, tensors[n].dtype, list(tensors[n].shape)) for n in names]
    write_streaming(path, specs, lambda n: _source(n, tensors[n]))
    return storage._record(path)


def _source(name: str, value) -> torch.Tensor | Iterator[torch.Tensor]:
    if not isinstance(value, StreamedShard):
        return value.detach().contiguous()
    return _checked(name, value)


def _checked(name: str, shard: StreamedShard) -> Iterator[torch.Tensor]:
    done = 0
    for piece in shard.pieces():
        if piece.dtype != shard.dtype:
            raise ValueError(f"tensor {name!r}: a piece of dtype {piece.dtype}, the shard is {shard.dtype}")
        done += piece.numel()
        yield piece
    if done != shard.numel:
        raise ValueError(f"tensor {name!r}: pieces hold {done} elements, the shard {shard.numel}")
