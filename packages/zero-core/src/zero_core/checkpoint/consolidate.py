"""Offline consolidation of a sharded checkpoint into one full fp32 state dict (DeepSpeed's ``zero_to_fp32``).

No process group, CPU only; memory stays at about one tensor because each parameter is read from the rank files
as slices and streamed into the output file. Trainable parameters come from the fp32 master shards (every
param group, every stage); buffers and frozen parameters from the model-state file; tied weights are written
under every key. The result loads with ``strict=True`` into the plain model.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open

from zero_core.checkpoint import storage
from zero_core.checkpoint.formats import open_deepspeed_folder
from zero_core.checkpoint.layout import CheckpointLayout
from zero_core.checkpoint.reshard import read_param
from zero_core.checkpoint.shards import parse_size, plan_shards, shard_names, write_index
from zero_core.checkpoint.split import part_tag, read_split_record
from zero_core.checkpoint.stream import write_streaming

SAFETENSORS_NAME = "model.safetensors"  # the names transformers' from_pretrained looks for
TORCH_NAME = "pytorch_model.bin"


class ConsolidatedState:
    """Lazy access to the full state dict of a checkpoint: ``specs()`` first, then ``tensor(name)`` per key.

    Floating-point tensors come back as ``dtype`` (fp32 by default): trainable ones exactly as the fp32 master,
    frozen ones and buffers cast from their stored dtype; integer/bool buffers keep their dtype.

    A checkpoint of a model split over tensor-parallel ranks (``split.py``) gives the single-process model's
    tensors: each split parameter is reassembled from every rank's piece. A DeepSpeed 0.19 ZeRO stage 1-3 or universal
    folder (``formats.py``) gives its parameters from its fp32 partitions and its buffers from its model file.

    Parameters a checkpoint saved with ``exclude_frozen_parameters=True`` left out are omitted (as DeepSpeed's
    ``zero_to_fp32``); ``exclude_frozen=True`` also omits the frozen-only flat groups of a full checkpoint
    (frozen parameters inside an optimizer param group are kept, as are buffers).
    """

    def __init__(
        self,
        ckpt_dir: str | Path,
        tag: str | None = None,
        dtype: torch.dtype = torch.float32,
        exclude_frozen: bool = False,
    ):
        deepspeed = open_deepspeed_folder(Path(ckpt_dir), tag)
        if deepspeed is not None:
            self.path, self.manifest, self.split, self._parts = deepspeed.path, None, None, []
            self.layout, self.dtype, self._source = deepspeed.layout, dtype, deepspeed.source
            self._model = _Tensors(deepspeed.model_tensors)
            tensors = deepspeed.model_tensors
            buffers = {k.removeprefix("model/"): t for k, t in tensors.items() if k.startswith("model/")}
            params = {p.name: list(p.shape) for g in self.layout.groups for p in g.slots}
            self.meta = {"entries": [{"name": n} for n in [*params, *(b for b in buffers if b not in params)]],
                         "shapes": {**{n: list(t.shape) for n, t in buffers.items()}, **params},
                         "dtypes": {**{n: str(t.dtype).removeprefix("torch.") for n, t in buffers.items()},
                                    **dict.fromkeys(params, "float32")}}  # fmt: skip
            self._alias = {}
            self._source_of = {**dict.fromkeys(buffers, "model"), **dict.fromkeys(params, "flat")}
            self.excluded = set()
            if exclude_frozen:
                self.excluded |= {p.name for g in self.layout.groups if g.group_index is None for p in g.slots}
            return
        self.path = storage.resolve(Path(ckpt_dir), tag)
        self.manifest = storage.read_manifest(self.path)
        # a model split over tensor-parallel ranks: one checkpoint per rank, each split tensor reassembled whole
        self.split = read_split_record(self.path, self.manifest)
        self._parts = []
        if self.split is not None:
            self._parts = [ConsolidatedState(self.path, part_tag(t), dtype, exclude_frozen)
                           for t in range(self.split.size)]  # fmt: skip
            first = self._parts[0]
            self.meta = dict(
                first.meta,
                shapes={**first.meta["shapes"], **{n: list(p.full_shape) for n, p in self.split.params.items()}},
            )
            self.layout, self.dtype, self.excluded = first.layout, dtype, first.excluded
            self._model, self._source = None, None  # read through the parts
            self._alias, self._source_of = first._alias, first._source_of
            return
        self.meta = storage.read_json(self.path, f"{storage.MODEL_STATES}.json", self.manifest)
        self.layout = CheckpointLayout.from_dict(self.meta["layout"])
        self.dtype = dtype
        model_file = f"{storage.MODEL_STATES}.safetensors"
        storage.verify(self.path, [model_file], self.manifest)
        self._model = safe_open(str(self.path / model_file), "pt")
        self._source = storage.FileShardSource(self.path, self.layout.world_size, self.manifest)
        self._alias = {e["name"]: e["alias_of"] for e in self.meta["entries"] if "alias_of" in e}
        self._source_of = {e["name"]: e.get("source") for e in self.meta["entries"]}
        self.excluded = set(self.meta.get("excluded_frozen", []))
        if exclude_frozen:
            self.excluded |= {p.name for g in self.layout.groups if g.group_index is None for p in g.slots}

    def _out_dtype(self, stored: torch.dtype) -> torch.dtype:
        return self.dtype if stored.is_floating_point else stored

    def specs(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``(key, dtype, shape)`` of every state-dict entry, in the model's ``state_dict()`` order."""
        out = []
        for e in self.meta["entries"]:
            base = self._alias.get(e["name"], e["name"])
            if base in self.excluded:
                continue
            stored = getattr(torch, self.meta["dtypes"][base])
            out.append((e["name"], self._out_dtype(stored), tuple(self.meta["shapes"][base])))
        return out

    def tensor(self, name: str) -> torch.Tensor:
        """The full tensor of state-dict key ``name`` (read now, from the shards or the model file)."""
        base = self._alias.get(name, name)
        if base in self.excluded:
            raise KeyError(f"{name}: a frozen parameter excluded from checkpoint {self.path}")
        if self._parts:
            if base in self.split.params:
                return self.split.params[base].unshard([p.tensor(base) for p in self._parts])
            return self._parts[0].tensor(base)
        shape = tuple(self.meta["shapes"][base])
        if self._source_of[base] == "flat":
            return read_param(self.layout, self._source, "master", base).view(shape).to(self.dtype)
        t = self._model.get_tensor(f"model/{base}")
        return t.to(self._out_dtype(t.dtype))

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, _, _ in self.specs():
            yield name, self.tensor(name)


