"""The inference config's ``checkpoint``: weights loaded file by file into a split model, each rank reading its shard.

DeepSpeed 0.19.8 loads AutoTP checkpoints from a JSON description (``{"type": "ds_model", "checkpoints": [file,
...], "version": 1.0}``, as a dict or a file path; the files relative to the config's ``base_dir``) into a model
built on the meta device, each file in turn, each rank keeping its slice. zero reads the same description, and also
a folder as transformers' ``save_pretrained`` writes it (``*.safetensors`` shards with or without an index, else
``pytorch_model*.bin``).

Memory: the model is split while still on the meta device, then given storage for this rank's shards and the
replicated tensors only (``to_empty``). A ``.safetensors`` file is read through ``safe_open`` slices, so only this
rank's rows or columns of a split tensor are read (one copy, straight from the mapped file); a torch file is
memory-mapped (``torch.load(mmap=True)``) and the shard copied out. A rank's peak resident memory while loading is
then its shards, the file pages touched in the file being read, and one tensor's shard in transit.
Every parameter and persistent buffer of the model must be found in the files (tied weights once), and every
tensor of the files must name one of them: otherwise ValueError naming the keys.
Non-persistent buffers (rotary ``inv_freq``) are not in checkpoints: a transformers model recomputes them through
its ``_init_weights`` for the modules that own them (:class:`BufferInitializer`); any other model must not have them
on the meta device.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Protocol, runtime_checkable

import torch

from zero_parallel import ShardLayout, TensorParallelLayout

DS_TYPES = ("ds_model", "bloom")
"""DeepSpeed's checkpoint-description types that list plain weight files (Megatron's are not read)."""


@runtime_checkable
class BufferInitializer(Protocol):
    """A model that can recompute a submodule's buffers (transformers' ``PreTrainedModel._init_weights``)."""

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Initialise ``module``'s own parameters and buffers in place."""


def checkpoint_files(checkpoint, base_dir: str = "") -> list[pathlib.Path]:
    """The weight files a ``checkpoint`` value names, in loading order.

    Args:
        checkpoint: a folder (transformers' layout), a JSON file path, or DeepSpeed's description as a dict.
        base_dir: the config's ``base_dir``: the description's files are relative to it (a dict's own
            ``base_dir`` wins; a JSON file's folder is used when both are empty).

    Raises:
        ValueError: a path that does not exist, a folder without weight files, a description whose ``type`` is not
            one of :data:`DS_TYPES` or without a ``checkpoints`` list, a listed file that does not exist.
    """
    if isinstance(checkpoint, (str, os.PathLike)):
        path = pathlib.Path(checkpoint)
        if path.is_dir():
            return _folder_files(path)
        if not path.is_file():
            raise ValueError(f"checkpoint {str(path)!r}: no such folder or JSON file")
        description = json.loads(path.read_text())
        base_dir = base_dir or str(path.parent)
    else:
        description = checkpoint
    kind = str(description.get("type", "")).lower()
    files = description.get("checkpoints")
    if kind not in DS_TYPES or not isinstance(files, list) or not files:
        raise ValueError(f"checkpoint: expected DeepSpeed's description with type in {DS_TYPES} and a non-empty "
                         f"'checkpoints' list of files, got type {kind!r} and checkpoints {files!r}")  # fmt: skip
    root = pathlib.Path(description.get("base_dir") or base_dir or ".")
    paths = [root / f for f in files]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ValueError(f"checkpoint: listed file(s) {missing} do not exist (files are relative to base_dir)")
    return paths


