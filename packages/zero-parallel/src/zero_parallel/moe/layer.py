"""``MoE``: DeepSpeed's mixture-of-experts layer (``deepspeed.moe.layer.MoE``) with expert parallelism.

Layout as in DeepSpeed 0.19.8, so state dicts and Megatron-DeepSpeed's code paths match:
``deepspeed_moe.gate.wg`` (router, [E, hidden]), ``deepspeed_moe.experts.deepspeed_experts[i]`` (the
``E / ep_size`` local experts; global expert ``ep_rank * E / ep_size + i``), and under ``use_residual``
(PR-MoE) ``mlp`` (the expert module given) and ``coefficient`` (Linear [2, hidden]).

``forward(hidden_states [..., hidden], used_token=None)`` returns ``(output [..., hidden], l_aux, exp_counts)``:
tokens routed (:mod:`.gating`), dispatched to per-expert buffers, exchanged over the expert-parallel group,
run through the local experts, exchanged back and combined (:mod:`.dispatch`). ``l_aux`` and ``exp_counts`` are
this rank's (over its own tokens), as in DeepSpeed. Every rank of an expert-parallel group calls forward together,
each with the same number of tokens (the capacity follows it), as DeepSpeed requires. An expert that receives no
token on a step gets empty slots (zeros) and a zero gradient; no rank waits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zero_parallel.moe.dispatch import combine, dispatch, exchange
from zero_parallel.moe.experts import Experts
from zero_parallel.moe.gate import TopKGate
from zero_parallel.moe.groups import EXPERT_GROUPS, group_name


class MOELayer(torch.nn.Module):
    """Gate, dispatch, experts, combine (DeepSpeed's ``MOELayer``). ``l_aux`` and ``exp_counts`` hold the last
    forward's values."""

    def __init__(self, gate: TopKGate, experts: Experts, ep_group_name: str, ep_size: int, num_local_experts: int):
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group = None  # the expert-parallel group, set by _set_ep_group
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self.l_aux: torch.Tensor | None = None  # the last forward's load-balancing loss
        self.exp_counts: torch.Tensor | None = None  # the last forward's routes per expert [E]

    def _set_ep_group(self, ep_group) -> None:
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None) -> torch.Tensor:
        if self.ep_size > 1 and self.ep_group is None:
            raise RuntimeError(f"MoE layer with ep_size={self.ep_size} has no expert-parallel group: call "
                               "set_deepspeed_parallelism() on it, or pass its model to initialize()")  # fmt: skip
        m = hidden_states.shape[-1]
        tokens = hidden_states.reshape(-1, m)
        routing = self.gate(tokens, used_token)
        self.l_aux, self.exp_counts = routing.l_aux, routing.exp_counts
        num_experts = self.ep_size * self.num_local_experts
        buffer, rows = dispatch(tokens, routing, num_experts)  # [E, C, M]
        received = exchange(buffer, self.ep_group)  # [E, C, M]: from each source rank, its slots of our experts
        local = received.reshape(self.ep_size, self.num_local_experts, -1, m)
        out = self.experts(local).reshape(num_experts, -1, m)
        returned = exchange(out, self.ep_group)  # back to the ranks the tokens came from
        return combine(returned, rows, routing).reshape(hidden_states.shape)


class MoE(torch.nn.Module):
    """DeepSpeed's MoE layer.

    Args (DeepSpeed's, same defaults): ``hidden_size``; ``expert`` (the module each expert copies);
    ``num_experts`` (1); ``ep_size`` (1: every rank holds every expert); ``k`` (1); ``capacity_factor`` (1.0);
    ``eval_capacity_factor`` (1.0); ``min_capacity`` (4); ``use_residual`` (False); ``noisy_gate_policy``
    (None, "None", "Jitter", "RSample"); ``drop_tokens`` (True; False: no token dropped); ``use_rts`` (True);
    ``use_tutel`` (accepted, the dispatch is the same); ``enable_expert_tensor_parallelism`` (must be False);
    ``top2_2nd_expert_sampling`` (True).

    Raises:
        ValueError: ``num_experts`` not divisible by ``ep_size``, a non-positive ``num_experts``/``ep_size``,
            expert tensor parallelism asked for, and the gate's errors (:class:`TopKGate`); the arguments are the
            same on every rank, so every rank raises. ``set_deepspeed_parallelism`` raises ValueError on every
            rank when ``ep_size`` does not divide the world size.
    """

    def __init__(self, hidden_size: int, expert: torch.nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:  # fmt: skip
        super().__init__()
        if num_experts < 1 or ep_size < 1:
            raise ValueError(f"MoE num_experts ({num_experts}) and ep_size ({ep_size}) must be positive")
        if num_experts % ep_size:
            raise ValueError(f"MoE num_experts ({num_experts}) must be divisible by ep_size ({ep_size}): each rank "
                             "of an expert-parallel group holds num_experts / ep_size experts")  # fmt: skip
        if enable_expert_tensor_parallelism:
            raise ValueError("MoE enable_expert_tensor_parallelism=True is not supported (experts are whole on "
                             "each rank); leave it False")  # fmt: skip
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = group_name(ep_size)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling)  # fmt: skip
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size, self.num_local_experts)
        if use_residual:
            self.mlp = expert  # the dense branch (PR-MoE), the module given itself
            self.coefficient = torch.nn.Linear(hidden_size, 2)  # mixes the expert and dense outputs

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Create this layer's expert groups (unless they exist) and hand the expert-parallel one to the layer.
        Collective: every rank calls it (initialize() does, for every MoE layer of the model)."""
        EXPERT_GROUPS.create(self.ep_size, use_data_before_expert_parallel_)
        self.deepspeed_moe._set_ep_group(EXPERT_GROUPS.expert_parallel_group(self.expert_group_name))

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None):
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            dense = dense[0] if isinstance(dense, tuple) else dense
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
