"""What integrations read off a partitioned parameter: DeepSpeed's ``ds_*`` attribute names, served as read-only
properties from zero_core's own per-parameter records.

PEFT counts a ZeRO-3 model's parameters with ``param.ds_numel``, TRL asks ``param.ds_status`` before gathering
and clears ``param.ds_active_sub_modules``, transformers and Accelerate read ``ds_shape``, ``ds_id`` and
``ds_tensor``. DeepSpeed sets these as attributes on every tensor it partitions. zero keeps the state where it
already lives (the ``zero_init`` record of a parameter partitioned at construction, the stage-3 store's unit
state for one a runtime holds) and makes each such parameter an instance of :class:`ZeroParameter`, a subclass of
``torch.nn.Parameter`` that adds properties reading those records (and a guard on in-place writes into a released
parameter, which raise instead of writing into its 0-element placeholder): no value is copied onto the tensor,
so nothing can go stale, and a parameter that is not partitioned never shows a ``ds_*`` name (integrations test
``hasattr(p, "ds_numel")`` to tell a ZeRO-3 parameter). The class is swapped in place (``p.__class__``), because
the module and the optimizer hold the ``Parameter`` object itself; ``isinstance(p, nn.Parameter)`` stays true and
torch treats the instance exactly as a ``Parameter``. The only state kept here is each parameter's ``ds_id``.

``copy.deepcopy`` of such a parameter (PEFT's ``modules_to_save`` copies a module of a partitioned model) gives a
parameter of the full shape holding the same values, never a 0-element one: see :meth:`ZeroParameter.__deepcopy__`.
"""

from __future__ import annotations

import enum
import itertools
import threading
from typing import Protocol

import torch
from torch.utils.weak import WeakIdKeyDictionary

from zero_core import registry
from zero_core.gathered import GatheredParameters
from zero_core.partition_records import logical_shape, partitioned_record, register_copy
from zero_core.registry import ParamHandle


class ZeroParamStatus(enum.Enum):
    """Whether a partitioned parameter's full value is materialised now (DeepSpeed's enum of this name):
    ``AVAILABLE`` (gathered: inside its module's forward or a ``GatheredParameters`` block), ``NOT_AVAILABLE``
    (only this rank's partition is held), ``INFLIGHT`` (an all-gather is on its way)."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


class ParamHolder(Protocol):
    """What a live runtime part holding partitioned parameters (the stage-3 store) answers about one of them,
    given where the parameter lives (its ``zero_core.registry.ParamHandle``)."""

    def param_status(self, handle: ParamHandle) -> ZeroParamStatus: ...

    def param_shape(self, handle: ParamHandle) -> torch.Size: ...

    def param_partition(self, handle: ParamHandle) -> torch.Tensor:
        """This rank's elements of the parameter (a flat tensor, possibly empty), in storage dtype."""
        ...


def _holder(p: torch.Tensor) -> tuple[ParamHolder, ParamHandle] | None:
    """The live stage-3 store partitioning ``p`` and ``p``'s handle, or None."""
    found = registry.lookup(p)
    return None if found is None or found.store is None else (found.store, found)


