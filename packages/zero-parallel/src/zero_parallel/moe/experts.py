"""``Experts``: this rank's local experts (DeepSpeed's ``deepspeed.moe.experts.Experts``), each a deep copy of
the expert module given, in ``deepspeed_experts``; their parameters are marked as expert parameters."""

from __future__ import annotations

import copy

import torch


def mark_expert_params(module: torch.nn.Module, group_name: str) -> None:
    """Mark ``module``'s parameters as expert parameters of the groups ``group_name`` the way DeepSpeed does
    (``param.allreduce = False``, ``param.group_name``): what ``is_moe_param`` and the optimizer-group split read,
    and what Megatron-DeepSpeed tests on parameters."""
    for param in module.parameters():
        param.allreduce = False
        param.group_name = group_name


class Experts(torch.nn.Module):
    """``num_local_experts`` copies of ``expert`` in ``deepspeed_experts``.

    ``forward(inputs)``: ``inputs`` [P, num_local_experts, C, M]: local expert i gets ``inputs[:, i:i+1]``
    [P, 1, C, M] (DeepSpeed passes the 4-D chunk); a tuple output's first element is used (Megatron's
    ``(out, bias)``); the outputs are concatenated back on dim 1.
    """

    def __init__(self, expert: torch.nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None):
        super().__init__()
        self.deepspeed_experts = torch.nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        mark_expert_params(self, expert_group_name)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        outputs = []
        for chunk, expert in zip(inputs.chunk(self.num_local_experts, dim=1), self.deepspeed_experts):
            out = expert(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outputs, dim=1)
