"""Variation point 2: how gradients are reduced (all-reduce, reduce-scatter, qgZ), the protocol of the object that
owns gradient hooks and buckets, and what the runtime hands its builder.

``ZeroRuntime`` holds one :class:`GradReduction`, built last (after the parameter and master stores) by a builder
that receives a :class:`ReductionInputs`: by default ``zero_core.reducer.GradReducer.from_inputs``, which runs one
``zero_core.reduce_mode.ReductionMode`` per stage and master store; zero_compile passes its own with
``ZeroRuntime(..., grad_reduction=builder)``. The default reducer chooses its collective with
:func:`default_grad_comm`: :class:`AllReduceAvg` at stage 0 (DDP), :class:`ReduceScatterAvg` at stages 1-3,
:class:`QuantizedReduceScatterAvg` at stage 3 with ``zero_quantized_gradients`` (ZeRO++ qgZ).

Who calls what: the runtime calls ``begin_backward(is_boundary)`` / ``end_backward()`` around autograd,
``finish_round()`` before reading gradients (step, ``full_grad``), ``has_grad()`` at ``step()``, ``zero()`` after
it, and ``close()`` last. The reduction calls the parameter store's ``on_grads_done(bucket)`` when a bucket's
gradients are all in (and ``before_reduce()`` before each collective) and the master store's
``on_grad_ready(bucket, grad_shard, boundary)`` once the bucket's reduced gradient has been added into this rank's
gradient shard (``grad_shard(g)``). The reduction owns the gradient shards: the runtime (norm, ``full_grad``), the
master store and checkpoints read them through ``grad_shard``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from zero_comm import all_reduce, reduce_scatter_tensor, reduce_scatter_uneven
from zero_core.divergence import _timeout, companion_group

if TYPE_CHECKING:
    from zero_core.comm_context import CommContext
    from zero_core.config import ZeroConfig
    from zero_core.layout import FlatGroup
    from zero_core.master import MasterStore
    from zero_core.param_store import ParamStore
    from zero_core.precision import PrecisionPolicy
    from zero_core.zeropp import ZeroPP


@dataclass(frozen=True)
class ReductionInputs:
    """What ``ZeroRuntime`` offers the gradient-reduction seam: its builder gets one (``grad_reduction=``), and the
    store built takes from it what it uses (it does not keep it).

    Attributes:
        module: the model (the compiled path compiles it).
        flat_groups: the frozen layout, ``FlatGroup.index`` order.
        group: the data-parallel process group; rank / world: this rank's index in it and its size.
        stage: the ZeRO stage (0-3).
        config: the ``zero_optimization`` section (``reduce_bucket_size``, ``overlap``, offload...).
        precision: the dtypes (``reduce``: what collectives send; ``accum``: gradient shards).
        comm_ctx: the collective streams (CUDA).
        zeropp: stage 3's ZeRO++ collectives (qgZ when ``zero_quantized_gradients``), else None.
        params: the parameter store, built first.
        master: the master store, built second.
    """

    module: torch.nn.Module
    flat_groups: tuple[FlatGroup, ...]
    group: dist.ProcessGroup
    rank: int
    world: int
    stage: int
    config: ZeroConfig
    precision: PrecisionPolicy
    comm_ctx: CommContext
    zeropp: ZeroPP | None
    params: ParamStore
    master: MasterStore


@runtime_checkable
class GradReduction(Protocol):
    """Gradient hooks, buckets and reduction rounds of one runtime (see the module docstring)."""

    streamed: bool
    """Stage 3 with a master store that keeps the gradients itself (``MasterStore.takes_grad_shards``): each
    unit's reduced chunk goes to the master store as it is reduced, and :meth:`wait_reduced` must run before the
    next unit's gradients arrive (the stage-3 store calls it at each unit's pre-backward)."""

    def wait_reduced(self) -> None:
        """Streamed: wait for the reductions in flight and hand their chunks to the master store (no-op
        otherwise)."""
        ...

    def begin_backward(self, is_boundary: bool | None) -> None: ...

    def end_backward(self) -> None: ...

    def finish_round(self, final: bool = False) -> None: ...

    def has_grad(self) -> dict[int, list[bool]]:
        """Flat-group index -> per slot: a gradient arrived on this rank since ``zero()``."""
        ...

    def grad_shard(self, g) -> torch.Tensor | None:
        """This rank's accumulated gradient shard of flat group ``g`` (``g.shard_numel`` elements, the
        accumulation dtype; the whole buffer at stage 0, where ``partitions`` is 1), None for a frozen group."""
        ...

    def resident(self) -> list[torch.Tensor]:
        """Every gradient tensor this reduction holds now (shards and bucket buffers; memory accounting)."""
        ...

    def zero(self) -> None: ...

    def close(self) -> None: ...


GradReductionBuilder = Callable[[ReductionInputs], GradReduction]
"""What ``ZeroRuntime(grad_reduction=...)`` takes: builds the store from the runtime's :class:`ReductionInputs`."""


