"""Graph operations of the compiled path, registered with ``torch.library`` in the namespace ``zero_compile``.

The passes insert these into AOTAutograd's forward and backward FX graphs; they are never traced by AOTAutograd
itself, so they need no autograd formula. Each takes ``store`` (the id of a registered :class:`UnitStore`) and
``unit`` (the index of a ZeRO-3 unit or a ZeRO-1 gradient bucket in that store's layout):

* ``all_gather_start(store, units)``: issue the async all-gather of each unit's shards into a fresh full flat
  buffer (several units fused into one collective when given together); nothing returned.
* ``all_gather_wait(store, unit, dtype) -> Tensor``: wait for that gather (starting it first if no start ran) and
  return the unit's full flat buffer, 1-D, ``padded_numel`` elements of ``dtype``.
* ``release(store, unit, full)``: drop the unit's gathered buffer (storage resized to 0) unless the store keeps it
  (selective unsharding); ``full`` orders it after the buffer's last reader.
* ``reduce_grads(store, unit, slots, grads)``: place the gradients of the unit's parameters ``slots`` (indices
  into the unit's slots; the others count as zero: they belong to another graph or got no gradient) into a flat
  buffer, reduce-scatter it with the rank average and hand this rank's chunk to the core's gradient sink.

Fake (meta) kernels make tracing and inductor's lowering communication-free. ``all_gather_start``, ``release`` and
``reduce_grads`` return nothing that anyone reads, so they are registered as side-effecting
(``torch.fx.node.has_side_effect``): FX's and inductor's dead-code elimination keep them.

Mirrors DeepCompile's ``allgather_param`` / ``wait_allgather`` / ``release_param`` / ``reduce_grad`` operations
(DeepSpeed ``deepspeed/compile``), as Python ops over zero_comm instead of a C++ runtime talking to NCCL.
"""

from __future__ import annotations

import torch
from torch.fx.node import has_side_effect

from zero_compile.store import get_store

_LIB = "zero_compile"


@torch.library.custom_op(f"{_LIB}::all_gather_start", mutates_args=())
def all_gather_start(store: int, units: list[int]) -> None:
    get_store(store).start(units)


@all_gather_start.register_fake
def _(store: int, units: list[int]) -> None:
    return None


@torch.library.custom_op(f"{_LIB}::all_gather_wait", mutates_args=())
def all_gather_wait(store: int, unit: int, dtype: torch.dtype) -> torch.Tensor:
    return get_store(store).wait(unit, dtype)


@all_gather_wait.register_fake
def _(store: int, unit: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(get_store(store).padded_numel(unit), dtype=dtype, device=get_store(store).device)


@torch.library.custom_op(f"{_LIB}::release", mutates_args=())
def release(store: int, unit: int, full: torch.Tensor) -> None:
    get_store(store).release(unit)


@release.register_fake
def _(store: int, unit: int, full: torch.Tensor) -> None:
    return None


@torch.library.custom_op(f"{_LIB}::reduce_grads", mutates_args=())
def reduce_grads(store: int, unit: int, slots: list[int], grads: list[torch.Tensor]) -> None:
    get_store(store).reduce(unit, slots, grads)


@reduce_grads.register_fake
def _(store: int, unit: int, slots: list[int], grads: list[torch.Tensor]) -> None:
    return None


START = torch.ops.zero_compile.all_gather_start.default
WAIT = torch.ops.zero_compile.all_gather_wait.default
RELEASE = torch.ops.zero_compile.release.default
REDUCE = torch.ops.zero_compile.reduce_grads.default

for _op in (START, RELEASE, REDUCE):
    has_side_effect(_op)
