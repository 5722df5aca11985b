"""What a torch function applied to a parameter that ``zero_init`` partitioned and released does while the context
is active (``zero_core.partitioned_param.ReleasedAccess``): it lands in the partitioned value or sees the full
value, as it would in a dense build, instead of acting on the 0-element placeholder.

``zero_init`` partitions each module's parameters as that module's ``__init__`` returns, so code that runs later in
an enclosing ``__init__`` (a subclass editing its parent's weights, Hugging Face's ``post_init`` initialising and
tying every weight of the model at the end of the top module's ``__init__``) meets released parameters:

* an in-place write into one (``torch.nn.init.normal_(p)``, ``p.zero_()``, ``p.copy_(src)``) gathers that one
  parameter (all-gather; nothing to gather when the function overwrites every element), applies the function on
  every rank (each rank draws the full tensor, so random number generators advance as in a dense build), and
  partitions the result again from the group's rank 0, as the first partition did: the shards equal those of a
  dense build partitioned at the end, bitwise, one parameter whole at a time. This holds anywhere in the context.
* during a construction, a shape query (``p.shape``, ``p.size(1)``, ``p.dim()``, ``p.numel()``) answers the full
  shape from the record, without communication; any other function reading a released parameter gathers it first.
  A result that does not share the full value's memory (``p.sum()``, ``p.clone()``) releases it right away; one
  that does (``p.data``, ``p[0]``, ``p.view(...)``, ``p.detach()``: writes through it must land) keeps the parameter
  whole until the innermost ``__init__`` in progress returns, which partitions it again from rank 0.
* outside a construction, reads act on the placeholder (DeepSpeed's behaviour); use ``GatheredParameters``.

Each gather, and each partition after the function ran, is preceded by an agreement (``zero_comm.agree``), so a
rank whose construction failed is never waited for by the others; a function raising on one rank raises on every
rank (``GroupOperationError``).
Parameters cast by ``zero_init(dtype=...)`` are written in the dtype they were built in and cast again, so a
function that overwrites every element gives what a dense build followed by the cast gives.
"""

from __future__ import annotations

from typing import Protocol

import torch

from zero_comm import agree
from zero_core.partition_records import PartitionedParam, forget, gather_partitioned, partitioned_record
from zero_core.partitioned_param import held_numel, is_released

# torch functions that write every element of their first argument whatever it held: nothing to gather first
_OVERWRITES = frozenset({
    "normal_", "uniform_", "zero_", "fill_", "constant_", "zeros_", "ones_", "eye_", "orthogonal_",
    "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "trunc_normal_",
})  # fmt: skip
_SHAPE_METHODS = frozenset({"numel", "nelement", "dim", "ndimension", "size"})
_SHAPE_GETTERS = frozenset({"shape", "ndim"})
_VALUE_GETTERS = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})
# neither the values nor the shape: the placeholder answers as the full value would
_METADATA = frozenset({
    "__hash__", "requires_grad_", "retain_grad", "register_hook", "element_size", "is_floating_point",
    "is_complex", "get_device", "__reduce_ex__", "_is_view", "__setstate__",
})  # fmt: skip


class Construction(Protocol):
    """What :class:`BuildAccess` asks the ``zero_init`` context it serves."""

    dtype: torch.dtype | None

    def building(self) -> bool:
        """Whether some module's ``__init__`` is in progress."""
        ...

    def keep_whole(self, p: torch.nn.Parameter) -> None:
        """Partition ``p`` (now whole, with its record) again when the innermost ``__init__`` in progress returns."""
        ...

    def freed(self, nbytes: int) -> None:
        """``nbytes`` of full host values were just freed (given back to the OS in batches)."""
        ...

    def partition(self, p: torch.nn.Parameter) -> PartitionedParam:
        """Partition ``p`` (whole, without a record) over the context's group: collective, rank 0's values."""
        ...


