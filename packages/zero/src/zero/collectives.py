"""Collectives with DeepSpeed 0.19.8's signatures (served as ``deepspeed.comm``) over zero_comm's checked, logged
collectives."""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist

import zero_comm
from zero_comm import objects as _objects


class ReduceOp(enum.Enum):
    """DeepSpeed's reduction operators (``deepspeed.comm.ReduceOp``); torch's ``dist.ReduceOp`` is accepted too."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6
    AVG = 7
    UNUSED = 8


_ZERO_COMM_OPS = {ReduceOp.SUM: "sum", ReduceOp.AVG: "avg", ReduceOp.MAX: "max", ReduceOp.MIN: "min"}
_TORCH_OPS = {ReduceOp.PRODUCT: "PRODUCT", ReduceOp.BAND: "BAND", ReduceOp.BOR: "BOR", ReduceOp.BXOR: "BXOR"}


def _op(op) -> ReduceOp:
    if isinstance(op, ReduceOp):
        return op
    for member in ReduceOp:  # torch's ReduceOp (or its RedOpType) by name
        if getattr(dist.ReduceOp, member.name, None) == op:
            return member
    raise ValueError(f"zero.comm: op must be a zero.comm.ReduceOp or torch.distributed.ReduceOp, got {op!r}")


def _group(group):
    return group if group is not None else dist.group.WORLD


class _Then:
    """An async handle that runs ``then()`` after the collective completes (``wait`` is where results land)."""

    def __init__(self, handle, then):
        self._handle, self._then = handle, then

    def is_completed(self) -> bool:
        return self._then is None

    def wait(self, timeout: float | None = None) -> None:
        if timeout is None:  # torch's Work.wait takes no None (deepspeed.comm.reduce's AVG wraps one)
            self._handle.wait()
        else:
            self._handle.wait(timeout)
        if self._then is not None:
            then, self._then = self._then, None
            then()


def all_reduce(
    tensor: torch.Tensor,
    op=ReduceOp.SUM,
    group=None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_reduce",
    debug=None,
):
    """Reduce ``tensor`` over ``group`` in place. Returns a handle with ``wait()`` when ``async_op``, else None.

    SUM, AVG, MAX and MIN go through ``zero_comm.all_reduce``; PRODUCT/BAND/BOR/BXOR through torch directly.
    Raises ValueError for an unknown op or a non-contiguous tensor (before communicating).
    """
    rop = _op(op)
    if rop in _ZERO_COMM_OPS:
        handle = zero_comm.all_reduce(tensor, _group(group), op=_ZERO_COMM_OPS[rop], async_op=async_op)
        return handle if async_op else None
    if rop not in _TORCH_OPS:
        raise ValueError(f"zero.comm.all_reduce: op {rop.name} cannot be used for a reduction")
    return dist.all_reduce(tensor, op=getattr(dist.ReduceOp, _TORCH_OPS[rop]), group=group, async_op=async_op)


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op=ReduceOp.SUM,
    group=None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "reduce",
    debug=None,
):
    """Reduce ``tensor`` over ``group`` into global rank ``dst``'s ``tensor`` (other ranks' are left as torch leaves
    them). ``ReduceOp.AVG`` (which gloo's reduce lacks) is the SUM divided by the group's size on ``dst``. Returns a
    handle with ``wait()`` when ``async_op``, else None, as DeepSpeed's ``deepspeed.comm.reduce``.

    Raises ValueError for an unknown op (before communicating).
    """
    rop = _op(op)
    if rop is ReduceOp.UNUSED:
        raise ValueError("zero.comm.reduce: op UNUSED cannot be used for a reduction")
    torch_op = getattr(dist.ReduceOp, "SUM" if rop is ReduceOp.AVG else rop.name)
    handle = dist.reduce(tensor, dst, op=torch_op, group=group, async_op=async_op)
    if rop is not ReduceOp.AVG:
        return handle

    def average() -> None:
        if dist.get_rank() == dst:
            tensor.div_(dist.get_world_size(_group(group)))

    if async_op:
        return _Then(handle, average)
    average()
    return None


def broadcast(
    tensor: torch.Tensor,
    src: int,
    group=None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "broadcast",
    debug=None,
):
    """Copy ``tensor`` from global rank ``src`` to every rank of ``group``. Handle when ``async_op``, else None."""
    handle = zero_comm.broadcast(tensor, src, _group(group), async_op=async_op)
    return handle if async_op else None


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    group=None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_gather_into_tensor",
    debug=None,
):
    """Gather every rank's ``tensor`` into ``output_tensor`` (``world * numel`` elements, rank order)."""
    handle = zero_comm.all_gather_into_tensor(output_tensor, tensor, _group(group), async_op=async_op)
    return handle if async_op else None


def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group=None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_gather",
    debug=None,
):
    """``tensor_list[r]`` receives rank r's ``tensor`` (one flat all-gather through zero_comm, then copies).

    Raises:
        ValueError: ``tensor_list`` does not hold one tensor per rank of ``tensor``'s shape and dtype.
    """
    g = _group(group)
    world = g.size()
    if len(tensor_list) != world or any(t.shape != tensor.shape or t.dtype != tensor.dtype for t in tensor_list):
        raise ValueError(
            f"zero.comm.all_gather: tensor_list must hold {world} tensors of shape "
            f"{tuple(tensor.shape)} and dtype {tensor.dtype}, got "
            f"{[(tuple(t.shape), t.dtype) for t in tensor_list]}"
        )
    flat = torch.empty(world * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    handle = zero_comm.all_gather_into_tensor(flat, tensor.contiguous(), g, async_op=True)

    def scatter_into_list() -> None:
        for t, chunk in zip(tensor_list, flat.view(world, -1)):
            t.copy_(chunk.view(tensor.shape))

    result = _Then(handle, scatter_into_list)
    if async_op:
        return result
    result.wait()
    return None


def reduce_scatter_tensor(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    op=ReduceOp.SUM,
    group=None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "reduce_scatter_tensor",
    debug=None,
):
    """Reduce ``tensor`` (``world * k`` elements) and leave chunk r in rank r's ``output_tensor`` (SUM or AVG)."""
    rop = _op(op)
    if rop not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"zero.comm.reduce_scatter_tensor: op must be SUM or AVG, got {rop.name}")
    handle = zero_comm.reduce_scatter_tensor(
        output_tensor, tensor, _group(group), op=_ZERO_COMM_OPS[rop], async_op=async_op
    )
    return handle if async_op else None


