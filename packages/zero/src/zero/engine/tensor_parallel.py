"""AutoTP in ``initialize``: ``deepspeed.tp_model_init``, the ``tensor_parallel`` section applied to the model, and
the groups ZeRO then shards over.

DeepSpeed 0.19.8 splits the model inside ``initialize`` when ``tensor_parallel.autotp_size`` > 1 (``tp_model_init``
only records its arguments, merged into the config there: the config wins, a missing ``autotp_size`` / ``dtype`` is
filled from the record, a different one is an error), builds the tensor-parallel groups itself, and runs ZeRO over
the data-parallel ranks of each tensor-parallel rank. zero does the same on zero_parallel's (dp, sp, tp)
``DeviceMesh``: ranks ``r`` with the same ``r // tp`` form one tensor-parallel group; ZeRO's group is the ranks
with the same ``r % tp``.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zero.config import ConfigError, EngineConfig, NotSupportedError
from zero.config.model import read_config
from zero.config.tensor_parallel_section import dtype_from
from zero.engine.sequence_parallel import ParallelGroups
from zero.parallel_groups import TensorParallelGroups
from zero_core.zero_init import unpartition
from zero_parallel import (
    LayerSpec,
    PartitionConfig,
    PartitionType,
    TensorParallelLayout,
    apply_autotp,
    init_parallel_mesh,
    resolve_specs,
)


@dataclass(frozen=True)
class _Recorded:
    tp_size: int
    dtype: torch.dtype


_RECORDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tp_model_init(model: torch.nn.Module, tp_size: int, dtype: torch.dtype, config=None, **kwargs) -> torch.nn.Module:
    """DeepSpeed's ``deepspeed.tp_model_init``: record the tensor-parallel size and dtype for ``model``; the split
    happens in :func:`zero.initialize` (as in DeepSpeed 0.19.8, where this call is record-only).

    Args:
        model: the full model (unchanged here).
        tp_size: ranks to split it over (int >= 1).
        dtype: fp16, bf16 or fp32 (``torch.dtype`` or its name); checked against ``tensor_parallel.dtype`` when
            the config gives one. The training precision itself comes from the config's fp16 / bf16 sections.
        config: unused, as in DeepSpeed 0.19.8.
        **kwargs: ``tp_group`` must be None (zero builds the tensor-parallel group from its mesh).

    Returns:
        ``model`` itself.

    Raises:
        TypeError / ValueError: ``tp_size`` is not an int >= 1, ``dtype`` is not a floating dtype, or an unknown
            keyword. NotSupportedError: a ``tp_group``.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_model_init(tp_size=...): an int >= 1, got {tp_size!r}")
    unknown = sorted(set(kwargs) - {"tp_group"})
    if unknown:
        raise TypeError(f"tp_model_init(): unexpected keyword(s) {unknown}")
    if kwargs.get("tp_group") is not None:
        raise NotSupportedError("tp_model_init(tp_group=...): zero builds the tensor-parallel group from its device "
                                "mesh (ranks r with the same r // tp_size); leave tp_group out")  # fmt: skip
    _RECORDED[model] = _Recorded(tp_size, dtype_from(dtype, "tp_model_init(dtype=...)"))
    return model


def merge_recorded(model: torch.nn.Module, raw):
    """``raw`` (a config dict, JSON path or EngineConfig; returned as it is without a record) with what
    ``tp_model_init`` recorded for ``model`` filled in: the config wins; ``tensor_parallel.autotp_size`` and
    ``dtype`` are taken from the record when the config leaves them out.

    Raises:
        ConfigError: the config's ``autotp_size`` or ``dtype`` differs from the recorded one (both named).
    """
    rec = _RECORDED.get(model)
    if rec is None:
        return raw
    raw = read_config(raw)
    section = dict(raw.get("tensor_parallel") or {})
    size = section.get("autotp_size")
    if size in (None, 0):
        section["autotp_size"] = rec.tp_size
    elif size != rec.tp_size:
        raise ConfigError(f"config key 'tensor_parallel.autotp_size': {size} differs from tp_model_init(tp_size="
                          f"{rec.tp_size}); make them equal or drop one")  # fmt: skip
    if section.get("dtype") is None:
        section["dtype"] = rec.dtype
    elif dtype_from(section["dtype"], "tensor_parallel.dtype") != rec.dtype:
        raise ConfigError(f"config key 'tensor_parallel.dtype': {section['dtype']!r} differs from tp_model_init("
                          f"dtype={rec.dtype}); make them equal or drop one")  # fmt: skip
    out = copy.copy(raw)
    out["tensor_parallel"] = section
    return out


