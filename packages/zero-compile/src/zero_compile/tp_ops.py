"""AutoTP's tensor-parallel collectives as graph operations (``torch.library``, namespace ``zero_compile``) for the
autotp pass (Megatron's f / g operators, arXiv 1909.08053).

* ``tp_copy(x, group, world) -> Tensor``: identity in forward, the gradient summed over the group in backward.
  Before a column-parallel ``linear``: its input is the same on every rank, and each rank's output features give
  part of the input's gradient.
* ``tp_reduce(x, group, world) -> Tensor``: sum over the group in forward, identity in backward. After a
  row-parallel ``linear`` (before its bias): each rank's product over its input features is a partial sum.
* ``tp_gather(x, group, widths) -> Tensor``: ``[..., widths[rank]]`` -> ``[..., sum(widths)]`` in rank order in
  forward (uneven widths allowed); this rank's slice of the gradient in backward. After a column-parallel
  ``linear`` whose output every rank needs whole (``gather_output``).

``x`` has any shape and floating dtype; the output has its shape (``tp_gather``: the last dim widened). ``group``
is the id :func:`zero_compile.sp_ops.register_sp_group` gave the tensor-parallel process group; ``world`` (or
``len(widths)``) is its size, an argument so that the fake kernels read only their arguments and a graph traced at
one size never runs at another unnoticed. Each collective is one ``zero_comm`` call. Mirror zero_parallel's eager
``tp_comm`` and DeepSpeed 0.19.8's ``autotp::copy_to_tp_region`` / ``reduce_from_tp_region`` /
``gather_from_tp_region`` (``deepspeed/compile/custom_ops/tp_collectives.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zero_comm import all_gather_into_tensor, all_reduce
from zero_compile.sp_ops import registered_group

_LIB = "zero_compile"


def _summed(x: torch.Tensor, group: int, world: int) -> torch.Tensor:
    out = x.contiguous().clone()
    all_reduce(out, registered_group(group, world), op="sum")
    return out


@torch.library.custom_op(f"{_LIB}::tp_copy", mutates_args=())
def tp_copy(x: torch.Tensor, group: int, world: int) -> torch.Tensor:
    """A copy of ``x`` (forward); its backward sums the gradient over the group. Raises KeyError / ValueError for
    an unregistered group or one whose size is not ``world`` (checked in backward, where it communicates)."""
    return x.clone()


@tp_copy.register_fake
def _(x: torch.Tensor, group: int, world: int) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op(f"{_LIB}::tp_reduce", mutates_args=())
def tp_reduce(x: torch.Tensor, group: int, world: int) -> torch.Tensor:
    """``x`` summed over the group (every rank gets the sum). Raises KeyError for an unregistered group, ValueError
    when its size is not ``world``."""
    return _summed(x, group, world)


@tp_reduce.register_fake
def _(x: torch.Tensor, group: int, world: int) -> torch.Tensor:
    return torch.empty_like(x)


def _check_gather(x: torch.Tensor, group: int, widths: list[int]) -> int:
    """This rank's index in the group, after checking ``x``'s last dim against its width."""
    rank = dist.get_rank(registered_group(group, len(widths)))
    if x.dim() == 0 or x.shape[-1] != widths[rank]:
        raise ValueError(f"zero_compile.tp_gather: x has shape {tuple(x.shape)}; rank {rank} of widths {widths} "
                         f"needs a last dim of {widths[rank]}")  # fmt: skip
    return rank


@torch.library.custom_op(f"{_LIB}::tp_gather", mutates_args=())
def tp_gather(x: torch.Tensor, group: int, widths: list[int]) -> torch.Tensor:
    """Every rank's ``x`` concatenated along the last dim in rank order (see the module docstring).

    Raises ValueError when ``x``'s last dim is not ``widths[rank]`` or the group has not ``len(widths)`` ranks;
    KeyError for an unregistered group."""
    _check_gather(x, group, widths)
    widest = max(widths)
    local = torch.nn.functional.pad(x, (0, widest - x.shape[-1])).contiguous()  # one collective: pad to the widest
    out = torch.empty(len(widths) * local.numel(), dtype=x.dtype, device=x.device)
    all_gather_into_tensor(out, local.reshape(-1), registered_group(group, len(widths)))
    out = out.view(len(widths), *local.shape)
    return torch.cat([out[r, ..., : widths[r]] for r in range(len(widths))], dim=-1)


@tp_gather.register_fake
def _(x: torch.Tensor, group: int, widths: list[int]) -> torch.Tensor:
    if x.dim() == 0:
        raise ValueError("zero_compile.tp_gather: x must have at least one dim")
    return x.new_empty((*x.shape[:-1], sum(widths)))


def _setup(ctx, inputs, output) -> None:
    _x, ctx.group, ctx.world = inputs


def _copy_backward(ctx, grad: torch.Tensor):
    return tp_reduce(grad, ctx.group, ctx.world), None, None


def _reduce_backward(ctx, grad: torch.Tensor):
    return grad, None, None


def _gather_setup(ctx, inputs, output) -> None:
    _x, group, widths = inputs
    rank = dist.get_rank(registered_group(group, len(widths)))
    ctx.start, ctx.width = sum(widths[:rank]), widths[rank]


def _gather_backward(ctx, grad: torch.Tensor):
    return grad.narrow(-1, ctx.start, ctx.width).contiguous(), None, None


tp_copy.register_autograd(_copy_backward, setup_context=_setup)
tp_reduce.register_autograd(_reduce_backward, setup_context=_setup)
tp_gather.register_autograd(_gather_backward, setup_context=_gather_setup)

TP_COPY = torch.ops.zero_compile.tp_copy.default
TP_REDUCE = torch.ops.zero_compile.tp_reduce.default
TP_GATHER = torch.ops.zero_compile.tp_gather.default