class BuildAccess:
    """The ``ReleasedAccess`` of one ``zero_init`` context (see the module docstring)."""

    def __init__(self, construction: Construction):
        self.construction = construction

    def access(self, func, types, args: tuple, kwargs: dict, writes: bool):
        """``func``'s result when it touches released parameters of this context; NotImplemented otherwise."""
        name = getattr(func, "__name__", "")
        if name in ("__get__", "__set__"):  # a tensor property: which one
            attr = getattr(getattr(func, "__self__", None), "__name__", "")
            if name == "__set__" or attr not in _VALUE_GETTERS | _SHAPE_GETTERS:
                return NotImplemented
            name = attr
        if name in _METADATA:
            return NotImplemented
        with torch._C.DisableTorchFunctionSubclass():
            params = _released_among(args, kwargs)
            if not params or not (writes or self.construction.building()):
                return NotImplemented
            if name in _SHAPE_METHODS | _SHAPE_GETTERS and args and args[0] is params[0]:
                return _shape_answer(name, partitioned_record(params[0]), args[1:], kwargs)
            target = args[0] if writes and args else next(iter(kwargs.values()), None) if writes else None
            return self._apply(func, types, args, kwargs, params, target, name in _OVERWRITES)

    def _apply(self, func, types, args, kwargs, params, target, overwrite: bool):
        """``func`` applied to the full values of ``params``; ``target`` (written) is partitioned again after."""
        group = partitioned_record(params[0]).group
        gathers = not (overwrite and len(params) == 1 and params[0] is target)
        if gathers:  # no rank may have failed elsewhere before a gather
            agree("zero_init", None, group)
        values, out, error = {}, None, None  # the full values of the parameters only read
        try:
            for p in params:
                value = self._full(p, overwrite=overwrite and p is target)
                if p is not target:  # the target's is freed when it is partitioned again
                    values[id(p)] = value
            del value
            out = torch._C._disabled_torch_function_impl(func, types, args, kwargs)
        except Exception as e:  # noqa: BLE001 - told to every rank just below
            error = e
        try:
            agree("zero_init", error, group)
        except BaseException:
            for p in params:
                _release(p)
            raise
        for p in params:
            if p is target:
                self.repartition(p)
            elif self.construction.building() and _aliases(out, values[id(p)]):
                self.construction.keep_whole(p)  # a view of it was handed out: writes through it must land
            else:
                _release(p)
        return out

    def _full(self, p: torch.nn.Parameter, overwrite: bool) -> torch.Tensor:
        """Make ``p`` hold its full value (in the dtype it was built in) and return that value."""
        rec = partitioned_record(p)
        dtype = rec.built_dtype or rec.dtype
        if overwrite:
            value = torch.empty(rec.shape, dtype=dtype, device=rec.shard.device)
        else:
            value = gather_partitioned(p).to(dtype)  # a fresh buffer: the gather's
        p.data = value
        return value

    def repartition(self, p: torch.nn.Parameter) -> None:
        """Partition ``p`` (whole, holding a record from an earlier partition) again from rank 0's values."""
        with torch._C.DisableTorchFunctionSubclass():
            old = partitioned_record(p)
            freed = p.numel() * p.element_size() if p.device.type == "cpu" else 0
            forget(p)
            partition = self.construction.partition(p)
            partition.partitions = old.partitions + 1
        self.construction.freed(freed)


def _released_among(args: tuple, kwargs: dict) -> list[torch.nn.Parameter]:
    """The released ``zero_init`` parameters among the arguments (and inside list or tuple arguments), once each."""
    found: list[torch.nn.Parameter] = []
    for a in (*args, *kwargs.values()):
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, torch.Tensor) and is_released(t) and not any(t is f for f in found):
                rec = partitioned_record(t)
                if rec is not None and rec.shard is not None:  # not a runtime's, not deferred
                    found.append(t)
    return found


def _shape_answer(name: str, rec: PartitionedParam, rest: tuple, kwargs: dict):
    """The full value's answer to a shape query, from its record."""
    if name in ("numel", "nelement"):
        return rec.numel
    if name in ("dim", "ndimension", "ndim"):
        return len(rec.shape)
    if name == "size":
        d = rest[0] if rest else kwargs.get("dim")
        return rec.shape if d is None else rec.shape[d]
    return rec.shape


def _aliases(out, value: torch.Tensor) -> bool:
    """Whether ``out`` (a result, possibly a sequence) shares ``value``'s memory."""
    ptr = value.untyped_storage().data_ptr()
    items = out if isinstance(out, (list, tuple)) else (out,)
    return any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == ptr for t in items)


def _release(p: torch.nn.Parameter) -> None:
    """Put ``p``'s placeholder back (its record holds its value)."""
    rec = partitioned_record(p)
    if rec is not None and held_numel(p) != 0:
        with torch._C.DisableTorchFunctionSubclass():
            p.data = torch.empty(0, dtype=rec.dtype, device=rec.shard.device)
