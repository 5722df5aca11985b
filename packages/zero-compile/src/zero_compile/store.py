"""``UnitStore``: the runtime state behind the graph operations (gathered buffers, handles in flight, counters).

The graph operations (``zero_compile.ops``) are global ``torch.library`` ops; they find their store by the integer
id baked into the graph. A store is registered when built and unregistered by :meth:`UnitStore.close`, so nothing
outlives the compiled model. All collectives go through zero_comm (``all_gather_into_tensor`` and
``reduce_scatter_tensor`` with ``async_op=True``), so ``CommsLogger`` counts them.
"""

from __future__ import annotations

import itertools

import torch

from zero_comm import all_gather_into_tensor, reduce_scatter_tensor, reduce_scatter_uneven
from zero_compile.layout import ShardSource
from zero_core import registry
from zero_core.gather_batch import GatherBatch
from zero_core.layout import Bucket

_STORES: dict[int, UnitStore] = {}
_IDS = itertools.count(1)


def get_store(store_id: int) -> UnitStore:
    """The live store with this id. Raises KeyError naming it when it was closed (a graph outlived its model)."""
    try:
        return _STORES[store_id]
    except KeyError:
        raise KeyError(f"zero_compile store {store_id} is closed or was never built; the compiled graph that "
                       "names it belongs to a model whose compiled path was closed") from None  # fmt: skip