class _Tensors:
    """In-memory tensors read like a safetensors handle (``get_tensor``)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def _mapped_state_dict(path: Path) -> tuple[dict[str, torch.Tensor], mmap.mmap]:
    """Tensors viewing a safetensors file through mmap (page cache, not process memory)."""
    with open(path, "rb") as f:
        # copy-on-write mapping: writable for torch.frombuffer, yet nothing is copied unless written
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    n = int.from_bytes(mm[:8], "little")
    header = json.loads(mm[8 : 8 + n])
    header.pop("__metadata__", None)
    by_code = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
               "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
               "BOOL": torch.bool}  # fmt: skip
    out = {}
    for name, info in header.items():
        a, b = info["data_offsets"]
        dtype = by_code[info["dtype"]]
        if b == a:
            out[name] = torch.empty(info["shape"], dtype=dtype)
            continue
        raw = torch.frombuffer(mm, dtype=torch.uint8, count=b - a, offset=8 + n + a)
        out[name] = raw.view(dtype).view(info["shape"])
    return out, mm


def consolidate(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    tag: str | None = None,
    fmt: Literal["safetensors", "torch"] = "safetensors",
    dtype: torch.dtype = torch.float32,
    exclude_frozen: bool = False,
    max_shard_size: int | str | None = None,
) -> Path:
    """Write the full state dict of checkpoint ``ckpt_dir/tag`` (default: ``latest``) into ``out_dir``.

    Output: ``model.safetensors`` (or ``pytorch_model.bin`` for ``fmt="torch"``, written with ``torch.save`` from
    memory-mapped tensors), plus ``config.json`` when the checkpoint holds a model config (transformers models:
    ``from_pretrained(out_dir)`` then works). Mirrors DeepSpeed's ``zero_to_fp32.py`` but needs no conversion
    step for other world sizes and handles every param group and stage.

    Args:
        dtype: floating-point output dtype (fp32 default); integer/bool buffers keep theirs.
        exclude_frozen: also omit the frozen-only flat groups' parameters (those a checkpoint saved with
            ``exclude_frozen_parameters=True`` lacks are always omitted).
        max_shard_size: bytes per weight file (int, or a string such as ``"5GB"``); when the state dict needs
            more than one file they are named ``model-00001-of-0000N.safetensors`` (``pytorch_model-...bin``) with
            ``model.safetensors.index.json`` (``pytorch_model.bin.index.json``) beside them, as transformers and
            DeepSpeed's ``zero_to_fp32.py`` write them. None: always one file.

    Returns:
        the path of the written weights file, or of the index file when the output was split.

    Raises:
        CheckpointError: a missing, corrupt or truncated checkpoint file (named); ValueError: an unknown ``fmt`` or
        a ``max_shard_size`` that is not a size.
    """
    if fmt not in ("safetensors", "torch"):
        raise ValueError(f"fmt must be 'safetensors' or 'torch', got {fmt!r}")
    limit = parse_size(max_shard_size)
    state = ConsolidatedState(ckpt_dir, tag, dtype, exclude_frozen)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = SAFETENSORS_NAME if fmt == "safetensors" else TORCH_NAME
    shards = plan_shards(state.specs(), limit)
    names = shard_names(base, len(shards))
    for name, shard in zip(names, shards):
        _write_file(out, name, shard, state.tensor, fmt)
    target = out / base if len(shards) == 1 else write_index(out, base, names, shards)
    if state.meta.get("model_config") is not None:
        (out / "config.json").write_text(json.dumps(state.meta["model_config"], indent=2))
    return target


def _write_file(out: Path, name: str, specs, produce, fmt: str) -> None:
    """One weight file ``out/name`` of ``specs`` (atomic: a hidden temp file renamed into place)."""
    tmp = out / f".{name}.safetensors.tmp"
    write_streaming(tmp, specs, produce, metadata={"format": "pt"})
    if fmt == "safetensors":
        os.replace(tmp, out / name)
        return
    tensors, mm = _mapped_state_dict(tmp)
    torch.save(tensors, out / f".{name}.tmp")
    del tensors
    mm.close()
    os.replace(out / f".{name}.tmp", out / name)
    tmp.unlink()
