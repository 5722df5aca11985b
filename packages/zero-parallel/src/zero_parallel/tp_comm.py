"""The tensor-parallel group's collectives as autograd Functions (Megatron's f / g operators, arXiv 1909.08053).

* :func:`column_parallel_linear`: ``x @ W_shard.T + b_shard``; backward all-reduces the input's gradient over the
  group (every rank's partial ``grad_y_shard @ W_shard``), optionally overlapped with the weight gradient.
* :func:`reduce_from_tp`: all-reduce (sum) in forward, identity in backward (after a row-parallel matmul).
* :func:`gather_last_dim`: all-gather of uneven shards along the last dim in forward, this rank's slice of the
  gradient in backward (a column-parallel layer whose output every rank needs whole).

Every collective runs through ``zero_comm`` on the explicit tensor-parallel group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zero_comm import all_gather_into_tensor, all_reduce


class _ColumnParallelLinear(torch.autograd.Function):
    """Forward: the local matmul. Backward: ``grad_x`` summed over the group (each rank holds part of the
    output features, so each contributes part of the input's gradient); with ``overlap`` the all-reduce is in
    flight while the weight gradient is computed (DeepSpeed's ``tp_overlap_comm``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, overlap: bool):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.overlap, ctx.has_bias = group, overlap, bias is not None
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight).contiguous()
        handle = all_reduce(grad_x, ctx.group, op="sum", async_op=ctx.overlap)
        grad2 = grad.reshape(-1, grad.shape[-1])
        grad_w = grad2.t().matmul(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_b = grad2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        handle.wait()
        return grad_x, grad_w, grad_b, None, None


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group,
                           overlap: bool = False) -> torch.Tensor:  # fmt: skip
    """``F.linear(x, weight, bias)`` whose input gradient is summed over ``group`` in backward.

    Args:
        x: ``[..., in_features]``, replicated over ``group`` (every rank holds the same values).
        weight: ``[out_shard, in_features]``, this rank's rows of the full weight.
        bias: ``[out_shard]`` or None.
        group: the tensor-parallel process group.
        overlap: issue the backward all-reduce asynchronously and compute the weight gradient meanwhile.

    Returns:
        ``[..., out_shard]``: this rank's output features.
    """
    return _ColumnParallelLinear.apply(x, weight, bias, group, overlap)


class _ReduceFromTP(torch.autograd.Function):
    """Sum over the group in forward; the gradient of a sum is the same gradient for every addend."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        all_reduce(out, group, op="sum")
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's partial ``x`` summed over ``group`` (a row-parallel layer's output); identity backward."""
    return _ReduceFromTP.apply(x, group)


class _GatherLastDim(torch.autograd.Function):
    """All-gather shards of uneven widths along the last dim (padded to the widest for one collective)."""

    @staticmethod
    def forward(ctx, x, group, sizes: tuple[int, ...]):
        rank = dist.get_rank(group)
        ctx.start, ctx.width = sum(sizes[:rank]), sizes[rank]
        widest = max(sizes)
        local = x if x.shape[-1] == widest else torch.nn.functional.pad(x, (0, widest - x.shape[-1]))
        local = local.contiguous()
        out = torch.empty(len(sizes) * local.numel(), dtype=x.dtype, device=x.device)
        all_gather_into_tensor(out, local.reshape(-1), group)
        out = out.view(len(sizes), *local.shape)
        return torch.cat([out[r, ..., : sizes[r]] for r in range(len(sizes))], dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad[..., ctx.start : ctx.start + ctx.width].contiguous(), None, None


def gather_last_dim(x: torch.Tensor, group, sizes: tuple[int, ...]) -> torch.Tensor:
    """``[..., sizes[rank]]`` on each rank -> ``[..., sum(sizes)]`` on every rank, in rank order; backward keeps
    this rank's slice of the gradient (the loss is computed identically on every rank of ``group``)."""
    return _GatherLastDim.apply(x, group, tuple(sizes))
