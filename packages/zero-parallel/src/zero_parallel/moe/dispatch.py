"""Dispatch and combine: tokens into per-expert buffers [E, capacity, M] and back, and the exchange of those
buffers over the expert-parallel group (zero_comm's all-to-all-v, equal splits).

Every rank of an expert-parallel group of size P holds E / P experts (L local). After :func:`dispatch` a rank's
buffer is expert-major [E, C, M]; rows of experts ``j*L .. (j+1)*L`` go to group rank j, so after
:func:`exchange` a rank holds [P, L, C, M]: from each source rank, the slots of its own L experts. The reverse
exchange sends the experts' outputs back in the same layout. Each exchange is its own adjoint (a block transpose
across ranks), so the backward runs the same exchange on the gradient. All ranks of the group must pass buffers
of one shape (the same token count, so one capacity), as DeepSpeed's MoE requires.
"""

from __future__ import annotations

import torch

from zero_comm.all_to_all_uneven import all_to_all_v
from zero_parallel.moe.gating import Routing


def _flat_slots(routing: Routing, num_experts: int) -> torch.Tensor:
    """[k, S] flat row of each route in the [E * C + 1, M] buffer; dropped routes point at the spare last row."""
    spare = torch.full_like(routing.slots, num_experts * routing.capacity)
    return torch.where(routing.experts >= 0, routing.experts * routing.capacity + routing.slots, spare)


def dispatch(tokens: torch.Tensor, routing: Routing, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Place ``tokens`` [S, M] into their experts' slots: returns the buffer [E, C, M] (zeros in empty slots;
    differentiable in ``tokens``) and the flat slot index [k, S] that :func:`combine` reads back."""
    rows = _flat_slots(routing, num_experts)
    k, (s, m) = rows.shape[0], tokens.shape
    buffer = tokens.new_zeros(num_experts * routing.capacity + 1, m)
    buffer = buffer.index_add(0, rows.reshape(-1), tokens.unsqueeze(0).expand(k, s, m).reshape(k * s, m))
    return buffer[:-1].view(num_experts, routing.capacity, m), rows


def combine(expert_output: torch.Tensor, rows: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Each token's weighted sum of its routes' expert outputs: [E, C, M] -> [S, M] (dropped routes add 0)."""
    m = expert_output.shape[-1]
    padded = torch.cat([expert_output.reshape(-1, m), expert_output.new_zeros(1, m)])
    routed = padded.index_select(0, rows.reshape(-1)).view(*rows.shape, m)
    # fp32 weights times the outputs (promoted, as DeepSpeed computes it), back to the outputs' dtype
    return (routed * routing.weights.unsqueeze(-1)).sum(dim=0).to(expert_output.dtype)


class _Exchange(torch.autograd.Function):
    """Equal-split all-to-all of dim 0 over ``group``; backward: the same exchange of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    world = group.size()
    rows = x.reshape(x.shape[0], -1).contiguous()
    out = torch.empty_like(rows)
    splits = [rows.shape[0] // world] * world
    all_to_all_v(out, rows, splits, splits, group)
    return out.view(x.shape)


def exchange(buffer: torch.Tensor, group) -> torch.Tensor:
    """Send block j of dim 0 of ``buffer`` to rank j of ``group`` and receive block i from rank i, same shape out
    (differentiable). ``buffer`` [E, C, M] with E divisible by the group's size; a group of one returns it.

    Raises:
        ValueError: dim 0 not divisible by the group's size.
        zero_comm.CollectiveError / CollectiveTimeout: a peer passed another shape, or did not arrive (names
            this rank and the group's ranks).
    """
    if group is None or group.size() == 1:
        return buffer
    if buffer.shape[0] % group.size():
        raise ValueError(f"MoE exchange: {buffer.shape[0]} experts do not split over {group.size()} ranks")
    return _Exchange.apply(buffer, group)
