"""Top-k gating with DeepSpeed's capacity and drop rules: which expert each token goes to, at which slot of that
expert's buffer, with which weight.

A gate turns ``logits`` [S tokens, E experts] (fp32) into a :class:`Routing`: per route (``k`` routes per token) the
expert, the slot in ``[0, capacity)`` and the combine weight; a route dropped by the capacity limit has expert -1
and weight 0. The rules mirror DeepSpeed 0.19.8's ``top1gating`` / ``top2gating`` / ``topkgating``
(``deepspeed.moe.sharded_moe``):

- capacity (``drop_tokens=True``): ``max(ceil(S / E * capacity_factor * k), min_capacity)`` slots per expert
  (top-1: ``capacity_factor``; top-2: twice it; top-k: k times it). ``drop_tokens=False``: the largest number of
  routes any expert received, maxed over the expert-parallel group (one all-reduce), so nothing is dropped.
- top-1: the argmax of the softmax (of the logits plus Gumbel noise under ``noisy_gate_policy="RSample"``); a
  ``used_token`` mask removes tokens; over capacity, each expert keeps the tokens of highest priority (a uniform
  draw per token under ``use_rts``, Random Token Selection; else the mask itself); the weight is the softmax
  probability; ``l_aux = E * sum_e(mean_s gates[s, e] * fraction of tokens whose first choice is e)``.
- top-2: first choice the argmax of the softmax, second the argmax of the other logits (plus Gumbel noise when
  ``top2_2nd_expert_sampling``); second choices take the slots after every first choice of the expert; over
  capacity, routes beyond the last slot are dropped; the two kept probabilities are normalised to sum 1;
  ``l_aux = E * E * mean_e(mean_s gates * first-choice fraction)``.
- top-k (k > 2): the k largest probabilities; over capacity each expert keeps its routes of largest probability;
  the kept probabilities normalised; ``l_aux = E * E / k * mean_e(mean_s gates * routed fraction)``.

``exp_counts`` [E] int64 counts the routes each expert was chosen for before the capacity cut (DeepSpeed's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")
"""DeepSpeed's ``noisy_gate_policy`` values ("None" as None)."""


@dataclass(frozen=True)
class Routing:
    """Where a gate sends the tokens.

    Attributes:
        l_aux: scalar fp32 load-balancing loss (differentiable in the gate's weights).
        capacity: slots per expert (int).
        experts: [k, S] int64 expert of each route, -1 where the route was dropped.
        slots: [k, S] int64 slot of each route in its expert's buffer (0 where dropped).
        weights: [k, S] fp32 combine weight of each route (0 where dropped; differentiable).
        exp_counts: [E] int64 routes per expert before the capacity cut.
    """

    l_aux: torch.Tensor
    capacity: int
    experts: torch.Tensor
    slots: torch.Tensor
    weights: torch.Tensor
    exp_counts: torch.Tensor


def check_capacity(capacity_factor: float, eval_capacity_factor: float, min_capacity: int, drop_tokens: bool) -> None:
    """Reject capacity settings that are negative or would drop every token (capacity 0 with ``drop_tokens``).

    Raises:
        ValueError: naming the setting and what was expected. Arguments are the layer's, equal on every rank,
            so every rank raises.
    """
    if min_capacity < 0 or int(min_capacity) != min_capacity:
        raise ValueError(f"MoE min_capacity must be a non-negative integer, got {min_capacity!r}")
    for name, value in (("capacity_factor", capacity_factor), ("eval_capacity_factor", eval_capacity_factor)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"MoE {name} must be a finite number >= 0, got {value!r}")
        if drop_tokens and value == 0 and min_capacity == 0:
            raise ValueError(f"MoE {name}=0 with min_capacity=0 and drop_tokens=True gives every expert 0 slots: "
                             "every token would be dropped; raise the factor or min_capacity, or set "
                             "drop_tokens=False")  # fmt: skip


def _capacity(num_tokens: int, num_experts: int, factor: float, min_capacity: int) -> int:
    return max(math.ceil(num_tokens / num_experts * factor), int(min_capacity))


def _dropless_capacity(exp_counts: torch.Tensor, ep_group) -> int:
    """The largest expert load, maxed over the expert-parallel group so every rank's buffers have one size."""
    most = exp_counts.max().reshape(1).clone()
    if ep_group is not None and dist.get_world_size(ep_group) > 1:
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=ep_group)
    return int(most.item())


def _gumbel(shape, like: torch.Tensor) -> torch.Tensor:
    u = torch.rand(shape, dtype=like.dtype, device=like.device).clamp_(min=torch.finfo(like.dtype).tiny)
    return -torch.log(-torch.log(u).clamp_(min=torch.finfo(like.dtype).tiny))


def _slots_of(mask: torch.Tensor) -> torch.Tensor:
    """[S, E] 0/1 -> [S, E] running count minus one: the slot each routed token takes in its expert's buffer."""
    return torch.cumsum(mask, dim=0) - 1


