"""What integrations read off a partitioned parameter: DeepSpeed's ``ds_*`` attribute names, served as read-only
properties from zero_core's own per-parameter records, and the guard on in-place writes into a released one.

PEFT counts a ZeRO-3 model's parameters with ``param.ds_numel``, TRL asks ``param.ds_status`` before gathering
and clears ``param.ds_active_sub_modules``, transformers and Accelerate read ``ds_shape``, ``ds_id`` and
``ds_tensor``. DeepSpeed sets these as attributes on every tensor it partitions. zero keeps the state where it
already lives (the parameter's record, ``zero_core.param_record``: its ``ds_id``, its ``zero_init`` partition, its
place in a runtime; the stage-3 store's unit state for one a runtime holds) and makes each such parameter an
instance of :class:`ZeroParameter`, a subclass of ``torch.nn.Parameter`` that adds properties reading those
records: no value is copied onto the tensor, so nothing can go stale, and a parameter that is not partitioned never
shows a ``ds_*`` name (integrations test ``hasattr(p, "ds_numel")`` to tell a ZeRO-3 parameter).

The class is swapped in place (``p.__class__``), because the module and the optimizer hold the ``Parameter`` object
itself; ``isinstance(p, nn.Parameter)`` stays true. While its full value is present (gathered, or whole) a
parameter is a :class:`ZeroParameter`, whose ``__torch_function__`` is ``nn.Parameter``'s (torch's disabled
implementation: no Python runs on a torch function). While released (only its 0-element placeholder is held) it is
a :class:`ReleasedZeroParameter`, whose ``__torch_function__`` raises on an in-place write instead of writing into
the placeholder, and lets a ``zero_init`` context decide (``zero_core.build_access``). The stage-3 store swaps the two
where a unit's parameters are pointed at its gathered buffer and where they are left empty
(``zero_core.units.UnitBuffer``).

``copy.deepcopy`` of such a parameter (PEFT's ``modules_to_save`` copies a module of a partitioned model) gives a
parameter of the full shape holding the same values, never a 0-element one: see :meth:`ZeroParameter.__deepcopy__`.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Protocol

import torch

from zero_core import registry
from zero_core.gathered import GatheredParameters
from zero_core.param_record import record_for, record_of
from zero_core.partition_records import logical_shape, partitioned_record, register_copy
from zero_core.shard_state import ZeroParamStatus

__all__ = [
    "PartitionedWriteError",
    "ReleasedAccess",
    "ReleasedData",
    "ReleasedZeroParameter",
    "ZeroParamStatus",
    "ZeroParameter",
    "adopt",
    "held_numel",
    "is_released",
    "set_released_access",
]


def _holder(p: torch.Tensor) -> registry.ParamHandle | None:
    """``p``'s handle when a live stage-3 store partitions it (``handle.store``), else None."""
    found = registry.lookup(p)
    return None if found is None or found.store is None else found


_NEXT_ID = itertools.count()


class ZeroParameter(torch.nn.Parameter):
    """A ``torch.nn.Parameter`` that zero_core partitions (at construction by ``zero_init``, or by a stage-3
    runtime), holding its full value now; :class:`ReleasedZeroParameter` while released. Read-only properties,
    DeepSpeed's names:

    * ``ds_id`` (int): unique per parameter in the process, the same on every rank (assigned in partition order,
      which is collective), one per object so tied names share it.
    * ``ds_shape`` (``torch.Size``): the full shape; ``ds_numel`` (int): its element count.
    * ``ds_status`` (:class:`ZeroParamStatus`): NOT_AVAILABLE outside forward and ``GatheredParameters``.
    * ``ds_tensor``: this rank's partition (a flat tensor in the storage dtype; empty where the rank holds none
      of it) and ``partition_numel()`` its element count. A runtime's partition follows its flat layout (a unit's
      buffer cut in equal chunks), so sizes may differ between ranks and from DeepSpeed's per-parameter split.
    * ``ds_persist`` (bool): its unit stays gathered between uses (persistent).
    * ``ds_active_sub_modules``: an empty set (zero tracks which modules use a unit in the store, not on the
      parameter; TRL only clears it).

    A parameter whose runtime was closed (``engine.destroy()``) reads as whole: its own shape, AVAILABLE.
    Torch functions run as on any ``Parameter`` (``__torch_function__`` is torch's disabled implementation).
    """

    @property
    def ds_id(self) -> int:
        return record_of(self).ds_id

    @property
    def ds_shape(self) -> torch.Size:
        found = _holder(self)
        return found.store.param_shape(found) if found is not None else logical_shape(self)

    @property
    def ds_numel(self) -> int:
        return self.ds_shape.numel()

    @property
    def ds_status(self) -> ZeroParamStatus:
        found = _holder(self)
        if found is not None:
            return found.store.param_status(found)
        rec = partitioned_record(self)
        if rec is not None and held_numel(self) != rec.numel:
            return ZeroParamStatus.NOT_AVAILABLE
        return ZeroParamStatus.AVAILABLE

    @property
    def ds_tensor(self) -> torch.Tensor:
        found = _holder(self)
        if found is not None:
            return found.store.param_partition(found)
        rec = partitioned_record(self)
        if rec is not None and rec.shard is not None:
            return rec.shard
        return self.data.reshape(-1)

    @property
    def ds_persist(self) -> bool:
        """Whether the parameter stays gathered between uses (a persistent unit: at most
        ``stage3_param_persistence_threshold`` elements); False where no stage-3 store holds it."""
        found = _holder(self)
        return found is not None and found.bucket.persistent

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
                out = torch.nn.Parameter(torch.empty(0, dtype=self.dtype, device=self.device), self.requires_grad)
            register_copy(out, rec)
            adopt(out)  # released, as this one
        elif _holder(self) is not None and self.ds_status is not ZeroParamStatus.AVAILABLE:
            with GatheredParameters([self]):
                out = torch.nn.Parameter(self.data.clone(), self.requires_grad)
        else:
            out = torch.nn.Parameter(self.data.clone(), self.requires_grad)
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, proto):
        # pickling (torch.save of a module): as a plain Parameter of what it holds now (the properties are not
        # state); DeepSpeed's partitioned parameters pickle their local data the same way
        with torch._C.DisableTorchFunctionSubclass():
            return torch.nn.Parameter(self.data, self.requires_grad).__reduce_ex__(proto)


