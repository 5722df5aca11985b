"""Ulysses' two layout changes over the sequence-parallel group, differentiable.

``sequence_to_heads``: every rank holds all heads of its sequence shard -> every rank holds the whole sequence
for its share of the heads (before attention). ``heads_to_sequence``: the inverse (after attention). Both are one
equal-split ``zero_comm.all_to_all_single``; the backward of each is the other's exchange applied to the gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zero_comm import all_to_all_single


class _DimZeroAllToAll(torch.autograd.Function):
    """Chunk ``j`` of dim 0 goes to rank ``j``; chunk ``i`` of the result came from rank ``i``. The exchange is
    its own adjoint (a block transpose across ranks), so backward runs the same exchange on the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        all_to_all_single(out, x.contiguous(), group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = torch.empty_like(grad, memory_format=torch.contiguous_format)
        all_to_all_single(out, grad.contiguous(), ctx.group)
        return out, None


def _check(name: str, x: torch.Tensor, heads_dim_size: int, world: int, what: str) -> None:
    if x.dim() != 4:
        raise ValueError(f"{name} must be 4-D [batch, seq, heads, head_dim], got shape {tuple(x.shape)}")
    if heads_dim_size % world:
        raise ValueError(f"{name} has {heads_dim_size} {what}, not divisible by the sequence-parallel size {world}")


def sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """Sequence-sharded ``[b, s/sp, h, d]`` -> head-sharded ``[b, s, h/sp, d]`` over ``group`` (size sp).

    Rank ``i`` of the group holds sequence positions ``[i*s/sp, (i+1)*s/sp)`` on input and heads
    ``[i*h/sp, (i+1)*h/sp)`` on output. Every rank must pass the same shape. Differentiable; any dtype.

    Raises:
        ValueError: ``x`` is not 4-D or its head count is not divisible by the group size.
    """
    world = dist.get_world_size(group)
    _check("x", x, x.shape[2], world, "heads")
    b, s_local, h, d = x.shape
    # [b, s_l, sp, h_l, d] -> [sp, b, s_l, h_l, d]: chunk j (the heads of rank j) goes to rank j.
    send = x.reshape(b, s_local, world, h // world, d).permute(2, 0, 1, 3, 4)
    recv = _DimZeroAllToAll.apply(send, group)  # chunk i: rank i's sequence shard of my heads
    return recv.permute(1, 0, 2, 3, 4).reshape(b, world * s_local, h // world, d)


def heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Head-sharded ``[b, s, h/sp, d]`` -> sequence-sharded ``[b, s/sp, h, d]``: the inverse of
    :func:`sequence_to_heads`. Differentiable.

    Raises:
        ValueError: ``x`` is not 4-D or its sequence length is not divisible by the group size.
    """
    world = dist.get_world_size(group)
    _check("x", x, x.shape[1], world, "sequence positions")
    b, s, h_local, d = x.shape
    # [b, sp, s_l, h_l, d] -> [sp, b, s_l, h_l, d]: chunk j (rank j's sequence shard) goes to rank j.
    send = x.reshape(b, world, s // world, h_local, d).permute(1, 0, 2, 3, 4)
    recv = _DimZeroAllToAll.apply(send, group)  # chunk i: rank i's heads of my sequence shard
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s // world, world * h_local, d)