class GradComm(Protocol):
    """One bucket's collective: average ``send`` over ranks.

    ``scatters`` True: ``out`` is this rank's chunk (``send.numel() / world`` elements) and gets the average of
    that chunk; False: ``out`` is ``send`` itself, averaged in place. ``reduce(out, send)`` starts it and returns a
    handle with ``wait()`` and ``ready()`` (``zero_comm.CommHandle``). A scattering collective used at stages 1-2
    also has ``uneven(out, send, splits)``: one reduction piece of a bucket, rank r's part ``splits[r]`` elements
    (``zero_comm.reduce_scatter_uneven``); None where it has not.
    """

    scatters: bool
    takes_pieces: bool
    """True when ``uneven`` is offered (a piece of a bucket, see above)."""
    joins_units: bool
    """True when one call may reduce several stage-3 units' rank-major buffers laid end to end (a plain
    reduce-scatter; qgZ quantizes each unit's gradient on its own)."""
    reduce: Callable
    uneven: Callable | None


class AllReduceAvg:
    """Stage 0: all-reduce with average (DDP).

    Args:
        group: the process group; async_op: return at once (the handle waits).
    """

    scatters = False
    takes_pieces = False
    joins_units = False
    uneven = None

    def __init__(self, group, async_op: bool):
        self.group, self.async_op = group, async_op

    def reduce(self, out, send):
        """Average ``send`` in place (``out`` is ``send``)."""
        return all_reduce(send, self.group, op="avg", async_op=self.async_op)

    __call__ = reduce


class ReduceScatterAvg:
    """Stages 1-3: reduce-scatter with average (ZeRO section 5.2); ``reduce`` and ``uneven`` are zero_comm's
    collectives with the group and op bound (no wrapper call on the hot path).

    Args:
        group: the process group; async_op: return at once (the handle waits).
    """

    scatters = True
    takes_pieces = True
    joins_units = True

    def __init__(self, group, async_op: bool):
        self.group, self.async_op = group, async_op
        self.reduce = partial(reduce_scatter_tensor, group=group, op="avg", async_op=async_op)
        # a piece of a bucket: rank r gets the average of ``send``'s part r (``splits[r]`` elements)
        self.uneven = partial(reduce_scatter_uneven, group=group, op="avg", async_op=async_op)

    def __call__(self, out, send):
        return self.reduce(out, send)


class QuantizedReduceScatterAvg:
    """Stage 3 with qgZ (ZeRO++ section 3.3): ``zero_core.zeropp.ZeroPP.reduce_scatter`` (synchronous)."""

    scatters = True
    takes_pieces = False
    joins_units = False
    uneven = None

    def __init__(self, zeropp):
        self.zeropp = zeropp
        self.reduce = zeropp.reduce_scatter

    def __call__(self, out, send):
        return self.reduce(out, send)


_REDUCE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # main group -> its reduction group


def reduction_group(group):
    """Stage 3's gradient reductions run on a group of their own: the same ranks, backend and timeout (created
    once per group, collective over those ranks). A piece launches as soon as its gradients are in here, so a
    parameter with a gradient on some ranks only has its reduce-scatter issued during backward on those ranks and
    at its end on the others; on one group it would then meet the other ranks' all-gathers of the same backward
    in a different order (found by review: a CollectiveTimeout in backward). On a group of its own every rank
    issues the reductions in the same order, and they complete when the last rank joins."""
    return companion_group(group, _REDUCE, backend=dist.get_backend(group), timeout=_timeout(group))


def default_grad_comm(*, stage: int, group, world: int, overlap: bool, zeropp: ZeroPP | None) -> GradComm:
    """The collective the config asks for (see the module docstring); stage 3 on several ranks reduces on
    :func:`reduction_group`.

    Args:
        stage: the ZeRO stage; group / world: the data-parallel group and its size; overlap: ``overlap_comm``
            (collectives run asynchronously); zeropp: stage 3's ZeRO++ collectives (qgZ), or None.
    """
    if stage == 0:
        return AllReduceAvg(group, overlap)
    if zeropp is not None and zeropp.qgz is not None:
        return QuantizedReduceScatterAvg(zeropp)
    return ReduceScatterAvg(reduction_group(group) if stage == 3 and world > 1 else group, overlap)
