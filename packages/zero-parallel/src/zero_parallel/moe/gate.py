"""``TopKGate``: the router module (DeepSpeed's ``deepspeed.moe.sharded_moe.TopKGate``): one bias-free
``wg`` Linear [E, model_dim] scoring each token in fp32, then the routing rules of :mod:`.gating`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zero_parallel.moe.gating import (
    NOISY_GATE_POLICIES,
    Routing,
    check_capacity,
    top1_routing,
    top2_routing,
    topk_routing,
)


class RouterLinear(torch.nn.Linear):
    """The router's bias-free Linear, computed in fp32 whatever the weight's dtype (DeepSpeed's gate casts both).
    The weight is read inside this module's own forward, so ZeRO-3 gathers it there."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.linear(input.float(), self.weight.float())


class TopKGate(torch.nn.Module):
    """Scores tokens with ``wg`` and routes each to its ``k`` best experts within capacity.

    Args mirror DeepSpeed's: ``model_dim``, ``num_experts``, ``k`` (1, 2 or more, at most ``num_experts``),
    ``capacity_factor`` (training), ``eval_capacity_factor`` (eval mode), ``min_capacity``, ``noisy_gate_policy``
    (None, "Jitter": inputs times U(0.99, 1.01) in training, "RSample": Gumbel noise on top-1 logits in training),
    ``drop_tokens``, ``use_rts``, ``ep_group`` (the expert-parallel group; set later by ``_set_ep_group``),
    ``top2_2nd_expert_sampling``.

    Raises:
        ValueError: ``k`` outside ``[1, num_experts]``, an unknown ``noisy_gate_policy``, or capacity settings
            that are negative or drop every token (:func:`~zero_parallel.moe.gating.check_capacity`).
    """

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True, ep_group=None,
                 top2_2nd_expert_sampling: bool = True) -> None:  # fmt: skip
        super().__init__()
        if not 1 <= k <= num_experts:
            raise ValueError(f"MoE k (experts per token) must be between 1 and num_experts={num_experts}, got {k}")
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"MoE noisy_gate_policy must be one of {NOISY_GATE_POLICIES}, got {noisy_gate_policy!r}")
        check_capacity(capacity_factor, eval_capacity_factor, min_capacity, drop_tokens)
        self.wg = RouterLinear(model_dim, num_experts, bias=False)  # the router's weight [E, model_dim]
        self.ep_group = ep_group  # dropless capacity is maxed over it
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling

    def _set_ep_group(self, ep_group) -> None:
        """Set the expert-parallel group once (DeepSpeed's); a second, different group raises ValueError."""
        if self.ep_group is not None and self.ep_group is not ep_group:
            raise ValueError("TopKGate: the expert-parallel group is already set")
        self.ep_group = ep_group

    def forward(self, input: torch.Tensor, used_token: torch.Tensor | None = None) -> Routing:
        """Route ``input`` [S, model_dim] (any float dtype; scored in fp32); ``used_token`` [S] 0/1 masks tokens
        out (top-1 only, as in DeepSpeed)."""
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = x * torch.empty_like(x).uniform_(1.0 - 1e-2, 1.0 + 1e-2)
        logits = self.wg(x)
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            policy = self.noisy_gate_policy if self.training else None
            return top1_routing(logits, factor, self.min_capacity, used_token, policy, self.drop_tokens,
                                self.use_rts, self.ep_group)  # fmt: skip
        if self.k == 2:
            return top2_routing(logits, factor, self.min_capacity, self.drop_tokens, self.ep_group,
                                self.top2_2nd_expert_sampling)  # fmt: skip
        return topk_routing(logits, self.k, factor, self.min_capacity, self.drop_tokens, self.ep_group)
