"""Full (unsharded) state dict of a running job, and writing it as model weights (the engine's
``save_16bit_model`` / DeepSpeed's ``_zero3_consolidated_16bit_state_dict``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file

from zero_comm import all_gather_into_tensor, same_outcome
from zero_core.checkpoint.consolidate import SAFETENSORS_NAME, TORCH_NAME
from zero_core.checkpoint.save import current_layout, model_entries
from zero_core.checkpoint.target import rank_and_world
from zero_core.checkpoint.zero_runtime import as_checkpointable


def full_state_dict(runtime, dtype: torch.dtype | None = None, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """Every ``module.state_dict()`` key at full shape. Collective: every rank must call it.

    Trainable parameters come from the fp32 masters (all-gathered), frozen parameters from their stored shards,
    buffers as they are; tied keys share one tensor.

    Args:
        dtype: cast floating-point tensors to this dtype (None: fp32 for parameters, buffers unchanged).
        rank0_only: other ranks get an empty dict (they still take part in the gathers).

    Returns:
        key -> CPU tensor, in ``module.state_dict()`` order.
    """
    view = as_checkpointable(runtime)
    rank, world = rank_and_world(view.group)
    layout = current_layout(view)
    entries, stored = model_entries(view, layout)
    flat: dict[str, torch.Tensor] = {}
    for g, shard in view.checkpoint_groups():
        shard = shard.detach().float().contiguous()
        if g.partitions > 1:
            buf = torch.empty(g.partitions * shard.numel(), dtype=shard.dtype)
            all_gather_into_tensor(buf, shard, view.group)  # zero_comm's: torch deprecates its old name
            shards = list(buf.view(g.partitions, -1).unbind(0))
        else:
            shards = [shard]
        for b in g.buckets:
            whole = torch.cat([s[b.shard_slice()] for s in shards])
            for p in b.slots:
                flat[p.name] = whole[p.bucket_offset : p.bucket_offset + p.numel].view(p.shape).clone()
    model = dict(view.gathered_model_state(stored))
    if rank0_only and rank != 0:
        return {}
    out: dict[str, torch.Tensor] = {}
    for e in entries:
        name = e["name"]
        if "alias_of" in e:
            out[name] = out[e["alias_of"]]
            continue
        t = flat[name] if e["source"] == "flat" else model[name].detach().cpu().clone()
        out[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out


def save_model_weights(
    runtime,
    out_dir: str | Path,
    fmt: Literal["safetensors", "torch"] = "safetensors",
    dtype: torch.dtype | None = None,
    model_config: dict[str, Any] | None = None,
) -> Path | None:
    """Write :func:`full_state_dict` on rank 0 as ``model.safetensors`` (or ``pytorch_model.bin``) plus
    ``config.json`` when ``model_config`` is given, atomically (temp file + rename). Collective.

    Returns:
        the weights file on rank 0, None on other ranks.
    """
    if fmt not in ("safetensors", "torch"):
        raise ValueError(f"fmt must be 'safetensors' or 'torch', got {fmt!r}")
    state = full_state_dict(runtime, dtype)
    # rank 0 writes alone; a failure there (disk full, permissions) is raised on every rank
    with same_outcome("save_model_weights", as_checkpointable(runtime).group):
        written = _write(state, Path(out_dir), fmt, model_config) if state else None
    return written


def _write(state: dict[str, torch.Tensor], out: Path, fmt: str, model_config: dict[str, Any] | None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    name = SAFETENSORS_NAME if fmt == "safetensors" else TORCH_NAME
    tmp = out / f".{name}.tmp"
    if fmt == "safetensors":
        seen: dict[int, str] = {}
        tensors = {}
        for k, v in state.items():  # safetensors refuses shared storage: tied keys get their own copy
            tensors[k] = v.clone() if id(v) in seen else v.contiguous()
            seen.setdefault(id(v), k)
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    else:
        torch.save(state, tmp)
    os.replace(tmp, out / name)
    if model_config is not None:
        (out / "config.json").write_text(json.dumps(model_config, indent=2))
    return out / name