def _partition(cfg: EngineConfig) -> PartitionConfig | None:
    section = cfg.tensor_parallel.partition_config
    if section is None:
        return None
    specs = tuple(LayerSpec(tuple(s.patterns), PartitionType(s.partition_type), s.partition_dim,
                            _shape(s.shape), s.gather_output, s.grad_allreduce,
                            tuple(s.model_types) if s.model_types is not None else None)
                  for s in section.layer_specs)  # fmt: skip
    return PartitionConfig(specs, section.use_default_specs, section.strict_mode, tuple(section.lm_head_patterns))


def partition_of(cfg: EngineConfig) -> PartitionConfig | None:
    """``cfg``'s ``tensor_parallel.partition_config`` as zero_parallel's PartitionConfig (None when absent)."""
    return _partition(cfg)


def _shape(shape: list | None) -> tuple | None:
    return None if shape is None else tuple(tuple(d) if isinstance(d, list) else d for d in shape)


@dataclass(frozen=True)
class TensorParallelSetup:
    """What :func:`setup_tensor_parallel` built: the split's layout and the groups ZeRO trains over."""

    layout: TensorParallelLayout
    groups: ParallelGroups
    mesh_groups: TensorParallelGroups  # what deepspeed.utils.groups' tensor-parallel getters answer


def setup_tensor_parallel(model: torch.nn.Module, cfg: EngineConfig, mpu) -> TensorParallelSetup | None:
    """Split ``model`` as ``cfg.tensor_parallel`` says (None when ``autotp_size`` <= 1). Collective. Parameters
    partitioned by ``zero.Init`` are gathered whole first (each rank then holds the full model until the split);
    ZeRO (any stage) partitions the split model over the data-parallel group afterwards.

    Raises:
        NotSupportedError: an ``mpu`` with ``autotp_size`` > 1.
        ValueError: from AutoTP (a layer that cannot be split as asked; see ``zero_parallel.apply_autotp``).
    """
    tp = cfg.tensor_parallel
    if tp.size == 1:
        return None
    if mpu is not None:
        raise NotSupportedError(f"initialize(mpu=...) with config key 'tensor_parallel.autotp_size': {tp.autotp_size} "
                                "is not supported yet by zero (sequence and tensor parallelism are not combined); "
                                "drop one")  # fmt: skip
    for param in model.parameters():  # built under zero.Init: whole again, to be split, then partitioned over dp
        unpartition(param)
    mesh = init_parallel_mesh(tensor_parallel_size=tp.size)
    try:
        partition = resolve_specs(model, _partition(cfg), tp.preset_model)
    except ValueError as e:
        raise ConfigError(f"config key 'tensor_parallel': {e}") from None
    layout = apply_autotp(model, mesh.get_group("tp"), partition, tp.tp_overlap_comm)
    if dist.get_rank() == 0:
        print(f"zero: {layout.describe()}", flush=True)
    dp = mesh.get_group("dp")
    return TensorParallelSetup(layout, ParallelGroups(1, mesh.size(0), mesh.get_local_rank("dp"), dp),
                               TensorParallelGroups(mesh.get_group("tp"), dp))  # fmt: skip


def gather_full_state(state: dict[str, torch.Tensor], layout: TensorParallelLayout) -> dict[str, torch.Tensor]:
    """``state`` (this rank's ``state_dict``: split parameters at their shard shapes) with every split key
    all-gathered over the tensor-parallel group and rebuilt at its full shape (``ShardLayout.unshard``): the
    state dict of the single-process model. Collective over ``layout.group``; every rank of it must hold ``state``.
    """
    from zero_comm import all_gather_into_tensor

    out = dict(state)
    for name, shard_layout in layout.shards.items():
        local = state[name].contiguous()
        shapes = []
        for r in range(layout.size):
            shape = list(shard_layout.full_shape)
            shape[shard_layout.dim] = shard_layout.rank_width(r)
            shapes.append(shape)
        numels = [int(torch.Size(s).numel()) for s in shapes]
        widest = max(numels)
        send = torch.zeros(widest, dtype=local.dtype)
        send[: local.numel()] = local.reshape(-1)
        buf = torch.empty(layout.size * widest, dtype=local.dtype)
        all_gather_into_tensor(buf, send, layout.group)
        shards = [buf[r * widest : r * widest + numels[r]].view(shapes[r]) for r in range(layout.size)]
        out[name] = shard_layout.unshard(shards)
    return out
