"""Training a model that holds DeepSpeed MoE layers (``zero_parallel.moe.MoE``): their expert groups created at
``initialize()``, and the gradient reduction split between the expert-data-parallel and expert-parallel groups.

With ``ep_size`` P > 1 on W ranks, ZeRO (every stage) partitions and averages over the expert-data-parallel group
(W / P ranks holding the same experts), and a gradient hook on each parameter makes that average the global-batch
mean (DeepSpeed's scaling: expert gradients summed over their expert-data-parallel group and divided by W):

- an expert parameter's gradient is divided by P, so the average over W / P ranks is the sum over them over W;
- any other parameter's gradient is also averaged over the expert-parallel group, so its average over the
  expert-data-parallel group is the average over all W ranks. Once the runtime is built (:meth:`ExpertParallel.attach`),
  an optimizer param group's flat group holding no expert parameter is averaged after ZeRO's reduction instead: its
  reduced gradient shard is all-reduced over the expert-parallel group (the P ranks of a group hold the same shard
  range), one flat all-reduce per backward for all such groups together, after every backward that reduced (stages
  2-3, or the accumulation boundary at 0-1) and at ``step()`` if a backward ran outside ``engine.backward``. Both
  averages are linear and averaging values the group already holds equal leaves them, so the order does not change
  the result. A parameter in a flat group that mixes expert and other parameters keeps a gradient hook that
  all-reduces it over the expert-parallel group (one all-reduce per parameter and micro-batch).

Non-expert parameters are then sharded over W / P ranks (replicated over the P ranks of an expert-parallel
group) rather than over all W. The global gradient norm (clipping, fp16 overflow) counts the non-expert
parameters once and sums the experts' squares over the expert-parallel group: :class:`ExpertParallel` is the
runtime's ``model_parallel`` (``zero_core.model_parallel.ModelParallel``: experts are the split parameters). At
``initialize`` a model built under ``zero.Init`` is made whole first, then every non-expert parameter is broadcast
from rank 0 and every expert parameter from its expert-data-parallel group's first rank (DeepSpeed's broadcast of
the model). With ``ep_size`` 1 the groups are created and nothing else changes (experts are data parallel over the
world).

AutoEP blocks folded with AutoTP (``tensor_parallel.autotp_size`` T > 1, P a multiple of T,
:mod:`zero.engine.autoep`): ZeRO's group is still the expert-data-parallel one (its ranks hold the same
tensor-parallel shards). Each tensor-parallel rank sends its own share of the tokens through the experts, so the
W ranks together hold W / T batches and an expert's gradient is multiplied by T / P (the expert-data-parallel
average then gives the mean over the W / T batches); a non-expert parameter is averaged over the P / T ranks of its
expert-parallel group holding the same tensor-parallel shard (none when P = T) instead of the whole group. The norm
sums the experts over the expert-parallel group and counts each tensor-parallel shard once: the shards of the
first tensor-parallel group in an expert-parallel group (the others hold copies, :meth:`ExpertParallel.is_duplicate`).

Refused with ``ep_size`` > 1 (NotSupportedError naming the key, on every rank): MoE layers of different
``ep_size``; sequence parallelism, and tensor parallelism with DeepSpeed MoE layers (AutoEP blocks fold);
``gradient_allreduce_op`` "sum". Checkpoints: :mod:`zero.engine.expert_checkpoints`.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from zero.config import NotSupportedError
from zero_comm import all_reduce, broadcast
from zero_core.zero_init import unpartition
from zero_parallel.moe import EXPERT_GROUPS, ExpertParallelBlock, MoE, is_moe_param


class AveragedShards(Protocol):
    """What :class:`ExpertParallel` uses of the runtime (``zero_core.runtime.ZeroRuntime``) to average shared
    gradient shards after reduction."""

    flat_groups: list

    def grad_values(self, g) -> torch.Tensor | None: ...

    def grad_edited(self, g, shard: torch.Tensor) -> None: ...


class TensorParallelShards(Protocol):
    """What :class:`ExpertParallel` uses of AutoTP's layout (``zero_parallel.TensorParallelLayout``)."""

    size: int

    def is_sharded(self, param: torch.nn.Parameter) -> bool: ...