def all_to_all_single(
    output: torch.Tensor,
    tensor: torch.Tensor,
    output_split_sizes=None,
    input_split_sizes=None,
    group=None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_to_all_single",
    debug=None,
):
    """All-to-all along dim 0 (chunk j of rank i lands as chunk i of rank j), as ``torch.distributed``'s.

    ``input_split_sizes`` / ``output_split_sizes``: rows sent to / received from each rank of ``group``; a side left
    None splits its tensor's dim 0 equally (zero_comm's ``all_to_all_v`` when either is given).

    Raises ValueError naming the argument when split sizes do not hold one count per rank or do not add up to the
    tensor's dim 0 (on the rank that finds it; its peers' waits quote it).
    """
    if output_split_sizes is None and input_split_sizes is None:
        handle = zero_comm.all_to_all_single(output, tensor, _group(group), async_op=async_op)
        return handle if async_op else None
    world = dist.get_world_size(_group(group))
    out_sizes = list(output_split_sizes) if output_split_sizes is not None else [output.shape[0] // world] * world
    in_sizes = list(input_split_sizes) if input_split_sizes is not None else [tensor.shape[0] // world] * world
    handle = zero_comm.all_to_all_v(output, tensor, out_sizes, in_sizes, group, async_op=True)
    if async_op:
        return handle
    handle.wait()
    return None


def barrier(
    group=None, async_op: bool = False, device_ids=None, prof: bool = False, log_name: str = "barrier", debug=None
):
    """Block until every rank of ``group`` arrives (bounded by the group's timeout)."""
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def all_gather_object(object_list: list, obj, group=None) -> None:
    """Fill ``object_list`` (length = the group's size) with every rank's picklable ``obj``, in group-rank order.

    Mirrors ``deepspeed.comm.all_gather_object`` / ``torch.distributed.all_gather_object``; goes through
    ``zero_comm.objects`` (two gloo all-gathers, no numpy needed). For small control messages, not tensors.

    Raises:
        ValueError: ``object_list`` does not have one slot per rank of ``group``.
    """
    g = _group(group)
    if len(object_list) != g.size():
        raise ValueError(f"zero.comm.all_gather_object: object_list has {len(object_list)} slots, the group has "
                         f"{g.size()} ranks")  # fmt: skip
    object_list[:] = _objects.all_gather_object(obj, g)


def broadcast_object_list(object_list: list, src: int, group=None, device=None) -> None:
    """Replace ``object_list``'s items on every rank with those of global rank ``src`` (same length everywhere).

    Mirrors ``deepspeed.comm.broadcast_object_list`` / ``torch.distributed.broadcast_object_list``; ``device`` is
    accepted and ignored (the bytes travel as CPU tensors over gloo). One pickled list, two broadcasts.

    Raises:
        ValueError: ``src``'s list has a different length from this rank's.
    """
    items = _objects.broadcast_object(list(object_list), src, _group(group))
    if len(items) != len(object_list):
        raise ValueError(f"zero.comm.broadcast_object_list: rank {src} sent {len(items)} objects, this rank's "
                         f"object_list has {len(object_list)} slots")  # fmt: skip
    object_list[:] = items
