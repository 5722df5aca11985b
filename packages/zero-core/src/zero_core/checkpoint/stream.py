"""Write a safetensors file one tensor at a time, so memory stays at the largest single tensor.

The ``safetensors`` package writes only from a dict holding every tensor at once; the file format itself
(documented at huggingface.co/docs/safetensors: 8-byte little-endian header length, a JSON header with each
tensor's dtype, shape and ``data_offsets``, then the raw little-endian bytes) allows streaming, which is all this
module does. Files are read back with the ``safetensors`` package itself.
"""

from __future__ import annotations

import ctypes
import json
import struct
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip


def _bytes_view(t: torch.Tensor) -> memoryview:
    """Zero-copy view of a contiguous CPU tensor's bytes (no numpy needed; ``t`` must outlive the view)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def write_streaming(
    path: str | Path,
    specs: Sequence[tuple[str, torch.dtype, Sequence[int]]],
    produce: Callable[[str], torch.Tensor | Iterable[torch.Tensor]],
    metadata: dict[str, str] | None = None,
) -> int:
    """Write a safetensors file whose tensors come from ``produce(name)``, called once per name, in order.

    Args:
        specs: ``(name, dtype, shape)`` of every tensor, in file order (the header is written first).
        produce: returns the tensor for a name (CPU), which must match its spec's dtype and shape, or an iterator
            of tensors whose bytes, concatenated, are that tensor's (written as they come: memory stays at one).
        metadata: string-to-string ``__metadata__`` (e.g. ``{"format": "pt"}`` for transformers).

    Returns:
        the file size in bytes.

    Raises:
        ValueError: an unsupported dtype, or a produced tensor whose dtype/shape (pieces: byte count) differs from
            its spec (named).
    """
    header: dict[str, object] = {"__metadata__": dict(metadata or {})}
    offset = 0
    for name, dtype, shape in specs:
        if dtype not in _DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {dtype} cannot be stored in safetensors")
        n = 1
        for s in shape:
            n *= s
        size = n * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format aligns the data section to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, dtype, shape in specs:
            t = produce(name)
            if not isinstance(t, torch.Tensor):  # pieces, in order (a shard streamed from swap files)
                start = f.tell()
                for piece in t:
                    f.write(_bytes_view(piece.detach().cpu().contiguous()))
                want = header[name]["data_offsets"]
                if f.tell() - start != want[1] - want[0]:
                    raise ValueError(f"tensor {name!r}: pieces gave {f.tell() - start} bytes, header says "
                                     f"{want[1] - want[0]}")  # fmt: skip
                continue
            if t.dtype != dtype or list(t.shape) != list(shape):
                raise ValueError(f"tensor {name!r}: produced {t.dtype} {list(t.shape)}, header says {dtype} {shape}")
            f.write(_bytes_view(t.detach().cpu().contiguous()))
        return f.tell()