_IDS: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""parameter -> its ``ds_id`` (the only per-parameter value this module keeps)."""
_NEXT_ID = itertools.count()


class ZeroParameter(torch.nn.Parameter):
    """A ``torch.nn.Parameter`` that zero_core partitions (at construction by ``zero_init``, or by a stage-3
    runtime). Read-only properties, DeepSpeed's names:

    * ``ds_id`` (int): unique per parameter in the process, the same on every rank (assigned in partition order,
      which is collective), one per object so tied names share it.
    * ``ds_shape`` (``torch.Size``): the full shape; ``ds_numel`` (int): its element count.
    * ``ds_status`` (:class:`ZeroParamStatus`): NOT_AVAILABLE outside forward and ``GatheredParameters``.
    * ``ds_tensor``: this rank's partition (a flat tensor in the storage dtype; empty where the rank holds none
      of it) and ``partition_numel()`` its element count. A runtime's partition follows its flat layout (a unit's
      buffer cut in equal chunks), so sizes may differ between ranks and from DeepSpeed's per-parameter split.
    * ``ds_active_sub_modules``: an empty set (zero tracks which modules use a unit in the store, not on the
      parameter; TRL only clears it).

    A parameter whose runtime was closed (``engine.destroy()``) reads as whole: its own shape, AVAILABLE.
    """

    @property
    def ds_id(self) -> int:
        return _IDS[self]

    @property
    def ds_shape(self) -> torch.Size:
        found = _holder(self)
        return found[0].param_shape(found[1]) if found is not None else logical_shape(self)

    @property
    def ds_numel(self) -> int:
        return self.ds_shape.numel()

    @property
    def ds_status(self) -> ZeroParamStatus:
        found = _holder(self)
        if found is not None:
            return found[0].param_status(found[1])
        rec = partitioned_record(self)
        if rec is not None and held_numel(self) != rec.numel:
            return ZeroParamStatus.NOT_AVAILABLE
        return ZeroParamStatus.AVAILABLE

    @property
    def ds_tensor(self) -> torch.Tensor:
        found = _holder(self)
        if found is not None:
            return found[0].param_partition(found[1])
        rec = partitioned_record(self)
        if rec is not None and rec.shard is not None:
            return rec.shard
        return self.data.reshape(-1)

    @property
    def ds_active_sub_modules(self) -> set:
        return set()

    def partition_numel(self) -> int:
        """Elements of this parameter held by this rank (``ds_tensor.numel()``)."""
        return self.ds_tensor.numel()

    def __deepcopy__(self, memo):
        """A copy with the full shape and the same values (``copy.deepcopy`` of a module of a partitioned model).

        Partitioned at construction (``zero_init``) and not yet in a runtime: the copy is partitioned the same way
        (this rank's partition cloned, no communication), so the next ``initialize()`` lays it out like any other
        parameter. Held by a live stage-3 runtime and released: its full value is gathered (a collective: every
        rank must copy, as every rank runs the same model code) into a plain ``Parameter``, which a later
        ``initialize()`` can take. Gathered (or not partitioned): a plain ``Parameter`` holding a clone.
        """
        if id(self) in memo:
            return memo[id(self)]
        rec = partitioned_record(self)
        if rec is not None and held_numel(self) != rec.numel:
            with torch._C.DisableTorchFunctionSubclass():  # the placeholder's dtype and device, read as they are
                out = ZeroParameter(torch.empty(0, dtype=self.dtype, device=self.device), self.requires_grad)
            register_copy(out, rec)
            adopt(out)
        elif _holder(self) is not None and self.ds_status is not ZeroParamStatus.AVAILABLE:
            with GatheredParameters([self]):
                out = torch.nn.Parameter(self.data.clone(), self.requires_grad)
        else:
            out = torch.nn.Parameter(self.data.clone(), self.requires_grad)
        memo[id(self)] = out
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """Torch's behaviour for a ``Parameter`` (results are plain tensors), except on a released parameter (its
        0-element placeholder, outside forward and ``GatheredParameters``):

        * while a ``zero_init`` context is active on this thread, the context decides (:class:`ReleasedAccess`):
          it lets writes land in the partitioned value, and reads see the full value during a construction;
        * otherwise an in-place write (e.g. ``torch.nn.init.normal_(p)`` or ``p.fill_(0)`` under ``no_grad``)
          raises ``PartitionedWriteError`` instead of writing nothing: the value would otherwise vanish without a
          trace."""
        kwargs = kwargs or {}
        access = getattr(_ACCESS, "handler", None)
        writes = _writes(func)
        if access is not None or writes:
            # torch.nn.init passes the tensor by keyword
            p = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
            if access is not None:
                out = access.access(func, types, args, kwargs, writes)
                if out is not NotImplemented:
                    return out
            if writes and isinstance(p, ZeroParameter) and is_released(p):
                raise PartitionedWriteError(
                    f"{func.__name__} on a partitioned parameter of shape {tuple(p.ds_shape)} outside its "
                    "module's forward: only this rank's partition exists here, so the write would be lost. Write "
                    "inside `with GatheredParameters(params, modifier_rank=0):` (zero.zero / deepspeed.zero)"
                )
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs)

    def __reduce_ex__(self, proto):
        # pickling (torch.save of a module): as a plain Parameter of what it holds now (the properties are not
        # state); DeepSpeed's partitioned parameters pickle their local data the same way
        with torch._C.DisableTorchFunctionSubclass():
            return torch.nn.Parameter(self.data, self.requires_grad).__reduce_ex__(proto)


def held_numel(p: torch.Tensor) -> int:
    """Elements ``p`` holds now (0 for a released parameter's placeholder), read without torch-function dispatch."""
    with torch._C.DisableTorchFunctionSubclass():
        return p.numel()


def is_released(p: torch.Tensor) -> bool:
    """Whether ``p`` is partitioned and holds only its 0-element placeholder (its full value is elsewhere)."""
    return isinstance(p, ZeroParameter) and held_numel(p) == 0 and p.ds_numel > 0


class ReleasedAccess(Protocol):
    """What a ``zero_init`` context does with a torch function applied while it is active on this thread."""

    def access(self, func, types, args: tuple, kwargs: dict, writes: bool):
        """The function's result, computed the context's way when it touches a parameter the context partitioned
        and released; ``NotImplemented`` to let torch apply it as for any ``Parameter``. ``writes``: ``func``
        writes into its first argument."""
        ...


_ACCESS = threading.local()


def set_released_access(handler: ReleasedAccess | None) -> ReleasedAccess | None:
    """Make ``handler`` decide torch functions on released parameters on this thread (None: nobody); returns the
    previous one, to restore when the handler's context ends."""
    previous = getattr(_ACCESS, "handler", None)
    _ACCESS.handler = handler
    return previous


class PartitionedWriteError(RuntimeError):
    """An in-place write into a released partitioned parameter (see ``ZeroParameter.__torch_function__``)."""


_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad", "resize_", "set_"})
_DUNDER_WRITES = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__"})


def _writes(func) -> bool:
    """Whether ``func`` writes into its first argument's values (torch's trailing-underscore convention)."""
    name = getattr(func, "__name__", "")
    if name.startswith("__"):
        return name in _DUNDER_WRITES
    return name.endswith("_") and name not in _NOT_WRITES


def adopt(p: torch.nn.Parameter) -> None:
    """Make ``p`` a :class:`ZeroParameter` (in place) with the next ``ds_id``, once; called where a parameter is
    partitioned (collective there, so ids advance alike on every rank)."""
    if p in _IDS:
        return
    if type(p) is torch.nn.Parameter:
        p.__class__ = ZeroParameter
    _IDS[p] = next(_NEXT_ID)
