"""AutoEP folded with AutoTP: the tokens of an MoE block, replicated over a tensor-parallel group, split among its
ranks for the expert path and gathered back (DeepSpeed 0.19.8's AutoEP + AutoTP "folding",
``deepspeed.module_inject.auto_ep_folding``; zero's split and adjoints are its own).

Under AutoTP the MoE block's input [S, hidden] is the same on every rank of a tensor-parallel group of T ranks, and
the gradient arriving at its output is the same too (the column-parallel layers downstream all-reduce their input
gradient). Tensor-parallel rank t routes rows ``lo_t .. hi_t`` (contiguous; :func:`row_bounds`, the first ranks one
row more when T does not divide S) through the expert-parallel exchange, and the T slices of the output are
all-gathered back into [S, hidden]. The adjoints make every gradient that leaves the block whole again:

- :func:`take_rows` (forward: this rank's rows; backward: the rows' gradients all-gathered from every rank), so the
  input's gradient and the router's weights' gradient are whole and equal on every tensor-parallel rank, and the
  router (computed on all S tokens) trains as any replicated parameter;
- :func:`gather_rows` (forward: all-gather; backward: this rank's rows of the gradient, no reduction, the gradient
  being the same on every rank).

Each routed token reaches the experts from one tensor-parallel rank only, so an expert's gradient holds each token
once; the engine scales it for the expert-data-parallel average (``zero.engine.expert_parallel``).
"""

from __future__ import annotations

import torch

from zero_comm import all_gather_into_tensor


def row_bounds(rows: int, size: int, rank: int) -> tuple[int, int]:
    """``(lo, hi)``: the rows of ``rows`` that tensor-parallel rank ``rank`` of ``size`` takes (contiguous; the first
    ``rows % size`` ranks one more); an empty range when ``rows < size`` leaves this rank none."""
    base, extra = divmod(rows, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def _all_gather_rows(part: torch.Tensor, rows: int, group) -> torch.Tensor:
    """Every rank's ``part`` [n_r, ...] (its :func:`row_bounds` rows) stacked into [rows, ...] in rank order."""
    size = group.size()
    widest = -(-rows // size)
    tail = part.shape[1:]
    send = part.new_zeros((widest, *tail))
    send[: part.shape[0]] = part
    buf = part.new_empty((size * widest, *tail))
    all_gather_into_tensor(buf, send.contiguous(), group)
    pieces = [buf[r * widest : r * widest + (row_bounds(rows, size, r)[1] - row_bounds(rows, size, r)[0])]
              for r in range(size)]  # fmt: skip
    return torch.cat(pieces)


class _TakeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group, ctx.rows = group, x.shape[0]
        lo, hi = row_bounds(x.shape[0], group.size(), group.rank())
        return x[lo:hi].clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather_rows(grad.contiguous(), ctx.rows, ctx.group), None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, part: torch.Tensor, rows: int, group) -> torch.Tensor:
        ctx.bounds = row_bounds(rows, group.size(), group.rank())
        return _all_gather_rows(part.contiguous(), rows, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        lo, hi = ctx.bounds
        return grad[lo:hi].clone(), None, None


def take_rows(x: torch.Tensor, group) -> torch.Tensor:
    """This tensor-parallel rank's rows of ``x`` [S, ...] (equal on every rank of ``group``); the gradient of the
    result comes back whole (all-gathered over ``group``). Collective in backward."""
    return _TakeRows.apply(x, group)


def gather_rows(part: torch.Tensor, rows: int, group) -> torch.Tensor:
    """[rows, ...]: every rank's ``part`` (its :func:`row_bounds` rows of ``rows``) in rank order; the gradient of
    ``part`` is this rank's rows of the result's gradient (equal on every rank of ``group``). Collective."""
    return _GatherRows.apply(part, rows, group)
