"""AutoTP for training: split a model's ``Linear`` layers over a tensor-parallel group, in place.

DeepSpeed 0.19.8 does this inside ``deepspeed.initialize`` when ``tensor_parallel.autotp_size > 1``
(``_apply_autotp_partitioning``); zero's engine calls :func:`apply_autotp` at the same point. Behaviour mirrored:

* which layers split how: :func:`zero_parallel.tp_specs.resolve_specs` (partition_config / preset, else the
  model's transformers plan, else the built-in llama rules); a layer no spec names stays whole.
* attention layers (a name without ``mlp``, not the LM head) are split in whole key-value head groups: with ``kv``
  key-value heads, ``q/k/v_proj`` rows and ``o_proj`` columns go in blocks of ``size / kv``, the first ranks taking
  one block more when ``kv`` is not a multiple of the group size; other layers split element-wise the same way.
  A rank with no head at all is refused (transformers' attention cannot run on zero heads).
* the attention modules' head counts (``num_heads``, ``num_key_value_heads`` ...) become the rank's own;
  ``num_key_value_groups`` is unchanged because q and kv heads are split in proportion.
* embeddings, norms and an LM head tied to the embedding stay whole (replicated); a skip spec with
  ``grad_allreduce`` sums its parameter's gradient over the group in backward.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from zero_comm import all_reduce, broadcast
from zero_parallel.tp_layers import ColumnParallelLinear, RowParallelLinear, ShardLayout, even_sizes
from zero_parallel.tp_specs import LayerSpec, PartitionConfig, PartitionType

_HEAD_COUNTS = ("num_heads", "num_attention_heads")  # attention-module attributes some models read in forward
_KV_HEAD_COUNTS = ("num_key_value_heads", "num_kv_heads")
_MLP_NAMES = ("mlp", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


@dataclass
class TensorParallelLayout:
    """What :func:`apply_autotp` did to a model.

    Attributes:
        group: the tensor-parallel process group; size / rank: its size and this rank's index in it.
        shards: parameter name -> :class:`ShardLayout` for every split parameter (the others are replicated).
        sharded_ids: ``id()`` of every split ``nn.Parameter`` (what the gradient norm counts once per rank).
        grad_allreduce: names of replicated parameters whose gradient is summed over the group.
        source: where the specs came from (the config, a preset, the model's plan, the built-in rules).
    """

    group: object
    size: int
    rank: int
    source: str
    shards: dict[str, ShardLayout] = field(default_factory=dict)
    sharded_ids: set[int] = field(default_factory=set)
    grad_allreduce: list[str] = field(default_factory=list)

    def is_sharded(self, param: torch.nn.Parameter) -> bool:
        """Whether ``param`` holds a tensor-parallel shard (as opposed to a replica)."""
        return id(param) in self.sharded_ids

    def is_duplicate(self, param: torch.nn.Parameter) -> bool:
        """False: every tensor-parallel rank counts its shards, and the replicas once."""
        return False

    def describe(self) -> str:
        """One line for the start-up log."""
        return (f"AutoTP: tp={self.size}, {len(self.shards)} parameters split ({self.source}), "
                f"the rest replicated")  # fmt: skip


_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def layout_of(model: torch.nn.Module) -> TensorParallelLayout | None:
    """The layout :func:`apply_autotp` recorded for ``model``, or None when it was not split."""
    return _LAYOUTS.get(model)


def _model_dims(model) -> tuple[str | None, int | None, int | None]:
    """``(model_type, num_attention_heads, num_key_value_heads)`` from a transformers config (Nones otherwise)."""
    cfg = getattr(model, "config", None)  # transformers models carry one; plain modules do not
    cfg = getattr(cfg, "text_config", None) or cfg
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    return getattr(cfg, "model_type", None), heads, kv


def _is_attention(name: str, lm_head: tuple[str, ...]) -> bool:
    last = name.rsplit(".", 1)[-1]
    return last not in lm_head and not any(m in name for m in _MLP_NAMES)


def _sizes(total: int, spec: LayerSpec, size: int, kv: int | None, attention: bool) -> tuple[tuple[int, ...], ...]:
    out = []
    for sub in spec.sub_param_sizes(total):
        unit = sub // kv if attention and kv and sub % kv == 0 else 1
        out.append(even_sizes(sub, size, unit))
    return tuple(out)


def _broadcast_from_first(model: torch.nn.Module, group) -> None:
    """Every rank of ``group`` starts from rank 0's full weights (so the shards are of one model); tensors on the
    meta device hold no values and are left alone (their shards are loaded later, zero_inference's checkpoints)."""
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.numel() and not t.is_meta:
                data = t.data.contiguous()
                broadcast(data, src, group)
                if data.data_ptr() != t.data.data_ptr():
                    t.data.copy_(data)


def _grad_allreduce_hook(group):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        all_reduce(grad, group, op="sum")
        return grad

    return hook


def apply_autotp(model: torch.nn.Module, group, partition: PartitionConfig, overlap_comm: bool = False,
                 ) -> TensorParallelLayout:  # fmt: skip
    """Split ``model``'s ``Linear`` layers over ``group`` as ``partition`` says, in place; collective over ``group``.

    Args:
        model: the full model, the same on every rank of ``group`` (rank 0's parameters and buffers are
            broadcast first). A transformers model's config gives the head counts.
        group: the tensor-parallel process group (size >= 1).
        partition: the specs (:func:`zero_parallel.tp_specs.resolve_specs`).
        overlap_comm: overlap each column-parallel layer's backward all-reduce with its weight gradient.

    Returns:
        The :class:`TensorParallelLayout` (also kept for :func:`layout_of`).

    Raises:
        RuntimeError: ``model`` was split already.
        ValueError: a spec's ``partition_dim`` is not the ``Linear``'s (0 column, 1 row) or its ``shape`` does not
            fit; ``gather_output`` with packed sub-parameters; ``strict_mode`` and a ``Linear`` no spec names;
            a rank would hold none of a split layer (more ranks than key-value heads, or than features). Every
            check runs before any layer is changed.
    """
    if model in _LAYOUTS:
        raise RuntimeError("apply_autotp: this model is split already (tensor_parallel applied once per model)")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    model_type, heads, kv = _model_dims(model)
    layout = TensorParallelLayout(group, size, rank, partition.source)
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    plan = []  # (parent, child name, module name, linear, spec, sizes): checked in full before any change
    for mod_name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        wname = f"{mod_name}.weight"
        spec = partition.find(wname, model_type)
        lm_head = mod_name.rsplit(".", 1)[-1] in partition.lm_head_patterns
        if spec is None:
            if partition.strict_mode and not lm_head:
                raise ValueError(f"tensor_parallel.partition_config.strict_mode: Linear {mod_name!r} matches "
                                 "no layer_specs pattern; add one (partition_type 'skip' keeps it whole)")  # fmt: skip
            continue
        if spec.partition_type is PartitionType.SKIP or len(names_of[id(module.weight)]) > 1:
            continue  # a tied weight (the LM head sharing the embedding's) stays replicated
        if spec.partition_dim is not None and spec.partition_dim != spec.dim:
            raise ValueError(f"layer_specs {list(spec.patterns)}: partition_dim {spec.partition_dim} on Linear "
                             f"{mod_name!r}; a Linear splits dim 0 (column) or dim 1 (row)")  # fmt: skip
        default_dim = 0 if spec.partition_type is PartitionType.COLUMN else 1
        if spec.dim != default_dim:
            raise ValueError(f"layer_specs {list(spec.patterns)}: partition_dim {spec.dim} on Linear {mod_name!r} "
                             f"with partition_type {spec.partition_type.value!r}; a Linear's "
                             f"{spec.partition_type.value} split is dim {default_dim}")  # fmt: skip
        if spec.gather_output and spec.shape is not None:
            raise ValueError(f"layer_specs {list(spec.patterns)}: gather_output with packed sub-parameters "
                             "(shape) is not supported; gather a plain column split")  # fmt: skip
        attention = _is_attention(mod_name, partition.lm_head_patterns)
        sizes = _sizes(module.weight.shape[spec.dim], spec, size, kv if heads else None, attention)
        empty = [r for r in range(size) if sum(s[r] for s in sizes) == 0]
        if empty:
            why = (f"the model has {kv} key-value heads" if attention and kv and size > kv else
                   f"its dim {spec.dim} has {module.weight.shape[spec.dim]} elements")  # fmt: skip
            raise ValueError(f"tensor_parallel.autotp_size {size}: rank(s) {empty} would hold none of {wname!r} "
                             f"({why}); use an autotp_size of at most that count")  # fmt: skip
        parent_name, _, child = mod_name.rpartition(".")
        plan.append((model.get_submodule(parent_name), child, mod_name, module, spec, sizes))
    _broadcast_from_first(model, group)
    split_attention: set[int] = set()
    for parent, child, mod_name, linear, spec, sizes in plan:
        wname = f"{mod_name}.weight"
        weight_layout = ShardLayout(wname, spec.dim, tuple(linear.weight.shape), sizes)
        if spec.partition_type is PartitionType.COLUMN:
            bias_layout = None
            if linear.bias is not None:
                bias_layout = ShardLayout(f"{mod_name}.bias", 0, tuple(linear.bias.shape), sizes)
                layout.shards[bias_layout.name] = bias_layout
                layout.sharded_ids.add(id(linear.bias))
            new = ColumnParallelLinear(linear, weight_layout, bias_layout, group, rank, spec.gather_output,
                                       overlap_comm)  # fmt: skip
            if _is_attention(mod_name, partition.lm_head_patterns):
                split_attention.add(id(parent))
        else:
            new = RowParallelLinear(linear, weight_layout, group, rank)
        layout.shards[wname] = weight_layout
        layout.sharded_ids.add(id(new.weight))
        setattr(parent, child, new)
    if heads and kv:
        local_kv = even_sizes(kv, size)[rank] if kv >= size else None
        for module in model.modules():
            if id(module) in split_attention and local_kv is not None:
                _set_head_counts(module, local_kv * (heads // kv), local_kv)
    for name, p in model.named_parameters():
        spec = partition.find(name, model_type)
        if spec is not None and spec.grad_allreduce and size > 1:
            p.register_hook(_grad_allreduce_hook(group))
            layout.grad_allreduce.append(name)
    _LAYOUTS[model] = layout
    return layout


def _set_head_counts(module: torch.nn.Module, q_heads: int, kv_heads: int) -> None:
    """The attention module's own head counts become this rank's (only attributes it already has as ints)."""
    own = vars(module)  # the module's plain attributes: set only those it declares
    for attr in _HEAD_COUNTS:
        if isinstance(own.get(attr), int):
            own[attr] = q_heads
    for attr in _KV_HEAD_COUNTS:
        if isinstance(own.get(attr), int):
            own[attr] = kv_heads