def _folder_files(folder: pathlib.Path) -> list[pathlib.Path]:
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (folder / index).is_file():
            weight_map = json.loads((folder / index).read_text())["weight_map"]
            return [folder / f for f in sorted(set(weight_map.values()))]
    for pattern in ("*.safetensors", "pytorch_model*.bin"):
        found = sorted(folder.glob(pattern))
        if found:
            return found
    raise ValueError(f"checkpoint {str(folder)!r}: no *.safetensors or pytorch_model*.bin files in the folder")


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Give a meta-device model storage on ``device`` (this rank's shards only, the model being split), keeping
    tied parameters tied and recomputing non-persistent buffers (see the module docstring).

    Raises:
        ValueError: a model that is not a :class:`BufferInitializer` has non-persistent buffers on the meta device.
    """
    tied: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            tied.setdefault(id(p), []).append((module, name))
    owners = [m for m in model.modules()
              if any(b is not None and b.is_meta and n in m._non_persistent_buffers_set
                     for n, b in m.named_buffers(recurse=False))]  # fmt: skip
    if owners and not isinstance(model, BufferInitializer):
        raise ValueError(f"checkpoint: {type(owners[0]).__name__} has non-persistent buffers on the meta device, "
                         "which checkpoints do not hold; build the model with them on the CPU")  # fmt: skip
    model.to_empty(device=device)
    for places in tied.values():
        first_module, first_name = places[0]
        for module, name in places[1:]:
            setattr(module, name, getattr(first_module, first_name))
    with torch.no_grad():
        for module in owners:
            model._init_weights(module)


def _read(handle, name: str, layout: ShardLayout | None, rank: int, mapped: bool) -> torch.Tensor:
    """This rank's part of tensor ``name``: a safetensors slice read piece by piece, or a mapped tensor's shard."""
    if mapped:
        full = handle[name]
        return full if layout is None else layout.shard(full, rank)
    if layout is None:
        return handle.get_tensor(name)
    sliced = handle.get_slice(name)
    pieces, start = [], 0
    for sub in layout.sizes:
        lo = start + sum(sub[:rank])
        index = (slice(lo, lo + sub[rank]),) if layout.dim == 0 else (slice(None), slice(lo, lo + sub[rank]))
        pieces.append(sliced[index])
        start += sum(sub)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, layout.dim)  # one piece: no second copy


def load_shards(model: torch.nn.Module, files: list[pathlib.Path], layout: TensorParallelLayout | None) -> None:
    """Copy every tensor of ``files`` into ``model`` (materialised, split by ``layout`` or whole), file by file;
    each value converted to the target's dtype.

    Raises:
        ValueError: a file's tensor names no parameter or persistent buffer of the model, a shape differs, or a
            parameter or persistent buffer is found in no file (names listed).
    """
    targets = dict(model.named_parameters(remove_duplicate=False))
    non_persistent = {f"{p}.{n}" if p else n for p, m in model.named_modules() for n in m._non_persistent_buffers_set}
    targets.update((n, b) for n, b in model.named_buffers() if n not in non_persistent)
    rank = layout.rank if layout is not None else 0
    filled: set[int] = set()
    for path in files:
        if path.suffix == ".safetensors":
            from safetensors import safe_open  # transformers' dependency: present wherever safetensors files are

            context = safe_open(str(path), framework="pt", device="cpu")
        else:
            context = _Mapped(torch.load(path, map_location="cpu", mmap=True, weights_only=True))
        with context as handle:
            unknown = [k for k in handle.keys() if k not in targets]
            if unknown:
                raise ValueError(
                    f"checkpoint file {path.name}: tensor(s) {unknown[:5]} name no parameter or "
                    "persistent buffer of the model (was it saved from another architecture?)"
                )
            for key in handle.keys():
                target = targets[key]
                shard_layout = layout.shards.get(key) if layout is not None else None
                value = _read(handle, key, shard_layout, rank, isinstance(handle, _Mapped))
                if value.shape != target.shape:
                    raise ValueError(f"checkpoint file {path.name}: {key} has shape {tuple(value.shape)} for this "
                                     f"rank, the model's is {tuple(target.shape)}")  # fmt: skip
                with torch.no_grad():
                    target.copy_(value)
                filled.add(id(target))
    missing = sorted(n for n, t in targets.items() if id(t) not in filled)
    if missing:
        raise ValueError(f"checkpoint: {len(missing)} parameter(s)/buffer(s) found in no file, e.g. {missing[:5]}")


class _Mapped:
    """A loaded state dict behind the same ``keys()`` / context-manager face as ``safe_open``."""

    def __init__(self, state: dict):
        self.state = state

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.state = {}

    def keys(self):
        return list(self.state)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.state[name]
