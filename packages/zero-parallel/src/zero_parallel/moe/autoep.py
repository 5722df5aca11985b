"""AutoEP: a Hugging Face MoE block replaced by an expert-parallel one (DeepSpeed 0.19.8's ``expert_parallel``
config section, ``deepspeed.module_inject.auto_ep``).

:class:`ExpertParallelBlock` keeps the block's own router module (so the routing is the model's own math: softmax,
top-k, the model's normalisation of the top-k weights) and holds this rank's ``E / ep_size`` experts in
:class:`LocalExperts` (``gate_up_proj`` [L, 2 * ffn, hidden], ``down_proj`` [L, hidden, ffn]: rows
``ep_rank * L .. (ep_rank + 1) * L`` of the model's fused expert tensors). Parameter names stay the model's
(``<block>.gate.weight``, ``<block>.experts.gate_up_proj``, ...), with the local experts' rows only.

Forward, for ``hidden_states`` [B, T, hidden] (or [S, hidden]): route every token (k routes each); dropless: the
capacity of every expert buffer is the largest number of routes any expert receives on any rank of the
expert-parallel group (one all-reduce of an int64 scalar), so no route is dropped; dispatch to [E, C, hidden],
exchange over the expert-parallel group (:mod:`.dispatch`, all_to_all_v), run the local experts on every source
rank's slots (SwiGLU as the model computes it: ``act_fn(x W_gate) * (x W_up)`` then ``W_down``), exchange back and
combine with the router's weights. The output has the input's shape. Folded with AutoTP (``tp_group`` given: the
input is the same on every rank of that tensor-parallel group), every rank routes all tokens and sends only its
own rows through the experts, and the outputs are all-gathered back over the group (:mod:`.tp_fold`). Every rank of
the expert-parallel group calls forward together (any token counts: the capacity is agreed on). Expert parameters
are marked as DeepSpeed marks them (``allreduce = False``, ``group_name = "ep_size_<P>"``), so the engine reduces
them over the expert-data-parallel group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zero_parallel.moe.autoep_presets import BlockSpec
from zero_parallel.moe.dispatch import combine, dispatch, exchange
from zero_parallel.moe.experts import mark_expert_params
from zero_parallel.moe.gating import Routing
from zero_parallel.moe.groups import EXPERT_GROUPS, group_name
from zero_parallel.moe.tp_fold import gather_rows, row_bounds, take_rows


class LocalExperts(torch.nn.Module):
    """This rank's experts, fused: ``gate_up_proj`` [L, 2 * ffn, hidden], ``down_proj`` [L, hidden, ffn].

    ``forward(inputs [P, L, C, hidden]) -> [P, L, C, hidden]``: local expert i runs on ``inputs[:, i]``.
    """

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act_fn: torch.nn.Module) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(gate_up_proj)
        self.down_proj = torch.nn.Parameter(down_proj)
        self.act_fn = act_fn
        self.num_local_experts = gate_up_proj.shape[0]

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        p, local, c, m = inputs.shape
        outputs = []
        for i in range(local):
            gate, up = F.linear(inputs[:, i].reshape(p * c, m), self.gate_up_proj[i]).chunk(2, dim=-1)
            outputs.append(F.linear(self.act_fn(gate) * up, self.down_proj[i]).view(p, 1, c, m))
        return torch.cat(outputs, dim=1)


class ExpertParallelBlock(torch.nn.Module):
    """A Hugging Face MoE block, expert-parallel over ``ep_size`` ranks (see the module docstring).

    Attributes:
        gate: the model's router module (kept as it was).
        experts: this rank's :class:`LocalExperts`.
        num_experts: E, every rank's experts together.
        ep_size, ep_rank: the expert-parallel group's size and this rank's place in it.
        expert_group_name: ``"ep_size_<ep_size>"`` (DeepSpeed's group name).
        tp_group: the tensor-parallel group the block's input is replicated over (None: not folded with AutoTP).
    """

    def __init__(self, spec: BlockSpec, ep_size: int, ep_rank: int, tp_group=None) -> None:
        super().__init__()
        local = spec.num_experts // ep_size
        rows = slice(ep_rank * local, (ep_rank + 1) * local)
        self.gate = spec.router
        with torch.no_grad():
            self.experts = LocalExperts(spec.experts.gate_up_proj[rows].clone(), spec.experts.down_proj[rows].clone(),
                                        spec.experts.act_fn)  # fmt: skip
        self.num_experts = spec.num_experts
        self.ep_size = ep_size
        self.ep_rank = ep_rank
        self.expert_group_name = group_name(ep_size)
        self.ep_group = None  # set by set_deepspeed_parallelism
        self.tp_group = tp_group if tp_group is not None and tp_group.size() > 1 else None
        mark_expert_params(self.experts, self.expert_group_name)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Create the expert groups for ``ep_size`` (unless they exist) and keep this rank's expert-parallel one.
        Collective: every rank calls it (initialize() does)."""
        EXPERT_GROUPS.create(self.ep_size, use_data_before_expert_parallel_)
        self.ep_group = EXPERT_GROUPS.expert_parallel_group(self.expert_group_name)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.ep_size > 1 and self.ep_group is None:
            raise RuntimeError(f"AutoEP block with ep_size={self.ep_size} has no expert-parallel group: pass its "
                               "model to initialize()")  # fmt: skip
        m = hidden_states.shape[-1]
        tokens = hidden_states.reshape(-1, m)
        _, weights, indices = self.gate(tokens)  # [S, k] each: the model's own routing
        if self.tp_group is not None:  # folded: this tensor-parallel rank's rows go through the experts
            lo, hi = row_bounds(tokens.shape[0], self.tp_group.size(), self.tp_group.rank())
            tokens, weights = take_rows(tokens, self.tp_group), take_rows(weights, self.tp_group)
            indices = indices[lo:hi]
        routing = dropless_routing(indices.t(), weights.t(), self.num_experts, self.ep_group)
        buffer, rows = dispatch(tokens, routing, self.num_experts)  # [E, C, M]
        received = exchange(buffer, self.ep_group)  # from each source rank, its slots of our experts
        local = received.reshape(self.ep_size, self.experts.num_local_experts, -1, m)
        out = self.experts(local).reshape(self.num_experts, -1, m)
        returned = exchange(out, self.ep_group)
        combined = combine(returned, rows, routing)
        if self.tp_group is not None:
            combined = gather_rows(combined, hidden_states.numel() // m, self.tp_group)
        return combined.reshape(hidden_states.shape)


def dropless_routing(experts: torch.Tensor, weights: torch.Tensor, num_experts: int, group) -> Routing:
    """A :class:`Routing` keeping every route: ``experts`` [k, S] int64, ``weights`` [k, S] (differentiable);
    slots numbered per expert in route order (k-major); capacity the largest route count of any expert on any
    rank of ``group`` (None: this rank alone), at least 1. ``l_aux`` is 0 (the model computes its own)."""
    flat = experts.reshape(-1)
    one_hot = F.one_hot(flat, num_experts)
    slots = ((one_hot.cumsum(0) - 1) * one_hot).sum(-1).view_as(experts)
    counts = one_hot.sum(0)
    capacity = counts.max().reshape(1) if flat.numel() else torch.zeros(1, dtype=torch.int64)
    if group is not None and group.size() > 1:
        dist.all_reduce(capacity, op=dist.ReduceOp.MAX, group=group)
    return Routing(weights.new_zeros(()), max(int(capacity.item()), 1), experts, slots, weights, counts)


def expert_parallel_blocks(model: torch.nn.Module) -> list[ExpertParallelBlock]:
    """The AutoEP blocks of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, ExpertParallelBlock)]


def replace_moe_blocks(model: torch.nn.Module, specs: list[BlockSpec], ep_size: int, ep_rank: int,
                       tp_group=None) -> dict[torch.nn.Parameter, torch.nn.Parameter]:  # fmt: skip
    """Replace each block of ``specs`` in ``model`` by an :class:`ExpertParallelBlock` holding expert-parallel rank
    ``ep_rank``'s experts (folded over ``tp_group`` when given); returns each replaced expert parameter -> the local
    one replacing it (to remap an optimizer built before). The expert tensors must hold the same values on every
    rank.

    Raises:
        ValueError: ``ep_size`` not dividing a block's expert count (checked for every block before any change).
    """
    for spec in specs:
        if spec.num_experts % ep_size:
            raise ValueError(f"expert_parallel.autoep_size={ep_size} does not divide num_experts="
                             f"{spec.num_experts} of MoE block {spec.name!r}: each rank holds num_experts / "
                             "autoep_size experts")  # fmt: skip
    replaced = {}
    for spec in specs:
        parent_name, _, child = spec.name.rpartition(".")
        block = ExpertParallelBlock(spec, ep_size, ep_rank, tp_group)
        replaced[spec.experts.gate_up_proj] = block.experts.gate_up_proj
        replaced[spec.experts.down_proj] = block.experts.down_proj
        setattr(model.get_submodule(parent_name), child, block)
    return replaced
