"""Coalesced all-gather and reduce-scatter: many tensors of uneven sizes in one collective.

Each tensor keeps the per-tensor semantics of :func:`all_gather_into_tensor` / :func:`reduce_scatter_tensor`;
the tensors are packed rank-major into one flat buffer (rank r's pieces of every tensor contiguous), so one
collective moves them all. This costs one pack copy and one unpack copy, and saves one collective launch per
tensor (the role of ``torch.distributed``'s ``all_gather_coalesced``/``_coalescing_manager``). The bucketed
reduce-scatter (:mod:`zero_comm.bucketed`) packs each bucket the same way (:func:`pack_rank_major`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zero_comm.collectives import CommHandle, _all_gather, _check_group, _reduce_scatter, _reject


def _check_lists(name, group, outputs, inputs, out_factor: int, in_factor: int):
    if len(outputs) != len(inputs) or not inputs:
        raise _reject(
            name, group, f"outputs ({len(outputs)}) and inputs ({len(inputs)}) must be non-empty, same length"
        )
    dtype, device = inputs[0].dtype, inputs[0].device
    sizes = []
    for i, (o, x) in enumerate(zip(outputs, inputs, strict=True)):
        for arg, t in ((f"outputs[{i}]", o), (f"inputs[{i}]", x)):
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.device != device:
                got = f"{t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise _reject(name, group, f"{arg} is {got}, expected {dtype} on {device} like inputs[0]")
            if not t.is_contiguous():
                raise _reject(name, group, f"{arg} must be contiguous, got shape {tuple(t.shape)} strides {t.stride()}")
        k = x.numel() // in_factor
        if x.numel() % in_factor or o.numel() != k * out_factor:
            raise _reject(
                name, group, f"outputs[{i}] has shape {tuple(o.shape)} ({o.numel()} elements) and inputs[{i}] shape "
                f"{tuple(x.shape)} ({x.numel()} elements); expected output numel = {out_factor} x "
                f"(input numel / {in_factor})",
            )  # fmt: skip
        sizes.append(k)
    return sizes, dtype, device


def pack_rank_major(inputs: Sequence[torch.Tensor], sizes: Sequence[int], world: int, packed: torch.Tensor) -> None:
    """Write ``inputs[i]`` (``world * sizes[i]`` elements, any layout) into ``packed`` (``world * sum(sizes)``
    elements, contiguous) rank-major: part r of ``packed`` holds chunk r of every input, side by side, so one
    reduce-scatter of ``packed`` leaves every input's chunk r, reduced, in rank r's part."""
    total = sum(sizes)
    rows = packed.view(world, total)
    offset = 0
    for x, k in zip(inputs, sizes, strict=True):
        rows[:, offset : offset + k].copy_(x.reshape(world, k))
        offset += k


def unpack_flat(flat: torch.Tensor, outputs: Sequence[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` into ``outputs`` (each ``outputs[i].numel()`` elements, any layout)."""
    offset = 0
    for o in outputs:
        k = o.numel()
        o.copy_(flat[offset : offset + k].view(o.shape))
        offset += k


def all_gather_coalesced(
    outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], group=None, *, async_op: bool = False
) -> CommHandle:
    """All-gather every ``inputs[i]`` into ``outputs[i]`` (``world * inputs[i].numel()`` elements) in one collective.

    Args:
        outputs, inputs: equal-length lists; one dtype and device throughout; contiguous; sizes may differ per i.
        group: the process group; None: the default group. async_op: outputs are valid after ``wait``.

    Raises:
        ValueError: list lengths, sizes, dtype/device or contiguity wrong (names the index), before communicating.
    """
    name = "all_gather_coalesced"
    group = _check_group(name, group)
    world = group.size()
    sizes, dtype, device = _check_lists(name, group, outputs, inputs, world, 1)
    total = sum(sizes)
    packed = torch.cat([x.reshape(-1) for x in inputs]) if len(inputs) > 1 else inputs[0].reshape(-1)
    gathered = torch.empty(world * total, dtype=dtype, device=device)

    def unpack() -> None:
        rows = gathered.view(world, total)
        offset = 0
        for o, k in zip(outputs, sizes, strict=True):
            o.view(world, k).copy_(rows[:, offset : offset + k])
            offset += k

    return _all_gather(gathered, packed, group, async_op, name, unpack)


def reduce_scatter_coalesced(
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    group=None,
    *,
    op: str = "sum",
    async_op: bool = False,
) -> CommHandle:
    """Reduce-scatter every ``inputs[i]`` (``world * outputs[i].numel()`` elements) into ``outputs[i]``, one call.

    Args:
        outputs, inputs: equal-length lists; one dtype and device; contiguous; sizes may differ per i.
        group: the process group; None: the default group.
        op: "sum" or "avg", or torch's ``ReduceOp.SUM`` / ``ReduceOp.AVG`` (as :func:`reduce_scatter_tensor`).

    Raises:
        ValueError: list lengths, sizes, dtype/device or contiguity wrong (names the index), before communicating.
    """
    name = "reduce_scatter_coalesced"
    group = _check_group(name, group)
    world = group.size()
    sizes, dtype, device = _check_lists(name, group, outputs, inputs, 1, world)
    total = sum(sizes)
    packed = torch.empty(world * total, dtype=dtype, device=device)
    pack_rank_major(inputs, sizes, world, packed)
    reduced = torch.empty(total, dtype=dtype, device=device)
    return _reduce_scatter(reduced, packed, group, op, async_op, name, lambda: unpack_flat(reduced, outputs))
