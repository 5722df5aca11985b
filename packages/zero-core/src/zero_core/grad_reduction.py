"""Variation point 2: how gradients are reduced (all-reduce, reduce-scatter, qgZ), and the protocol of the object
that owns gradient hooks and buckets.

``ZeroRuntime`` holds one :class:`GradReduction` (default ``zero_core.reducer.GradReducer``, which runs one
``zero_core.reduce_mode.ReductionMode`` per stage and master store; zero_compile may pass its own with
``ZeroRuntime(..., grad_reduction=...)``). The default reducer chooses its collective from the config with
:func:`default_grad_comm`: :class:`AllReduceAvg` at stage 0 (DDP), :class:`ReduceScatterAvg` at stages 1-3,
:class:`QuantizedReduceScatterAvg` at stage 3 with ``zero_quantized_gradients`` (ZeRO++ qgZ).

Who calls what: the runtime calls ``attach(rt)`` once (after the master store), ``begin_backward(is_boundary)`` /
``end_backward()`` around autograd, ``finish_round()`` before reading gradients (step, ``full_grad``), ``has_grad()``
at ``step()``, ``zero()`` after it, and ``close()`` last. The reduction calls ``rt.params.on_grads_done(bucket)``
when a bucket's gradients are all in and ``rt.master.on_grad_ready(bucket, grad_shard, boundary)`` once the
bucket's reduced gradient has been added into this rank's gradient shard (``grad_shard(g)``). The reduction owns
the gradient shards: the runtime (norm, ``full_grad``), the master store and checkpoints read them through
``grad_shard``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from zero_comm import all_reduce, reduce_scatter_tensor, reduce_scatter_uneven
from zero_core.divergence import _timeout, companion_group


@runtime_checkable
class GradReduction(Protocol):
    """Gradient hooks, buckets and reduction rounds of one runtime (see the module docstring)."""

    streamed: bool
    """Stage 3 with a master store that keeps the gradients itself (``MasterStore.takes_grad_shards``): each
    unit's reduced chunk goes to the master store as it is reduced, and :meth:`wait_reduced` must run before the
    next unit's gradients arrive (the stage-3 store calls it at each unit's pre-backward)."""

    def attach(self, rt) -> None: ...

    def wait_reduced(self) -> None:
        """Streamed: wait for the reductions in flight and hand their chunks to the master store (no-op
        otherwise)."""
        ...

    def begin_backward(self, is_boundary: bool | None) -> None: ...

    def end_backward(self) -> None: ...

    def finish_round(self) -> None: ...

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


class GradComm(Protocol):
    """One bucket's collective: average ``send`` over ranks.

    ``scatters`` True: ``out`` is this rank's chunk (``send.numel() / world`` elements) and gets the average of
    that chunk; False: ``out`` is ``send`` itself, averaged in place. Returns a handle with ``wait()``.
    A scattering collective used at stages 1-2 also has ``uneven(out, send, splits)``: one reduction piece of a
    bucket, rank r's part ``splits[r]`` elements (``zero_comm.reduce_scatter_uneven``).
    """

    scatters: bool
    takes_pieces: bool
    """True when the collective has ``uneven(out, send, splits)`` (a piece of a bucket, see above)."""
    joins_units: bool
    """True when one call may reduce several stage-3 units' rank-major buffers laid end to end (a plain
    reduce-scatter; qgZ quantizes each unit's gradient on its own)."""

    def __call__(self, out: torch.Tensor, send: torch.Tensor): ...


class AllReduceAvg:
    """Stage 0: all-reduce with average (DDP)."""

    scatters = False
    takes_pieces = False
    joins_units = False

    def __init__(self, group, async_op: bool):
        self.group, self.async_op = group, async_op

    def __call__(self, out, send):
        return all_reduce(send, self.group, op="avg", async_op=self.async_op)


class ReduceScatterAvg:
    """Stages 1-3: reduce-scatter with average (ZeRO section 5.2)."""

    scatters = True
    takes_pieces = True
    joins_units = True

    def __init__(self, group, async_op: bool):
        self.group, self.async_op = group, async_op

    def __call__(self, out, send):
        return reduce_scatter_tensor(out, send, self.group, op="avg", async_op=self.async_op)

    def uneven(self, out, send, splits):
        """A piece of a bucket: rank r gets the average of ``send``'s part r (``splits[r]`` elements)."""
        return reduce_scatter_uneven(out, send, splits, self.group, op="avg", async_op=self.async_op)


class QuantizedReduceScatterAvg:
    """Stage 3 with qgZ (ZeRO++ section 3.3): ``zero_core.zeropp.ZeroPP.reduce_scatter`` (synchronous)."""

    scatters = True
    takes_pieces = False
    joins_units = False

    def __init__(self, zeropp):
        self.zeropp = zeropp

    def __call__(self, out, send):
        return self.zeropp.reduce_scatter(out, send)


_REDUCE: dict = {}  # main group name -> (main group, its reduction group)


def reduction_group(group):
    """Stage 3's gradient reductions run on a group of their own: the same ranks, backend and timeout (created
    once per group, collective over those ranks). A piece launches as soon as its gradients are in here, so a
    parameter with a gradient on some ranks only has its reduce-scatter issued during backward on those ranks and
    at its end on the others; on one group it would then meet the other ranks' all-gathers of the same backward
    in a different order (found by review: a CollectiveTimeout in backward). On a group of its own every rank
    issues the reductions in the same order, and they complete when the last rank joins."""
    return companion_group(group, _REDUCE, backend=dist.get_backend(group), timeout=_timeout(group))


def default_grad_comm(rt) -> GradComm:
    """The collective the config asks for (see the module docstring); stage 3 on several ranks reduces on
    :func:`reduction_group`."""
    if rt.stage == 0:
        return AllReduceAvg(rt.group, rt.config.overlap)
    if rt.zeropp is not None and rt.zeropp.qgz is not None:
        return QuantizedReduceScatterAvg(rt.zeropp)
    group = reduction_group(rt.group) if rt.stage == 3 and rt.world > 1 else rt.group
    return ReduceScatterAvg(group, rt.config.overlap)