class ReleasedZeroParameter(ZeroParameter):
    """A :class:`ZeroParameter` holding only its 0-element placeholder (its unit released, or partitioned by
    ``zero_init``); ``isinstance(p, ZeroParameter)`` and every ``ds_*`` property hold as for a gathered one."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """Torch's behaviour for a ``Parameter`` (results are plain tensors), except:

        * while a ``zero_init`` context is active on this thread, the context decides (:class:`ReleasedAccess`):
          it lets writes land in the partitioned value, and reads see the full value during a construction;
        * otherwise an in-place write into a released parameter (e.g. ``torch.nn.init.normal_(p)`` or
          ``p.fill_(0)`` under ``no_grad``) raises :class:`PartitionedWriteError` naming it instead of writing
          nothing: the value would otherwise vanish without a trace. ``p.data`` is a :class:`ReleasedData`,
          whose in-place writes (``p.data.fill_(0)``) raise the same error."""
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
            if writes and is_released(p):
                raise _write_error(func.__name__, p)
        elif _is_data_getter(func) and args and is_released(args[0]):
            return ReleasedData(args[0])
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs)


class ReleasedData(torch.Tensor):
    """``p.data`` of a released partitioned parameter ``p``: its 0-element placeholder (a plain tensor for every
    read), whose in-place writes raise :class:`PartitionedWriteError` naming ``p`` (``p.data.fill_(0)`` would
    otherwise write nothing, silently). Holds ``p`` weakly (``param``)."""

    def __new__(cls, p: torch.Tensor):
        with torch._C.DisableTorchFunctionSubclass():
            placeholder = p.data
        return torch.Tensor._make_subclass(cls, placeholder, False)

    def __init__(self, p: torch.Tensor):
        self.param = weakref.ref(p)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """Torch's behaviour on the placeholder (plain tensors out), except that an in-place write raises."""
        kwargs = kwargs or {}
        if _writes(func):
            t = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
            p = t.param() if isinstance(t, ReleasedData) else None
            if p is not None and is_released(p):
                raise _write_error(func.__name__, p, through=".data")
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs)

    def __reduce_ex__(self, proto):
        with torch._C.DisableTorchFunctionSubclass():  # pickles as the plain placeholder
            return torch.Tensor(self).__reduce_ex__(proto)


def _is_data_getter(func) -> bool:
    """Whether ``func`` is the getter of ``Tensor.data`` (torch passes a property's ``__get__``)."""
    return getattr(func, "__name__", "") == "__get__" and getattr(func, "__self__", None) is torch.Tensor.data


def _write_error(what: str, p: torch.Tensor, through: str = "") -> PartitionedWriteError:
    found = registry.lookup(p)
    name = f"{found.slot.name!r} " if found is not None else ""
    return PartitionedWriteError(
        f"{what} on partitioned parameter {name}{through and f'(through {through}) '}of shape {tuple(p.ds_shape)} "
        "outside its module's forward: only this rank's partition exists here, so the write would be lost. Write "
        "inside `with GatheredParameters(params, modifier_rank=0):` (zero.zero / deepspeed.zero)"
    )


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
    """An in-place write into a released partitioned parameter (see ``ReleasedZeroParameter.__torch_function__``)."""


_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad", "resize_", "set_"})
_DUNDER_WRITES = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__"})


def _writes(func) -> bool:
    """Whether ``func`` writes into its first argument's values (torch's trailing-underscore convention)."""
    name = getattr(func, "__name__", "")
    if name.startswith("__"):
        return name in _DUNDER_WRITES
    return name.endswith("_") and name not in _NOT_WRITES


def adopt(p: torch.nn.Parameter) -> None:
    """Make ``p`` a :class:`ZeroParameter` (in place; :class:`ReleasedZeroParameter` while it holds no elements)
    with the next ``ds_id``, once; called where a parameter is partitioned (collective there, so ids advance alike
    on every rank)."""
    rec = record_for(p)
    if rec.ds_id is not None:
        return
    if type(p) is torch.nn.Parameter:
        p.__class__ = ReleasedZeroParameter if held_numel(p) == 0 else ZeroParameter
    rec.ds_id = next(_NEXT_ID)