def _keep_by_priority(mask: torch.Tensor, priority: torch.Tensor, capacity: int) -> torch.Tensor:
    """Per expert (column), keep the ``capacity`` routed tokens of highest ``priority``; [S, E] 0/1 int64."""
    take = min(capacity, mask.shape[0])
    if take == 0:
        return torch.zeros_like(mask)
    chosen = torch.topk(priority, k=take, dim=0).indices
    return mask * torch.zeros_like(mask).scatter_(0, chosen, 1)


def top1_routing(logits, capacity_factor, min_capacity, used_token=None, noisy_gate_policy=None, drop_tokens=True,
                 use_rts=True, ep_group=None) -> Routing:  # fmt: skip
    """Top-1 routing of ``logits`` [S, E] fp32 (see the module docstring for the rules).

    Raises:
        ValueError: fewer tokens than ``min_capacity`` with ``drop_tokens`` (DeepSpeed asserts the same).
    """
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    scores = logits + _gumbel(logits.shape, logits) if noisy_gate_policy == "RSample" else gates
    first = torch.argmax(scores, dim=1)
    mask = F.one_hot(first, num_classes=num_experts)
    if used_token is not None:
        mask = mask * used_token.reshape(-1, 1).to(mask.dtype)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = torch.sum(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts
    if drop_tokens:
        if num_tokens < min_capacity:
            raise ValueError(f"MoE gate got {num_tokens} tokens, fewer than min_capacity={min_capacity}; set "
                             "min_capacity to 0 or pass more tokens")  # fmt: skip
        capacity = _capacity(num_tokens, num_experts, capacity_factor, min_capacity)
    else:
        capacity = min(_dropless_capacity(exp_counts, ep_group), num_tokens)
    priority = mask * torch.rand(mask.shape, device=mask.device) if use_rts else mask
    mask = _keep_by_priority(mask, priority, capacity)
    slots = (_slots_of(mask) * mask).sum(dim=1)
    kept = mask.sum(dim=1) > 0
    weights = (gates * mask).sum(dim=1)
    experts = torch.where(kept, first, torch.full_like(first, -1))
    return Routing(l_aux, capacity, experts.unsqueeze(0), slots.unsqueeze(0), weights.unsqueeze(0), exp_counts)


def top2_routing(logits, capacity_factor, min_capacity, drop_tokens=True, ep_group=None,
                 top2_2nd_expert_sampling=True) -> Routing:  # fmt: skip
    """Top-2 routing of ``logits`` [S, E] fp32 (see the module docstring for the rules)."""
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    first = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(first, num_classes=num_experts)
    second_scores = logits.detach()
    if top2_2nd_expert_sampling:
        second_scores = second_scores + _gumbel(logits.shape, logits)
    second = torch.argmax(second_scores.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(second, num_classes=num_experts)
    slots1 = _slots_of(mask1)
    slots2 = _slots_of(mask2) + mask1.sum(dim=0, keepdim=True)  # second choices queue after every first choice
    l_aux = torch.mean(gates.mean(dim=0) * mask1.float().mean(dim=0)) * num_experts * num_experts
    exp_counts = (mask1 + mask2).sum(dim=0).detach()
    if drop_tokens:
        capacity = _capacity(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * (slots1 < capacity)
        mask2 = mask2 * (slots2 < capacity)
    else:
        capacity = _dropless_capacity(exp_counts, ep_group)
    g1 = (gates * mask1).sum(dim=1)
    g2 = (gates * mask2).sum(dim=1)
    denom = torch.clamp(g1 + g2, min=torch.finfo(gates.dtype).eps)
    weights = torch.stack([g1 / denom, g2 / denom])
    slots = torch.stack([(slots1 * mask1).sum(dim=1), (slots2 * mask2).sum(dim=1)])
    kept = torch.stack([mask1.sum(dim=1) > 0, mask2.sum(dim=1) > 0])
    chosen = torch.stack([first, second])
    experts = torch.where(kept, chosen, torch.full_like(chosen, -1))
    return Routing(l_aux, capacity, experts, slots, weights, exp_counts)


def topk_routing(logits, k, capacity_factor, min_capacity, drop_tokens=True, ep_group=None) -> Routing:
    """Top-k routing (k > 2) of ``logits`` [S, E] fp32, DeepSpeed's "probs" drop policy (see the module
    docstring)."""
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    top_gates, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.int64).scatter_(1, top_idx, 1)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = torch.mean(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts * num_experts / k
    if drop_tokens:
        capacity = _capacity(num_tokens, num_experts, capacity_factor * k, min_capacity)
        priority = torch.zeros_like(gates).scatter(1, top_idx, top_gates).detach()
        mask = _keep_by_priority(mask, priority, capacity)
    else:
        capacity = _dropless_capacity(exp_counts, ep_group)
    slots_all = _slots_of(mask)
    masked = gates * mask
    masked = masked / torch.clamp(masked.sum(dim=-1, keepdim=True), min=torch.finfo(gates.dtype).eps)
    kept = mask.gather(1, top_idx) > 0
    experts = torch.where(kept, top_idx, torch.full_like(top_idx, -1)).t()
    slots = (slots_all.gather(1, top_idx) * kept).t()
    weights = masked.gather(1, top_idx).t()
    return Routing(l_aux, capacity, experts.contiguous(), slots.contiguous(), weights.contiguous(), exp_counts)
