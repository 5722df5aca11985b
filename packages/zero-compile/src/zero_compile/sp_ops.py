"""Ulysses' two all-to-alls as graph operations (``torch.library``, namespace ``zero_compile``) for the autosp pass.

Both take tensors in ``scaled_dot_product_attention``'s layout ``[batch, heads, seq, head_dim]``:

* ``sequence_to_heads(x, group, world) -> Tensor``: this rank's sequence shard of every head ``[b, h, s/sp, d]``
  -> the whole sequence of this rank's share of the heads ``[b, h/sp, s, d]`` (before attention).
* ``heads_to_sequence(x, group, world) -> Tensor``: ``[b, h/sp, s, d]`` -> ``[b, h, s/sp, d]`` (after attention).

Rank ``i`` of the group holds sequence positions ``[i*s/sp, (i+1)*s/sp)`` and heads ``[i*h/sp, (i+1)*h/sp)``, as
zero_parallel's eager Ulysses exchange. Each op is one equal-split ``zero_comm.all_to_all_single``; the backward of
each is the other applied to the gradient (the exchange is a block transpose across ranks, its own adjoint).
``group`` is the id :func:`register_sp_group` gave the sequence-parallel process group (a graph can carry an int,
not a process group); ``world`` is its size, an argument so that the fake kernels read only their arguments (as the
ZeRO ops of ``zero_compile.ops``) and a graph traced at one size never runs at another unnoticed. Any dtype; the
sequence shard may have any length (equal on every rank of the group). Mirrors DeepSpeed 0.19.8's
``autosp::all_to_all`` (``deepspeed/compile/custom_ops/all_to_all.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zero_comm import all_to_all_single

_LIB = "zero_compile"
_GROUPS: dict[int, object] = {}  # id -> process group; ids are stable for the life of the process


def register_sp_group(group) -> int:
    """The id the graph operations use for ``group`` (a ``torch.distributed`` process group, or None for the
    default group): the sequence-parallel group here, the tensor-parallel one for ``zero_compile.tp_ops``;
    registering the same group again returns its id."""
    group = dist.group.WORLD if group is None else group
    for gid, known in _GROUPS.items():
        if known is group:
            return gid
    gid = len(_GROUPS)
    _GROUPS[gid] = group
    return gid


def registered_group(gid: int, world: int):
    """The process group of id ``gid`` (:func:`register_sp_group`).

    Raises KeyError for an unregistered id; ValueError when the group does not have ``world`` ranks (a graph
    traced at one size run at another)."""
    if gid not in _GROUPS:
        raise KeyError(f"zero_compile: process group id {gid} was never registered (register_sp_group)")
    group = _GROUPS[gid]
    size = dist.get_world_size(group)
    if size != world:
        raise ValueError(f"zero_compile: the graph was traced for a group of {world} ranks, but group {gid} has "
                         f"{size}")  # fmt: skip
    return group


def _check(name: str, x: torch.Tensor, dim: int, world: int, what: str) -> None:
    if x.dim() != 4:
        raise ValueError(f"zero_compile.{name}: x must be 4-D [batch, heads, seq, head_dim], got {tuple(x.shape)}")
    if world <= 0 or x.shape[dim] % world:
        raise ValueError(f"zero_compile.{name}: x has {x.shape[dim]} {what} (shape {tuple(x.shape)}), not "
                         f"divisible by the sequence-parallel size {world}")  # fmt: skip


def _exchange(send: torch.Tensor, group) -> torch.Tensor:
    """Chunk ``j`` of dim 0 to rank ``j``; chunk ``i`` of the result came from rank ``i``."""
    send = send.contiguous()
    out = torch.empty_like(send)
    all_to_all_single(out, send, group)
    return out


@torch.library.custom_op(f"{_LIB}::sequence_to_heads", mutates_args=())
def sequence_to_heads(x: torch.Tensor, group: int, world: int) -> torch.Tensor:
    """``[b, h, s/sp, d]`` -> ``[b, h/sp, s, d]`` over the group (see the module docstring).

    Raises ValueError when ``x`` is not 4-D or ``h`` is not divisible by ``world``, or the group's size is not
    ``world``; KeyError for an unregistered ``group``."""
    _check("sequence_to_heads", x, 1, world, "heads")
    pg = registered_group(group, world)
    b, h, s_local, d = x.shape
    # chunk j of dim 0: the heads rank j will hold, of my sequence shard
    recv = _exchange(x.reshape(b, world, h // world, s_local, d).transpose(0, 1), pg)
    # recv chunk i: rank i's sequence shard of my heads -> the sequence in rank order
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // world, world * s_local, d)


@sequence_to_heads.register_fake
def _(x: torch.Tensor, group: int, world: int) -> torch.Tensor:
    _check("sequence_to_heads", x, 1, world, "heads")
    b, h, s_local, d = x.shape
    return x.new_empty((b, h // world, s_local * world, d))


@torch.library.custom_op(f"{_LIB}::heads_to_sequence", mutates_args=())
def heads_to_sequence(x: torch.Tensor, group: int, world: int) -> torch.Tensor:
    """``[b, h/sp, s, d]`` -> ``[b, h, s/sp, d]``: the inverse of :func:`sequence_to_heads`.

    Raises ValueError when ``x`` is not 4-D or ``s`` is not divisible by ``world``, or the group's size is not
    ``world``; KeyError for an unregistered ``group``."""
    _check("heads_to_sequence", x, 2, world, "sequence positions")
    pg = registered_group(group, world)
    b, h_local, s, d = x.shape
    # chunk j of dim 0: rank j's sequence shard, of my heads
    recv = _exchange(x.reshape(b, h_local, world, s // world, d).permute(2, 0, 1, 3, 4), pg)
    # recv chunk i: rank i's heads of my sequence shard -> the heads in rank order
    return recv.transpose(0, 1).reshape(b, world * h_local, s // world, d)


@heads_to_sequence.register_fake
def _(x: torch.Tensor, group: int, world: int) -> torch.Tensor:
    _check("heads_to_sequence", x, 2, world, "sequence positions")
    b, h_local, s, d = x.shape
    return x.new_empty((b, h_local * world, s // world, d))


def _setup(ctx, inputs, output) -> None:
    _x, ctx.group, ctx.world = inputs


def _sequence_to_heads_backward(ctx, grad: torch.Tensor):
    return heads_to_sequence(grad, ctx.group, ctx.world), None, None


def _heads_to_sequence_backward(ctx, grad: torch.Tensor):
    return sequence_to_heads(grad, ctx.group, ctx.world), None, None


sequence_to_heads.register_autograd(_sequence_to_heads_backward, setup_context=_setup)
heads_to_sequence.register_autograd(_heads_to_sequence_backward, setup_context=_setup)

SEQUENCE_TO_HEADS = torch.ops.zero_compile.sequence_to_heads.default
HEADS_TO_SEQUENCE = torch.ops.zero_compile.heads_to_sequence.default