class ExpertParallel:
    """The expert groups a model trains over and the gradient hooks that scale its reduction (``ep_size`` > 1).

    Attributes:
        ep_size: ranks of an expert-parallel group.
        group: this rank's expert-parallel group (the ``ModelParallel`` group the gradient norm sums experts over).
        edp_group: this rank's expert-data-parallel group (ZeRO's group).
        ep_rank: this rank's place in its expert-parallel group.
        tp_size: the tensor-parallel size folded in (1: none).
        shared_group: the ranks of the expert-parallel group a non-expert gradient is averaged over (the whole
            group without AutoTP; those holding this rank's tensor-parallel shards with it; None: this rank alone).
    """

    def __init__(self, ep_size: int, ep_group, edp_group, model: torch.nn.Module, tp_layout: TensorParallelShards |
                 None = None, shared_group=None) -> None:  # fmt: skip
        self.ep_size = ep_size
        self.group = ep_group
        self.edp_group = edp_group
        self.ep_rank = ep_group.rank()
        self.tp_size = tp_layout.size if tp_layout is not None else 1
        self.shared_group = ep_group if tp_layout is None else shared_group
        self._tp_layout = tp_layout
        shared = self.shared_group is not None and self.shared_group.size() > 1
        self._shared_hooks = {id(p): p.register_hook(self._shared_grad) for p in model.parameters()
                              if shared and p.requires_grad and not is_moe_param(p)}  # fmt: skip
        self._hooks = [p.register_hook(self._expert_grad) for p in model.parameters()
                       if p.requires_grad and is_moe_param(p)]  # fmt: skip
        self._runtime: AveragedShards | None = None  # set by attach
        self._shared_groups: list = []  # the trainable flat groups holding no expert parameter
        self._pending = False  # a shared group got gradients not yet averaged over the expert-parallel group

    def _expert_grad(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * (self.tp_size / self.ep_size) if self.tp_size > 1 else grad / self.ep_size

    def _shared_grad(self, grad: torch.Tensor) -> torch.Tensor:
        summed = grad.detach().clone()
        all_reduce(summed, self.shared_group)
        return summed.div_(self.shared_group.size())

    def _mark_pending(self, grad: torch.Tensor) -> None:
        self._pending = True

    def attach(self, runtime: AveragedShards) -> None:
        """Average the flat groups of ``runtime`` that hold no expert parameter after ZeRO's reduction (one flat
        all-reduce over the expert-parallel group after each reducing backward, :meth:`after_backward`) instead of
        per parameter in backward. Called once, after the runtime is built; the other groups keep their hooks."""
        self._runtime = runtime
        if self.shared_group is None or self.shared_group.size() == 1:
            return  # nothing to average: the expert-data-parallel group is the whole data-parallel one
        for g in runtime.flat_groups:
            if g.group_index is None or any(s.param is None or is_moe_param(s.param) for s in g.slots):
                continue
            self._shared_groups.append(g)
            for s in g.slots:
                hook = self._shared_hooks.pop(id(s.param), None)
                if hook is not None:
                    hook.remove()
                    self._hooks.append(s.param.register_hook(self._mark_pending))

    def after_backward(self, reduced: bool) -> None:
        """``engine.backward`` ran; ``reduced``: the runtime reduced this backward's gradients (stages 2-3, or the
        accumulation boundary). Collective over the expert-parallel group when a shared group got gradients."""
        if reduced:  # the same on every rank (stage and boundary), so every rank joins
            self._average()

    def before_step(self) -> None:
        """``engine.step`` at the boundary: average what a backward outside ``engine.backward`` left (every rank
        of the group ran it, so every rank has the flag)."""
        if self._pending:
            self._average()

    def _average(self) -> None:
        """All-reduce (average) the gradient shards of the attached shared flat groups over the expert-parallel
        group in one flat buffer of the shards' accumulation dtype. Collective over the expert-parallel group."""
        self._pending = False
        if self._runtime is None or not self._shared_groups:
            return
        shards = [(g, self._runtime.grad_values(g)) for g in self._shared_groups]
        shards = [(g, t) for g, t in shards if t is not None and t.numel()]
        if not shards:
            return
        flat = torch.cat([t.reshape(-1) for _, t in shards])
        all_reduce(flat, self.shared_group)
        flat.div_(self.shared_group.size())
        at = 0
        for g, t in shards:
            t.copy_(flat[at : at + t.numel()].view_as(t))
            at += t.numel()
            self._runtime.grad_edited(g, t)

    def is_sharded(self, param: torch.nn.Parameter) -> bool:
        """True for an expert parameter (each expert-parallel rank holds other experts) and a tensor-parallel
        shard."""
        return is_moe_param(param) or (self._tp_layout is not None and self._tp_layout.is_sharded(param))

    def is_duplicate(self, param: torch.nn.Parameter) -> bool:
        """True for a tensor-parallel shard outside the first tensor-parallel group of this expert-parallel group
        (that group counts it); False otherwise (experts split, the rest equal and counted once)."""
        return self._tp_layout is not None and self.ep_rank >= self.tp_size and self._tp_layout.is_sharded(param)

    def close(self) -> None:
        """Remove the gradient hooks."""
        for h in [*self._hooks, *self._shared_hooks.values()]:
            h.remove()
        self._hooks.clear()
        self._shared_hooks.clear()


def moe_layers(model: torch.nn.Module) -> list[MoE | ExpertParallelBlock]:
    """The DeepSpeed MoE layers and AutoEP blocks in ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, (MoE, ExpertParallelBlock))]


def setup_expert_parallel(model: torch.nn.Module, cfg, mpu, tensor_parallel) -> ExpertParallel | None:
    """Create the expert groups of every MoE layer in ``model`` (collective) and, for ``ep_size`` > 1, check the
    config, broadcast the parameters and hook the gradients; returns None when ZeRO's group stays as it is.

    Raises:
        NotSupportedError: the combinations listed in the module docstring (the same on every rank, raised
            before any group is created).
        ValueError: ``ep_size`` not dividing the world size (every rank, before any group is created).
    """
    layers = moe_layers(model)
    if not layers:
        return None
    sizes = sorted({m.ep_size for m in layers})
    if len(sizes) > 1:
        raise NotSupportedError(f"MoE layers with different ep_size {sizes}: zero trains one expert-parallel size per "
                                "model; give every MoE layer the same ep_size")  # fmt: skip
    ep = sizes[0]
    if ep > 1:
        _check_config(cfg, mpu, tensor_parallel, layers, ep)
    for m in layers:
        m.set_deepspeed_parallelism(cfg.use_data_before_expert_parallelism)
    if ep == 1:
        return None
    name = layers[0].expert_group_name
    ep_group, edp_group = EXPERT_GROUPS.expert_parallel_group(name), EXPERT_GROUPS.expert_data_parallel_group(name)
    edp_source = EXPERT_GROUPS.expert_data_parallel_ranks[name][0]
    tp = tensor_parallel.layout.size if tensor_parallel is not None else 1
    shared_group = _same_shard_group(ep, tp) if tp > 1 else None
    for p in model.parameters():  # built under zero.Init: whole again, then partitioned over edp
        unpartition(p)
    rank = dist.get_rank()
    with torch.no_grad():
        for p in model.parameters():
            if is_moe_param(p):
                broadcast(p.data, edp_source, edp_group)
            elif tp > 1:  # the data-parallel group's first rank holds the same tensor-parallel shard
                broadcast(p.data, rank % tp, tensor_parallel.groups.shard_group)
            else:
                broadcast(p.data, 0)
    layout = tensor_parallel.layout if tp > 1 else None
    return ExpertParallel(ep, ep_group, edp_group, model, layout, shared_group)


def _same_shard_group(ep: int, tp: int):
    """This rank's ranks of its expert-parallel group holding its tensor-parallel shards (``ep / tp`` of them,
    strided by ``tp``); None when that is this rank alone. Collective: every rank creates every group."""
    if ep == tp:
        return None
    mine, world, rank = None, dist.get_world_size(), dist.get_rank()
    for start in range(0, world, ep):
        for t in range(tp):
            ranks = list(range(start + t, start + ep, tp))
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = group
    return mine


def _check_config(cfg, mpu, tensor_parallel, layers: list, ep: int) -> None:
    why = f"with MoE ep_size={ep} > 1"
    autoep = all(isinstance(m, ExpertParallelBlock) for m in layers)  # AutoEP's blocks fold onto AutoTP
    if mpu is not None or (tensor_parallel is not None and not autoep):
        raise NotSupportedError(f"sequence or tensor parallelism {why} is not supported; use one of them at a time "
                                "(AutoTP folds with the expert_parallel section's blocks, not MoE layers)")  # fmt: skip
    if cfg.gradient_allreduce_op != "mean":
        raise NotSupportedError(f"config key 'gradient_allreduce_op': 'sum' {why} is not supported; use 'mean'")
