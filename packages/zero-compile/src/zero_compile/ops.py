"""Graph operations of the compiled path, registered with ``torch.library`` in the namespace ``zero_compile``.

The passes insert these into AOTAutograd's forward and backward FX graphs; they are never traced by AOTAutograd
itself, so they need no autograd formula. ``store`` is the id of a registered :class:`UnitStore`; ``unit`` is the
index of a ZeRO-3 unit or a gradient bucket as the graph was traced. Dynamo reuses one graph for every instance of a
module class whose frame it compiles apart (each transformer block after a graph break), so at run time the store
finds the unit from the parameter tensors passed in (``anchors``/``params``: the graph's own parameter inputs):

* ``all_gather_start(store, units, anchors)``: issue the async all-gather of each unit's shards into a fresh full
  flat buffer (several units fused into one collective when given together); nothing returned.
* ``all_gather_wait(store, unit, dtype, numel, anchor) -> Tensor``: wait for that gather (starting it first if no
  start ran) and return the unit's full flat buffer, 1-D, ``numel`` (the unit's ``padded_numel``) elements of
  ``dtype``.
* ``release(store, unit, full, anchor)``: drop the store's reference to the unit's gathered buffer unless it is
  kept (selective unsharding); ``full`` orders it after the buffer's last reader.
* ``reduce_grads(store, unit, slots, grads, params)``: place each gradient at its parameter's slot of the unit
  (``slots``: as traced; slots not given count as zero: another graph or no gradient), reduce-scatter with the rank
  average and hand this rank's chunk to the core's gradient sink.
* ``grad_anchor(grad, param) -> Tensor``: put into the joint graph on every parameter gradient so the partitioner
  saves the parameter for the backward; the ZeRO passes replace it by ``reduce_grads`` (it never runs there).

Fake (meta) kernels make tracing and inductor's lowering communication-free, and are functions of their arguments
alone: the gathered size is an argument, not read from the store, because inductor's graph cache keys a compiled
graph by its code and inputs (a size read from the store would let a graph compiled at one world size run at
another with its buffers sized for the first). ``all_gather_start``, ``release`` and
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
def all_gather_start(store: int, units: list[int], anchors: list[torch.Tensor]) -> None:
    """Issue the async all-gather of the units of ``anchors`` (traced for ``units``); nothing returned."""
    get_store(store).start(get_store(store).resolve_units(units, anchors))


@all_gather_start.register_fake
def _(store: int, units: list[int], anchors: list[torch.Tensor]) -> None:
    return None


@torch.library.custom_op(f"{_LIB}::all_gather_wait", mutates_args=())
def all_gather_wait(store: int, unit: int, dtype: torch.dtype, numel: int, anchor: torch.Tensor) -> torch.Tensor:
    """The full flat buffer (1-D, ``numel`` elements of ``dtype``) of ``anchor``'s unit, gathered.

    Raises ValueError when the unit's ``padded_numel`` is not ``numel`` (a graph traced for another layout)."""
    st = get_store(store)
    resolved = st.resolve_units([unit], [anchor])[0]
    if st.padded_numel(resolved) != numel:
        raise ValueError(f"zero_compile: the graph was traced for a unit of {numel} elements, but unit {resolved} "
                         f"has {st.padded_numel(resolved)} at world size {st.world}")  # fmt: skip
    return st.wait(resolved, dtype)


@all_gather_wait.register_fake
def _(store: int, unit: int, dtype: torch.dtype, numel: int, anchor: torch.Tensor) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, device=anchor.device)


def _wait_setup_context(ctx, inputs, output) -> None:
    # the anchor only names the unit: the gathered buffer carries no gradient back to it (``reduce_grads`` does)
    ctx.mark_non_differentiable(output)


def _wait_backward(ctx, grad_out):
    return None, None, None, None, None


all_gather_wait.register_autograd(_wait_backward, setup_context=_wait_setup_context)


@torch.library.custom_op(f"{_LIB}::release", mutates_args=())
def release(store: int, unit: int, full: torch.Tensor, anchor: torch.Tensor) -> None:
    """Drop the store's reference to ``anchor``'s gathered unit (kept units stay until the step)."""
    st = get_store(store)
    st.release(st.resolve_units([unit], [anchor])[0])


@release.register_fake
def _(store: int, unit: int, full: torch.Tensor, anchor: torch.Tensor) -> None:
    return None


@torch.library.custom_op(f"{_LIB}::reduce_grads", mutates_args=())
def reduce_grads(
    store: int, unit: int, slots: list[int], grads: list[torch.Tensor], params: list[torch.Tensor]
) -> None:
    """Reduce-scatter (rank average) the gradients of ``params`` (slots ``slots`` of one unit, as traced) into the
    core's gradient shard.

    Raises ValueError naming a tensor that is not a parameter of the model or a unit mix-up."""
    get_store(store).reduce_params(unit, slots, grads, params)


@reduce_grads.register_fake
def _(store: int, unit: int, slots: list[int], grads: list[torch.Tensor], params: list[torch.Tensor]) -> None:
    return None


@torch.library.custom_op(f"{_LIB}::grad_anchor", mutates_args=())
def grad_anchor(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``grad`` (a copy): marks a parameter gradient in the joint graph; the passes replace it."""
    return grad.clone()


@grad_anchor.register_fake
def _(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(grad)


def _grad_anchor_backward(ctx, grad_out: torch.Tensor):
    # the identity in ``grad``; never differentiated in the joint graph, declared so autograd is well defined
    return grad_out, None


grad_anchor.register_autograd(_grad_anchor_backward)


START = torch.ops.zero_compile.all_gather_start.default
WAIT = torch.ops.zero_compile.all_gather_wait.default
RELEASE = torch.ops.zero_compile.release.default
REDUCE = torch.ops.zero_compile.reduce_grads.default
GRAD_ANCHOR = torch.ops.zero_compile.grad_anchor.default

for _op in (START, RELEASE, REDUCE):
    has_side_effect(_op)
