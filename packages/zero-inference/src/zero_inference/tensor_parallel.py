"""AutoTP for inference: which group a model is split over, the checks before the split, and the layer specs.

DeepSpeed 0.19.8's ``InferenceEngine`` splits a model when ``tensor_parallel.tp_size > 1`` (AutoTP) or an
``injection_policy`` names the row-parallel layers of a module class; the split itself is zero_parallel's
:func:`~zero_parallel.apply_autotp` (column-parallel ``Linear``: output features split, no communication in
forward; row-parallel: input features split, one all-reduce of its output). Behaviour mirrored and where it differs:

* the group: the ``mpu``'s model-parallel group (``tp_size`` becomes its size), else ``tp_group``, else consecutive
  blocks of ``tp_size`` ranks (DeepSpeed makes one group of ranks ``0..tp_size-1``; zero makes one per block, so a
  world of several replicas works).
* the specs (no injection policy): the model's transformers ``tp_plan`` or the built-in llama rules
  (:func:`zero_parallel.resolve_specs`); an untied LM head is column-split with its output gathered, a tied one
  stays whole.
* zero refuses a ``tp_size`` that does not divide the attention heads and key-value heads, where DeepSpeed shards
  heads unevenly; and one that does not divide the world size.
"""

from __future__ import annotations

import re
from typing import Protocol

import torch
import torch.distributed as dist

from zero_parallel import LayerSpec, PartitionConfig, PartitionType, init_parallel_mesh, resolve_specs


class ModelParallelUnit(Protocol):
    """DeepSpeed's ``mpu`` as the inference engine uses it."""

    def get_model_parallel_group(self):
        """The tensor-parallel process group of this rank."""


def tensor_parallel_group(tp_size: int, tp_group, mpu: ModelParallelUnit | None):
    """``(group, size)``: the group to split over (None when ``size`` is 1).

    Raises:
        ValueError: ``tp_size`` > 1 without ``torch.distributed`` initialized; ``tp_size`` does not divide the world
            size; a ``tp_group`` whose size is not ``tp_size`` (when ``tp_size`` is above 1).
    """
    if mpu is not None:
        group = mpu.get_model_parallel_group()
        return group, dist.get_world_size(group)
    if tp_group is not None:
        size = dist.get_world_size(tp_group)
        if tp_size not in (1, size):
            raise ValueError(f"tensor_parallel.tp_size {tp_size} differs from the size {size} of the given tp_group")
        return tp_group, size
    if tp_size == 1:
        return None, 1
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"tensor_parallel.tp_size {tp_size} needs torch.distributed initialized first "
                         "(deepspeed.init_distributed() or torch.distributed.init_process_group)")  # fmt: skip
    world = dist.get_world_size()
    if world % tp_size:
        raise ValueError(f"tensor_parallel.tp_size {tp_size} does not divide the world size {world}: every block of "
                         f"{tp_size} consecutive ranks holds one copy of the model")  # fmt: skip
    return init_parallel_mesh(tensor_parallel_size=tp_size).get_group("tp"), tp_size


def check_heads(model: torch.nn.Module, tp_size: int) -> None:
    """Raises ValueError when ``tp_size`` does not divide the model's attention or key-value heads (read from a
    transformers config, or its ``text_config``); models without a config are not checked."""
    cfg = getattr(model, "config", None)  # transformers models carry one; a plain module does not
    cfg = getattr(cfg, "text_config", None) or cfg
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    for what, count in (("attention heads", heads), ("key-value heads", kv)):
        if isinstance(count, int) and count % tp_size:
            raise ValueError(f"tensor_parallel.tp_size {tp_size} does not divide the model's {count} {what} "
                             "(config.num_attention_heads / num_key_value_heads): each rank must hold whole heads, "
                             f"the same number on every rank; choose a tp_size dividing {count}")  # fmt: skip


def injection_specs(model: torch.nn.Module, policy: dict) -> PartitionConfig:
    """Layer specs from DeepSpeed's ``injection_policy``: in every module of a class the policy names, the
    ``Linear``s whose name (relative to that module) ends in one of its names are row-parallel, the other
    ``Linear``s column-parallel; everything outside such modules stays whole.

    Raises:
        TypeError: a key that is not an ``nn.Module`` subclass, or names that are not strings.
        ValueError: a name no module of the model ends with (DeepSpeed: "Injection policy layer ... not valid").
    """
    names = [n for n, _ in model.named_modules()]
    specs = []
    for cls, rows in policy.items():
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            raise TypeError(f"injection_policy key {cls!r}: expected an nn.Module subclass (a layer class)")
        rows = (rows,) if isinstance(rows, str) else tuple(rows)
        if not all(isinstance(r, str) for r in rows):
            raise TypeError(f"injection_policy[{cls.__name__}] = {rows!r}: expected layer names (strings)")
        for row in rows:
            if not any(n.endswith(row) for n in names):
                raise ValueError(f"injection_policy[{cls.__name__}]: no layer of the model ends with {row!r}")
        for prefix, module in model.named_modules():
            if not isinstance(module, cls):
                continue
            for child, sub in module.named_modules():
                if child and isinstance(sub, torch.nn.Linear):
                    kind = PartitionType.ROW if any(child.endswith(r) for r in rows) else PartitionType.COLUMN
                    full = f"{prefix}.{child}" if prefix else child
                    specs.append(LayerSpec((f"^{re.escape(full)}\\.weight$",), kind))
    return PartitionConfig(tuple(specs), use_default_specs=False, source="injection_policy")


def autotp_specs(model: torch.nn.Module) -> PartitionConfig:
    """The specs AutoTP applies without an injection policy (see the module docstring)."""
    return resolve_specs(model, None, None)