class UnitStore:
    """Gathered unit buffers and in-flight collectives of one compiled model on one rank.

    Args:
        source: the core's :class:`~zero_compile.layout.ShardSource` (layout, shards, gradient sink).
        group: the data-parallel process group.
        device: where gathered buffers are allocated.

    Attributes:
        keep: units that stay gathered between uses until :meth:`end_step` (selective unsharding).
        gathers: all-gather collectives issued (a fused start of several units counts once).
        reduces: reduce-scatter collectives issued.
        peak_gathered_bytes: the largest total of gathered buffers held at once since :meth:`reset_peak`.
    """

    def __init__(self, source: ShardSource, group, device: torch.device):
        self.source = source
        self.layout = source.layout
        self.layout.check()
        self.group = group
        self.device = device
        self.world = self.layout.world
        self.keep: frozenset[int] = frozenset()
        self.gathers = 0
        self.reduces = 0
        self.peak_gathered_bytes = 0
        self._live: dict[int, torch.Tensor] = {}
        self._cast: dict[int, torch.Tensor] = {}
        self._pending: dict[int, object] = {}
        self._reducing: list = []
        self.profiles: list = []
        self.defer = False  # ZeRO-1 between accumulation boundaries: accumulate locally, reduce at the boundary
        self._local: dict[int, list] = {}
        self._unit_of: dict[Bucket, int] = {b: u for u, b in enumerate(self.layout.units)}  # buckets hash by identity
        # sizes read once, here: passes ask for them while tracing under a fake mode, where real tensors are off limits
        self._unit_bytes = [u.padded_numel * source.shard(i).element_size() for i, u in enumerate(self.layout.units)]
        self.id = next(_IDS)
        _STORES[self.id] = self

    def locate(self, p: object) -> tuple[int, int] | None:
        """``(unit, slot)`` of a parameter of this layout, found through ``zero_core.registry`` (O(1), weak keys:
        whoever laid the parameter out claimed it there); None for any other tensor or value."""
        found = registry.lookup(p)
        if found is None:
            return None
        unit = self._unit_of.get(found.bucket)
        return None if unit is None else (unit, found.slot_index)

    # -- sizes
    def padded_numel(self, unit: int) -> int:
        """Elements of the unit's full flat buffer."""
        return self.layout.units[unit].padded_numel

    def unit_bytes(self, unit: int) -> int:
        """Bytes of the unit's gathered buffer in the storage dtype."""
        return self._unit_bytes[unit]

    def gathered_bytes(self) -> int:
        """Bytes of gathered buffers this store holds now."""
        return sum(t.numel() * t.element_size() for t in self._live.values())

    def gathered_buffers(self) -> list[torch.Tensor]:
        """The gathered buffers this store holds now (full flat units and their casts)."""
        return [*self._live.values(), *self._cast.values()]

    def reset_peak(self) -> None:
        """Restart :attr:`peak_gathered_bytes` from what is held now."""
        self.peak_gathered_bytes = self.gathered_bytes()

    def resolve_units(self, hints: list[int], anchors: list[torch.Tensor]) -> list[int]:
        """The units of the parameter tensors ``anchors`` (the graph was traced for ``hints``; another instance of
        the same module class runs it with its own parameters). An anchor that is not one of the model's parameters
        (a copy, as ``torch.library.opcheck`` passes) stands for its hint when its shape and dtype are those of a
        parameter of that unit. Raises ValueError naming an anchor that fits neither, or a unit whose layout
        differs from the traced one (the graph's views would not fit)."""
        out = []
        for hint, anchor in zip(hints, anchors):
            found = self.locate(anchor)
            if found is None:
                self._check_stands_for(hint, [anchor])
                out.append(hint)
                continue
            unit = found[0]
            if unit != hint and _shape_of(self.layout.units[unit]) != _shape_of(self.layout.units[hint]):
                raise ValueError(f"zero_compile: a graph traced for unit {hint} runs with unit {unit}, whose "
                                 "parameters are laid out differently")  # fmt: skip
            out.append(unit)
        return out

    def _check_stands_for(self, unit: int, tensors: list[torch.Tensor], slots: list[int] | None = None) -> None:
        """ValueError unless each tensor has the shape and dtype of a parameter of ``unit`` (of ``slots[i]``)."""
        u = self.layout.units[unit]
        dtype = self.source.shard(unit).dtype
        for i, t in enumerate(tensors):
            shapes = [tuple(u.slots[slots[i]].shape)] if slots is not None else [tuple(s.shape) for s in u.slots]
            if tuple(t.shape) not in shapes or t.dtype != dtype:
                raise ValueError(f"zero_compile: unit {unit}: the graph's tensor of shape {tuple(t.shape)} and "
                                 f"dtype {t.dtype} is not a parameter of this model (expected one of shapes "
                                 f"{shapes}, dtype {dtype})")  # fmt: skip

    def reduce_params(self, hint: int, slots: list[int], grads: list[torch.Tensor], params: list[torch.Tensor]) -> None:
        """Reduce the gradients of ``params`` (one unit, traced as slots ``slots`` of unit ``hint``; see
        :meth:`reduce`). Parameters that are not the model's own (copies) stand for the traced slots when their
        shapes and dtypes match. Raises ValueError naming a tensor that fits neither or a unit mix-up."""
        found = [self.locate(p) for p in params]
        if all(f is None for f in found):
            if len(slots) != len(params):
                raise ValueError(f"zero_compile: unit {hint}: {len(params)} parameters but {len(slots)} slots")
            self._check_stands_for(hint, params, slots)
            self.reduce(hint, list(slots), grads)
            return
        for p, f in zip(params, found):
            if f is None:
                raise ValueError(f"zero_compile: unit {hint}: a gradient's parameter of shape {tuple(p.shape)} is "
                                 "not a parameter of this model")  # fmt: skip
        unit = found[0][0]
        if any(u != unit for u, _ in found):
            raise ValueError(f"zero_compile: unit {hint}: gradients of one reduce belong to several units")
        self.reduce(unit, [i for _, i in found], grads)

    # -- gathers
    def start(self, units: list[int]) -> None:
        """Issue the async all-gather of every unit not already gathered or in flight; several at once share one
        collective (their chunks side by side, copied out on wait)."""
        todo = [u for u in units if u not in self._live and u not in self._pending]
        if not todo:
            return
        shards = [self.source.shard(u) for u in todo]
        self.gathers += 1
        if len(todo) == 1:
            full = torch.empty(self.padded_numel(todo[0]), dtype=shards[0].dtype, device=self.device)
            handle = all_gather_into_tensor(full, shards[0].contiguous(), self.group, async_op=True)
            self._live[todo[0]] = full
            self._pending[todo[0]] = handle
        else:  # one collective for all of them (zero_core's GatherBatch, as stage 3's prefetch)
            send = torch.cat([s.reshape(-1) for s in shards])
            batch = GatherBatch({u: s.numel() for u, s in zip(todo, shards)}, send, self.group, self.world)
            for u, s in zip(todo, shards):
                self._live[u] = torch.empty(self.padded_numel(u), dtype=s.dtype, device=self.device)
                self._pending[u] = batch
        self._note_peak()

    def wait(self, unit: int, dtype: torch.dtype) -> torch.Tensor:
        """The unit's full flat buffer in ``dtype`` (gathered now if no start ran); see ``zero_compile.ops``."""
        if unit not in self._live and unit not in self._pending:
            self.start([unit])
        handle = self._pending.pop(unit, None)
        if handle is not None:
            handle.wait()
        if isinstance(handle, GatherBatch):  # copy out every unit of the batch still waiting on it
            for u in list(handle.offset):
                if u == unit or self._pending.get(u) is handle:
                    self._pending.pop(u, None)
                    handle.copy_out(u, self._live[u])
        full = self._live[unit]
        if full.dtype == dtype:
            return full
        cast = self._cast.get(unit)
        if cast is None:
            cast = self._cast[unit] = full.to(dtype)
        return cast

    def release(self, unit: int) -> None:
        """Drop the unit's gathered buffer, unless it is kept (selective unsharding) or still in flight."""
        if unit in self.keep or unit in self._pending:
            return
        self._live.pop(unit, None)
        self._cast.pop(unit, None)

    def note_profile(self, profile) -> None:
        """Keep the latest profiling-interpreter result of each run (a warm-up figure; the last 64 are kept)."""
        self.profiles = (self.profiles + [profile])[-64:]

    def _note_peak(self) -> None:
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes())

    # -- gradients
    def reduce(self, unit: int, slots: list[int], grads: list[torch.Tensor]) -> None:
        """Reduce-scatter (rank average, asynchronously) the gradients of the unit's parameters ``slots``: the whole
        unit when every slot is given, else only the bucket range from the first given slot to the end of the last
        (a piece, ``passes/zero1.py``; an uneven reduce-scatter hands each rank its part of its chunk). Slots in
        that range that are not given count as zero. :meth:`flush` adds this rank's part into the core's
        gradient shard. Buffers are ``empty`` with only the gaps zeroed (no memset of a whole bucket per call)."""
        u = self.layout.units[unit]
        if len(grads) != len(slots):
            raise ValueError(f"reduce_grads: unit {unit}: {len(slots)} slots but {len(grads)} gradients")
        for i, g in zip(slots, grads):
            if g.numel() != u.slots[i].numel:
                raise ValueError(f"reduce_grads: gradient of {u.slots[i].name!r} has {g.numel()} elements, "
                                 f"expected {u.slots[i].numel}")  # fmt: skip
        dtype = self.source.reduce_dtype or (grads[0].dtype if grads else torch.float32)
        if len(set(slots)) == len(u.slots):
            lo, hi = 0, u.padded_numel
        else:
            lo = min(u.slots[i].bucket_offset for i in slots)
            hi = max(u.slots[i].bucket_offset + u.slots[i].numel for i in slots)
        held = self._local.get(unit)
        if self.defer:
            if held is None:
                held = self._local[unit] = [torch.zeros(u.padded_numel, dtype=dtype, device=self.device), set()]
            for i, g in zip(slots, grads):
                s = u.slots[i]
                held[0][s.bucket_offset : s.bucket_offset + s.numel].add_(g.reshape(-1))
            held[1].update(slots)
            return
        part = torch.empty(hi - lo, dtype=dtype, device=self.device)
        pos = lo
        for i, g in sorted(zip(slots, grads), key=lambda ig: u.slots[ig[0]].bucket_offset):
            s = u.slots[i]
            if s.bucket_offset > pos:
                part[pos - lo : s.bucket_offset - lo].zero_()
            part[s.bucket_offset - lo : s.bucket_offset - lo + s.numel].copy_(g.reshape(-1))
            pos = s.bucket_offset + s.numel
        if hi > pos:
            part[pos - lo :].zero_()
        if held is not None:  # ZeRO-1: the micro-steps before the boundary, held back, join this reduce
            part.add_(held[0][lo:hi])
            inside = {i for i in held[1] if lo <= u.slots[i].bucket_offset < hi}
            slots = sorted(inside.union(slots))
            held[1].difference_update(inside)
            if held[1]:
                held[0][lo:hi].zero_()
            else:
                del self._local[unit]
        self._issue_reduce(unit, part, lo, list(slots))

    def reduce_deferred(self) -> None:
        """Reduce-scatter what :attr:`defer` held back (unit order, the same on every rank)."""
        held, self._local = self._local, {}
        for unit in sorted(held):
            flat, slots = held[unit]
            self._issue_reduce(unit, flat, 0, sorted(slots))

    def drop_deferred(self) -> None:
        """Forget locally accumulated gradients (``zero_grad`` between boundaries)."""
        self._local.clear()

    def _issue_reduce(self, unit: int, part: torch.Tensor, lo: int, slots: list[int]) -> None:
        """Start the reduce-scatter of bucket elements ``[lo, lo + part.numel())`` of ``unit``."""
        u = self.layout.units[unit]
        hi, c, rank = lo + part.numel(), u.chunk, self.layout.rank
        if lo == 0 and hi == u.padded_numel:
            chunk, offset = torch.empty(c, dtype=part.dtype, device=self.device), 0
            handle = reduce_scatter_tensor(chunk, part, self.group, op="avg", async_op=True)
        else:
            splits = [max(0, min(hi, (r + 1) * c) - max(lo, r * c)) for r in range(self.world)]
            offset = max(lo, rank * c) - rank * c if splits[rank] else 0
            chunk = torch.empty(splits[rank], dtype=part.dtype, device=self.device)
            handle = reduce_scatter_uneven(chunk, part, splits, self.group, op="avg", async_op=True)
        self.reduces += 1
        self._reducing.append((unit, chunk, handle, part, slots, offset))

    def flush(self) -> None:
        """Wait for every reduce-scatter in flight and add each result into the core's gradient shard, in issue
        order (the same on every rank, so sums are bitwise reproducible); the core hears that a unit's gradient
        is ready once, with its last piece."""
        pending, self._reducing = self._reducing, []
        last = {rec[0]: k for k, rec in enumerate(pending)}
        for k, (unit, chunk, handle, _part, slots, offset) in enumerate(pending):
            handle.wait()
            self.source.add_grad_shard(unit, chunk, slots, offset=offset, ready=last[unit] == k)

    # -- lifecycle
    def end_step(self) -> None:
        """Parameters changed (an optimizer step or a checkpoint load): drop every gathered buffer, kept or not."""
        for handle in list(self._pending.values()):
            handle.wait()
        self._pending.clear()
        self._live.clear()
        self._cast.clear()

    def close(self) -> None:
        """Finish what is in flight and unregister: graphs naming this store then fail with a clear KeyError."""
        self.flush()
        self.end_step()
        _STORES.pop(self.id, None)


def _shape_of(unit) -> tuple:
    return unit.padded_numel, tuple((s.bucket_offset, s.numel, tuple(s.shape)) for s in unit.slots)
