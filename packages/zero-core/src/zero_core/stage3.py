"""ZeRO stage 3: parameters sharded, gathered per unit just before a module runs and released after.

A *unit* is a bucket of one flat group holding the parameters a module owns directly (FSDP1-style), so one
all-gather materialises a module. Parameters with at most ``stage3_param_persistence_threshold`` elements go to
*persistent* buckets that stay gathered (refreshed after each step). Each unit's full buffer is allocated once;
releasing frees its storage (``resize_(0)``) and gathering re-allocates the same storage, so views autograd saved
during forward (``weight.t()`` in a linear) see the re-gathered values in backward (PyTorch FSDP1 frees flat
parameters the same way). While gathered, each parameter's ``.data`` is a view of the buffer; while released it is
an empty tensor, so code that reads a released parameter sees ``numel() == 0`` instead of freed memory. Swapping
``.data`` is unavoidable: the module and the optimizer hold the ``Parameter`` objects. A unit's runtime state
(buffer, ``ShardState``, gather in flight) is one ``UnitBuffer``; the forward order one ``ForwardRecord``.

Ranks that run different modules raise ``RankDivergenceError`` on every rank instead of pairing different
units (silently wrong) or different sizes (gloo aborts the process); ``zero_core.divergence`` holds the checks, on a
side gloo group so a check never meets a unit's all-gather. Until the first step ends, and while a pass departs
from the recorded order, every gather is checked first (one 4-integer all-gather); on a pass that follows the record
only a running hash of the forward's units is compared, once: issued when backward begins and compared before the
backward's first gather or reduction, so the rank whose forward ends first does not wait there for the other. A
rank whose next unit departs from the record checks before gathering; a rank still following the record meets it
when its own gather times out.
Prefetch: the forward order of units is recorded on the first pass; afterwards each forward gather also issues
asynchronous gathers of the next units in that order, up to ``stage3_prefetch_bucket_size`` elements and
``stage3_max_live_parameters`` elements gathered in all, and each backward gather prefetches the units recorded
before it (backward runs in reverse). The units one prefetch issues are gathered together, one collective per run of
at most :data:`GATHER_BATCH_BYTES` (``zero_core.gather_batch``, DeepSpeed's coalesced prefetch gather; units of
:data:`GATHER_ALONE_BYTES` or more are gathered alone, straight into their buffer; not with
offload, where memory comes first: ``ZeroConfig.offloads``). A pass that departs from the record drops prefetching
and records again.
Shared shards (``stage3_shared_shards``, zero's own key, opt-in): when every rank is on one host (CPU, gloo; not with
qwZ/hpZ or offload) each rank's stored shard lives in a ``zero_comm.window`` that the peers map, so gathering a
unit copies every rank's chunk straight from its shard (the all-gather's bytes, no collective and no gloo thread
taking CPU from compute: Llama 20m's forward on 2 ranks of 2 cores paid about 60 ms a step for its all-gathers).
Such units are not prefetched (the copy runs on the calling thread either way). Writes to the shards are fenced:
after materialising, after ``refresh`` (a step or a load) and after ``GatheredParameters`` edits; before writes
outside a step (``before_write``). A step's own writes need no fence before them: they follow the gradient-norm
all-reduce, which every peer joins only after its last gather of the pass.
Reuse (DeepSpeed's ``stage3_max_reuse_distance``): after its module's forward, a unit whose next use, in the
recorded forward sequence or (while autograd records) in the backward that follows, comes within that many
elements of other gathers stays gathered, while the live elements allow (``_reused_soon``); a unit read from a
shared window is released after every use (re-reading it is a copy; keeping it, a second copy of mapped shards).
``stage3_max_live_parameters`` bounds the gathered non-persistent elements: prefetch (forward and backward) stops
there, and a gather that would pass it first releases the units kept for reuse (a single unit larger than the limit
is still gathered: its module needs it).
"""

from __future__ import annotations

import warnings

import torch
from torch.profiler import record_function

from zero_comm import CollectiveTimeout, all_gather_into_tensor
from zero_comm.window import SharedWindow, shared_window
from zero_core import registry
from zero_core.divergence import DivergenceCheck, RankDivergenceError
from zero_core.external import ReleasedReadCheck
from zero_core.forward_record import ForwardRecord
from zero_core.frozen_quant import QuantizedFrozenChunks, init_asked_quantized
from zero_core.gather_batch import GatherBatch
from zero_core.layout import Bucket, FlatGroup
from zero_core.materialize import HOST_THRESHOLDS, bucket_values, return_freed_host_memory
from zero_core.partition_records import forget
from zero_core.partitioned_param import adopt
from zero_core.shard_state import BACKWARD, FORWARD, STEP, ShardState
from zero_core.stage3_readout import PartitionReadout
from zero_core.tree import output_tensors
from zero_core.unit_buffer import UnitBuffer
from zero_core.unit_plan import plan_units

# Most bytes one prefetch all-gather carries (the gathered size; DDP's 25 MiB bucket, as the reducer's pieces): on
# Llama 20m, 2 gloo ranks, 77 forward all-gathers become 11 and the forward 0.30 -> 0.28 s (8 MiB measured no better)
GATHER_BATCH_BYTES = 25 * 2**20
# Units of at least this many gathered bytes are gathered alone, straight into their full buffer: a batch's output
# is copied out once more, and from 2 MiB that copy costs more than the collectives saved (gloo, 2 ranks: a
# broadcast call costs about 0.1 ms of the caller's CPU, a copy about 0.2 ms per MiB; Llama 20m with one unit per
# decoder layer, 12.6 MB each, copied 79 MB per step out of batches)
GATHER_ALONE_BYTES = 2 * 2**20

__all__ = ["RankDivergenceError", "ShardState", "Stage3", "lookup", "plan_units"]


def _eager(hook):
    """``hook`` run eagerly under ``torch.compile`` (Dynamo cannot trace collectives or ``.data`` swaps). Wrapped
    when the hook is registered, not at import: ``torch.compiler.disable`` imports Dynamo, seconds of start-up that
    a process never compiling (the ``zero`` CLI, a launcher) should not pay."""
    return torch.compiler.disable(hook)


class Stage3(PartitionReadout):
    """Materialises sharded storage, installs module hooks and gathers/releases units for one runtime.

    Runtime state, per unit: ``units[Bucket.index]``, a :class:`UnitBuffer` (the compute-dtype buffer its
    parameters view, storage freed while released; its :class:`ShardState`; the gather in flight; the layout itself
    is frozen); the forward's unit order: ``record``, a :class:`ForwardRecord`; per flat group
    (``FlatGroup.index``) ``param_shard``, this rank's stored shard in the storage dtype (the master's source and,
    when the dtypes match, the master itself).
    """

    batches_gathers = True  # a store whose chunks come from host memory or NVMe (zero_offload) gathers one by one
    offloaded = False  # stored shards on the compute device (zero_offload's stores: off it)
    gathers_units = True

    def __init__(self):
        self.rt = None
        self.group = None
        self.world, self.rank = 1, 0
        self.prefetch_numel = self.max_live = self.reuse_distance = 0  # from the config at attach
        self._hooks: list = []  # every hook handle this store installed, removed by close()
        self.record = ForwardRecord()
        self.phase = FORWARD
        self.gathers = 0  # all-gathers issued (units gathered from a shared window included)
        self.kept: set[Bucket] = set()  # gathered past their module's forward for a near reuse
        self.pinned: dict[Bucket, int] = {}  # units that must stay gathered (counted holds)
        self.held: dict[Bucket, int] = {}  # units a GatheredParameters block holds (also counted in pinned)
        self.needs: dict[torch.nn.Module, list[Bucket]] = {}  # module -> the units its forward gathers
        self.external: dict[torch.nn.Module, set[Bucket]] = {}  # module -> units it reads that others own
        self._sharded_names: dict[int, str] = {}  # id(param) -> name, for parameters of non-persistent units
        self._check: ReleasedReadCheck | None = None
        self.divergence: DivergenceCheck | None = None
        self.units: list[UnitBuffer] = []  # per Bucket.index: the unit's buffer, state and gather in flight
        self._live = 0  # elements of non-persistent units not SHARDED (live_numel)
        self.param_shard: list[torch.Tensor | None] = []
        self.windows: list[SharedWindow | None] = []  # per flat group: the shared window holding param_shard
        # zero_quantized_nontrainable_weights: the frozen units' chunks held as int8 blocks (param_shard None there)
        self.frozen_q: QuantizedFrozenChunks | None = None

    def __deepcopy__(self, memo):
        """The store itself: ``copy.deepcopy`` of a hooked module copies its hooks, bound to this store, which
        then do nothing for the copy (not a module it manages; its parameters are whole copies: see
        ``zero_core.partitioned_param``). A store is one per runtime and holds process groups: never copied."""
        return self

    def _set_state(self, b: Bucket, state: ShardState) -> None:
        """Set ``b``'s state, keeping the count of gathered non-persistent elements (``live_numel``) in step."""
        if not b.persistent:
            was = self.units[b.index].state is not ShardState.SHARDED
            self._live += b.padded_numel * ((state is not ShardState.SHARDED) - was)
        self.units[b.index].state = state

    def state_of(self, b: Bucket) -> ShardState:
        """Whether unit ``b`` is gathered, being gathered or released."""
        return self.units[b.index].state

    def hold(self, b: Bucket) -> None:
        """A block (``GatheredParameters``, ``gathered_for_compute``) holds gathered unit ``b``: no release, and
        module forwards inside leave it alone. Counted: blocks nest."""
        self.pinned[b] = self.pinned.get(b, 0) + 1
        self.held[b] = self.held.get(b, 0) + 1

    def unhold(self, b: Bucket) -> None:
        """The block that called :meth:`hold` ends (the caller releases ``b`` if it should)."""
        self.pinned[b] -= 1
        self.held[b] -= 1

    def mark_stale(self, b: Bucket) -> None:
        """``b``'s gathered values are not its stored shard's (a qwZ copy, or values before a step): the next
        ``gather`` fetches them again (its buffer keeps its storage until then)."""
        self._set_state(b, ShardState.SHARDED)

    def full_of(self, b: Bucket) -> torch.Tensor:
        """Unit ``b``'s full buffer (``padded_numel`` elements, compute dtype; empty storage while released)."""
        return self.units[b.index].full

    def attach(self, runtime) -> None:
        """Materialise the units from the module's current weights (or zero_init records) and install hooks."""
        self.rt = runtime
        self.group = runtime.group
        self.world, self.rank = runtime.world, runtime.rank
        cfg = runtime.config
        self.prefetch_numel = cfg.stage3_prefetch_bucket_size
        self.max_live = cfg.stage3_max_live_parameters
        self.reuse_distance = cfg.stage3_max_reuse_distance
        self.divergence = DivergenceCheck(self.group, self.world, self.rank)
        if cfg.zero_quantized_nontrainable_weights or init_asked_quantized(runtime.flat_groups):
            self.frozen_q = QuantizedFrozenChunks(self.group, block=cfg.zeropp_block_size,
                                                  quantizer=cfg.zeropp_quantizer)  # fmt: skip
        self._materialize()
        owner = {id(s.param): b for g in runtime.flat_groups for b in g.buckets for s in b.slots}
        for g in runtime.flat_groups:
            for b in g.buckets:
                if not b.persistent:
                    self._add_need(runtime.unit_owner[id(b.slots[0].param)], b)
        # a tied parameter is also gathered by every other module holding it, unless that module runs inside
        # the forward of its unit's owner (a coarse unit is already gathered there)
        inside: dict = {}
        for m in runtime.module.modules():
            for d in m.modules():
                inside.setdefault(d, set()).add(m)
        for m in runtime.module.modules():
            for p in m.parameters(recurse=False):
                b = owner.get(id(p))
                if b is not None and not b.persistent and runtime.unit_owner[id(b.slots[0].param)] not in inside[m]:
                    self._add_need(m, b)
        self._sharded_names = {id(s.param): s.name for g in runtime.flat_groups for b in g.buckets for s in b.slots
                               if not b.persistent}  # fmt: skip
        self._hooks.append(runtime.module.register_forward_pre_hook(_eager(self._check_first_pass), prepend=True))
        # always_call: a forward that raises (e.g. RankDivergenceError) must not leave the check mode active
        self._hooks.append(runtime.module.register_forward_hook(_eager(self._end_first_pass), always_call=True))
        if runtime.forward_only:  # no backward ends the pass: the model's own forward does (not when it raised)
            self._hooks.append(runtime.module.register_forward_hook(_eager(self._end_forward_pass)))
        # torch marks the hook function itself, so it must be a plain function, not a bound method
        self._hooks.append(runtime.module.register_state_dict_post_hook(lambda *a: self._warn_released(*a)))
        for g in runtime.flat_groups:
            for s in g.slots:
                adopt(s.param)  # ds_* properties answered by param_status / param_shape / param_partition

    def add_external(self, m: torch.nn.Module, b: Bucket) -> None:
        """``m``'s forward reads ``b``'s parameters though another module owns them: gather and pin it there."""
        self._add_need(m, b)
        self.external.setdefault(m, set()).add(b)

    @property
    def checks_released_reads(self) -> bool:
        """True while the next forward runs under ``ReleasedReadCheck`` (a torch function mode): until the first
        backward records the unit order. A mode entered outside Dynamo breaks its tracing of tensor attributes
        (torch 2.13 reads ``x.device`` as a ``torch.Size``), so ``torch.compile`` callers run such a forward eagerly
        (zero's engine under ``torch_compile`` does)."""
        return self.record.order is None

    def _check_first_pass(self, module, args) -> None:
        if self.record.order is None and self._check is None and torch._C._current_graph_task_id() == -1:
            self._check = ReleasedReadCheck(self._sharded_names)
            self._check.__enter__()

    def _end_first_pass(self, module=None, args=None, output=None) -> None:
        if self._check is not None:
            check, self._check = self._check, None
            check.__exit__(None, None, None)

    def _end_forward_pass(self, module, args, output) -> None:
        """Forward-only runtime (no optimizer): the model's forward returned, which ends a pass as ``end_backward``
        does for training: the ranks' unit order is compared (one small all-gather on the side group), the first
        pass's order is recorded for prefetching the next ones, and every unit still gathered is released.

        Raises:
            RankDivergenceError: on every rank, when the ranks' forwards gathered different units."""
        if torch._C._current_graph_task_id() != -1 or not self.record.pass_sequence:
            return  # nothing gathered this pass (a GatheredParameters block holds every unit): nothing to compare
        self.begin_backward()
        self.end_backward()

    def _add_need(self, m: torch.nn.Module, b: Bucket) -> None:
        """``m``'s forward gathers ``b`` before it runs and releases it after (hooks installed once per module)."""
        if m not in self.needs:
            self.needs[m] = []
            self._hooks.append(m.register_forward_pre_hook(_eager(self._pre_forward)))
            self._hooks.append(m.register_forward_hook(_eager(self._post_forward)))
        if b not in self.needs[m]:
            self.needs[m].append(b)

    # ---------------------------------------------------------------- storage
    @torch.no_grad()
    def _materialize(self) -> None:
        p = self.rt.precision
        self.units = [None] * sum(len(g.buckets) for g in self.rt.flat_groups)
        self._live = 0
        self.param_shard = [None] * len(self.rt.flat_groups)
        self.windows = [None] * len(self.rt.flat_groups)
        if any(g.device.type == "cpu" for g in self.rt.flat_groups):
            # serving and offloaded parameters (memory first): released unit buffers must not turn the forward's
            # allocations into resident heap; training: heap reuse, as fresh mappings for every activation cost
            # more step time than the RSS they save
            memory_first = self.rt.forward_only or self.offloaded
            HOST_THRESHOLDS.pin() if memory_first else HOST_THRESHOLDS.for_training()
        for g in self.rt.flat_groups:
            quantized = self.quantizes(g)
            if not quantized:
                self._begin_shard(g)
            for b in g.buckets:
                full = torch.empty(b.padded_numel, dtype=p.compute, device=g.device)
                bucket_values(b, self.group, p.param_dtype, full)  # one collective (zero_init: no broadcast)
                lo, hi = b.chunk_range(g.rank)
                (self.frozen_q.store if quantized else self._keep_chunk)(b, full[lo:hi])
                unit = self.units[b.index] = UnitBuffer(b, full)
                unit.point_params()
                for s in b.slots:
                    forget(s.param)
                self._set_state(b, ShardState.GATHERED)
                if not b.persistent:
                    self.release(b)
                if g.device.type == "cpu":  # the records and temporaries freed: before the next unit's pages
                    return_freed_host_memory()
        self._fence()  # the stored chunks are written: peers may read them
        self.rt.zeropp.refresh_secondary(self.rt.flat_groups, self.param_shard)
        if self.rt.zeropp.gathers_specially or self.frozen_q is not None:  # persistent units hold gathered values
            self._regather_persistent()

    def quantizes(self, g: FlatGroup) -> bool:
        """``g``'s shard is held as int8 blocks in ``frozen_q`` (``param_shard[g.index]`` None): frozen, key on."""
        return self.frozen_q is not None and QuantizedFrozenChunks.holds_group(g)

    def _begin_shard(self, g: FlatGroup) -> None:
        """Materialisation: allocate where ``g``'s stored shard lives (a parameter store off the device keeps its
        own storage and allocates no device shard)."""
        dtype = self.rt.precision.param_dtype
        window = self._shared_window(g, dtype)
        self.windows[g.index] = window
        if window is not None:
            self.param_shard[g.index] = window.local  # zero-filled (untouched pages of a fresh segment)
        else:
            # empty: the bucket chunks tile the shard and _keep_chunk writes each one, so pages become resident
            # unit by unit while the zero_init records they replace are freed, not all at once up front
            self.param_shard[g.index] = torch.empty(g.shard_numel, dtype=dtype, device=g.device)

    def _shared_window(self, g: FlatGroup, dtype: torch.dtype) -> SharedWindow | None:
        """``g``'s shared-memory window (``stage3_shared_shards``), or None: gathers then all-gather. Collective;
        every input to the choice is the same on every rank (config, world, device type)."""
        setting = self.rt.config.stage3_shared_shards
        cfg = self.rt.config
        if setting is False or self.world == 1 or g.device.type != "cpu":
            return None
        why = None
        if self.rt.zeropp.gathers_specially:
            why = "ZeRO++ qwZ/hpZ gather their own way"
        elif cfg.offloads:
            why = "an offload section is set (memory first: shards stay in their own storage)"
        window = None if why else shared_window(self.group, g.shard_numel, dtype)
        if window is None and setting is True:
            why = (
                why
                or "the ranks cannot map one another's /dev/shm segments (several hosts, no space, or ZERO_COMM_SHM=0)"
            )
            warnings.warn(f"stage3_shared_shards: true, but stage 3 all-gathers instead: {why}", stacklevel=2)
        return window

    def _fence(self) -> None:
        """Every rank's writes to its stored shards so far are visible to every peer's reads after this (a barrier,
        only where shards live in shared windows). Collective."""
        if any(w is not None for w in self.windows):
            with record_function("zero::fence"):
                next(w for w in self.windows if w is not None).fence()

    def before_write(self) -> None:
        """The stored shards are about to be written outside a step (a load, a ``GatheredParameters`` edit): with
        shared windows, wait until no peer still reads them (a fence). The step itself needs none: every peer's
        gathers of the pass are done once the gradient-norm all-reduce, which precedes every step, has completed.
        Collective."""
        self._fence()

    def _keep_chunk(self, b: Bucket, chunk: torch.Tensor) -> None:
        """Materialisation: store this rank's starting ``chunk`` of unit ``b`` (called once per unit, in order, so
        a store can stream units to their storage one at a time)."""
        self.param_shard[b.group.index][b.shard_slice()] = chunk

    def release(self, b: Bucket) -> None:
        """Free ``b``'s full buffer (its parameters keep their shapes but must not be read until gathered)."""
        state = self.units[b.index].state
        if b.persistent or state is ShardState.SHARDED or self.pinned.get(b):
            return
        self.kept.discard(b)
        if state is ShardState.GATHERING:
            self._wait(b)
        with record_function("zero::release"):
            self.units[b.index].free()
            self._set_state(b, ShardState.SHARDED)

    def gather(self, b: Bucket, *, async_op: bool = False, phase: int | None = None, exact: bool = False) -> None:
        """Materialise ``b`` (idempotent). Collective: every rank must gather the same units in the same order.
        With ZeRO++ the gather runs through qwZ/hpZ (``zero_core.zeropp``) unless ``exact`` (plain all-gather of
        the stored shards: ``GatheredParameters``, whose values may be written back).

        Raises:
            RankDivergenceError: on every rank, when the ranks asked for different units (or phases).
        """
        state = self.units[b.index].state
        if state is ShardState.GATHERED:
            return
        if state is ShardState.GATHERING:
            if not async_op:
                self._wait(b)
            return
        phase = self.phase if phase is None else phase
        self.divergence.settle()  # a check in flight agrees before any unit moves
        if not self.record.steady:
            self.divergence.agree(b, phase)
        if self.kept and not b.persistent and self.live_numel() + b.padded_numel > self.max_live:
            for k in list(self.kept):  # make room: units kept for reuse are gathered again when needed
                self.release(k)
        window = self.windows[b.group.index] if self.windows else None
        if window is not None:
            self._read_window(b, window)
            return
        if self.frozen_q is not None and self.frozen_q.holds(b):
            self._gather_int8(b, async_op)
            return
        g = b.group
        unit = self.units[b.index]
        full = unit.full
        comm = self.rt.comm_ctx  # on CUDA: the all-gather stream, so a prefetch overlaps compute
        with record_function("zero::gather"), comm.on(comm.gather_stream) as event:
            src = self.gather_source(b)  # on the gather stream too: a parameter offload's host copy overlaps compute
            unit.allocate()
            out = full if full.dtype == src.dtype else torch.empty(b.padded_numel, dtype=src.dtype, device=g.device)
            if self.rt.zeropp.gathers_specially and not exact:
                handle = self.rt.zeropp.all_gather(b, out, src)
            else:
                handle = all_gather_into_tensor(out, src, self.group, async_op=True)
        self._issued(b, handle, out, event, async_op)

    def _gather_int8(self, b: Bucket, async_op: bool) -> None:
        """Gather a unit held as int8 blocks: the blocks are the stored values, so this is also the exact gather."""
        unit, comm = self.units[b.index], self.rt.comm_ctx
        with record_function("zero::gather"), comm.on(comm.gather_stream) as event:
            unit.allocate()
            handle = self.frozen_q.all_gather(b, unit.full)
        self._issued(b, handle, unit.full, event, async_op)

    def _issued(self, b: Bucket, handle, out: torch.Tensor, event, async_op: bool) -> None:
        self.units[b.index].inflight = (handle, out, event)
        self._set_state(b, ShardState.GATHERING)
        self.gathers += 1
        if not async_op:
            self._wait(b)

    def _read_window(self, b: Bucket, window: SharedWindow) -> None:
        """Gather ``b`` from the shared window: each rank's chunk copied from its stored shard, no collective."""
        unit = self.units[b.index]
        with record_function("zero::gather"):
            unit.allocate()
            window.gather(unit.full[: b.padded_numel], b.shard_offset, b.chunk)
        unit.point_params()
        self._set_state(b, ShardState.GATHERED)
        self.gathers += 1

    def gather_source(self, b: Bucket) -> torch.Tensor:
        """This rank's stored chunk of ``b`` on the compute device: what its all-gather sends (``b.chunk`` elements,
        storage dtype). The storage hook a plug-in overrides when shards live elsewhere between uses
        (zero_offload's parameter offload copies the chunk from host memory here, when the gather is issued)."""
        return self.param_shard[b.group.index][b.shard_slice()]

    def write_shard(self, b: Bucket, chunk: torch.Tensor) -> None:
        """Store ``chunk`` (``b.chunk`` elements, any float dtype) as this rank's stored chunk of ``b``
        (``GatheredParameters`` with a modifier writes edits back through it)."""
        if self.quantizes(b.group):
            self.frozen_q.store(b, chunk)
            return
        shard = self.param_shard[b.group.index]
        shard[b.shard_slice()] = chunk.to(shard.dtype)

    def _wait(self, b: Bucket) -> None:
        unit = self.units[b.index]
        handle, out, event = unit.inflight
        with record_function("zero::gather_wait"):
            try:
                handle.wait()
            except CollectiveTimeout as exc:  # name the ranks that never joined (or a departed one, when steady)
                raise self.divergence.after_timeout(b, self.phase, check_peers=self.record.steady) from exc
            self.rt.comm_ctx.use(event, unit.full)  # compute waits here, not at issue (no host sync)
        unit.inflight = None
        full = unit.full
        if isinstance(handle, GatherBatch):
            handle.copy_out(b, full)
        elif out is not full:
            full.copy_(out)
        unit.point_params()
        self._set_state(b, ShardState.GATHERED)

    # ---------------------------------------------------------------- hooks
    def _pre_forward(self, module, args):
        units = self.needs.get(module)
        if units is None or all(self.held.get(b) for b in units):  # a deep copy of a module this store hooks,
            return  # or units a GatheredParameters block holds (e.g. generation): nothing to gather, record, check
        if torch._C._current_graph_task_id() != -1:  # recompute inside backward (activation checkpointing)
            for b in units:
                self.gather(b, phase=BACKWARD)
            return
        for b in units:
            self.divergence.note(b, FORWARD)
            self.record.follow(b)
            self.gather(b)
        for b in self.external.get(module, ()):
            self.pinned[b] = self.pinned.get(b, 0) + 1  # the owner's post-forward must not release it
        self._prefetch()

    def _post_forward(self, module, args, output):
        units = self.needs.get(module)
        if units is None or all(self.held.get(b) for b in units):  # see _pre_forward
            return
        if torch.is_grad_enabled() and not self.rt.forward_only:  # forward only: no backward will need them
            tensors = [t for t in output_tensors(output, module) if t.requires_grad]
            for t in tensors:
                t.register_hook(lambda grad, units=units: self._pre_backward(units))
        if torch._C._current_graph_task_id() != -1:
            return  # a recompute's tensors are used right away by backward: keep them
        for b in self.external.get(module, ()):
            self.pinned[b] -= 1
        for b in units:
            if not self._reused_soon(b):
                self.release(b)

    def _pre_backward(self, units):
        self.phase = BACKWARD
        if self.rt.reducer.streamed:  # gradients streamed to NVMe: the last unit's reduction
            self.rt.reducer.wait_reduced()  # lands before this unit arrives (host memory: one unit's gradient, not two)
        for b in units:
            self.gather(b)
        self._gather_ahead(self.record.before(units[0]))  # backward meets units in reverse forward order
        return None

    def before_reduce(self) -> None:
        """A reduction starts: this forward's order check (issued by ``begin_backward``) must have agreed first."""
        self.divergence.settle()

    def empty_cache(self) -> None:
        """DeepSpeed's ``empty_partition_cache``: every unit not persistent is released (those kept gathered for a
        near reuse and prefetches in flight, waited for first) and the recorded order, the prefetch state and the
        reuse plan are forgotten: the next forward records the order again, each gather agreed with the peers
        (every rank calls this at the same point, between steps, as DeepSpeed requires)."""
        self.pinned.clear()
        for g in self.rt.flat_groups:
            for b in g.buckets:
                self.release(b)
        self.kept.clear()
        self.record.forget()
        self.phase = FORWARD

    def on_grads_done(self, b: Bucket) -> None:
        """All of ``b``'s gradients are in (or backward ended): it is no longer needed this backward."""
        if not b.persistent:
            self.release(b)

    # ---------------------------------------------------------------- trace and prefetch
    def live_numel(self) -> int:
        """Elements of non-persistent units gathered or being gathered now (what ``stage3_max_live_parameters``
        bounds)."""
        return self._live  # kept by _set_state: O(1), where a sum over units made prefetch quadratic in units

    def _reused_soon(self, b: Bucket) -> bool:
        """Keep ``b`` gathered after its module's forward: its next use comes within ``stage3_max_reuse_distance``
        elements of other gathers and the live elements stay within ``stage3_max_live_parameters``. DeepSpeed's
        rule on its trace of forward and backward together: while autograd records, a unit's last forward use is
        followed by its backward use, backward meeting the units in reverse order, so the distance is twice the
        elements gathered after it in the forward (the forward's last unit: 0, and a reuse distance of 0 keeps
        nothing). DeepSpeed's default (1e9 elements) thus keeps every unit of a model under 5e8 elements gathered
        from its forward to its backward: no backward all-gather (2 instead of 3 model sizes moved per step);
        ``stage3_max_reuse_distance`` 0 gives ZeRO-3's release after every use. A unit read from a shared window
        is never kept: its gather is a copy of shards this rank already maps, so keeping it would hold a second
        copy of them, at the end of forward (the step's peak of host memory) the whole model, to save one copy."""
        if b.persistent or torch._C._current_graph_task_id() != -1 or self.windows[b.group.index] is not None:
            return False
        distance = self.record.reuse_distance(b, into_backward=torch.is_grad_enabled() and self.reuse_distance > 0)
        if distance is None or distance > self.reuse_distance:
            return False
        if self.live_numel() > self.max_live:
            return False
        self.kept.add(b)
        return True

    def _prefetch(self) -> None:
        self._gather_ahead(self.record.ahead())

    def _gather_ahead(self, units) -> None:
        """Prefetch the SHARDED ones of ``units`` (in that order) within ``stage3_prefetch_bucket_size`` and
        ``stage3_max_live_parameters``; runs of them in one flat group, up to :data:`GATHER_BATCH_BYTES`, are
        gathered by one collective."""
        budget, live = self.prefetch_numel, self.live_numel()
        chosen = []
        for b in units:
            if self.units[b.index].state is not ShardState.SHARDED or self.windows[b.group.index] is not None:
                continue  # a window's gather is a copy on this thread: nothing to overlap by issuing it early
            if b.padded_numel > budget or live + b.padded_numel > self.max_live:
                break
            chosen.append(b)
            budget -= b.padded_numel
            live += b.padded_numel
        if not self.batches_gathers or self.world == 1 or self.rt.zeropp.gathers_specially or self.rt.config.offloads:
            runs = [[b] for b in chosen]
        else:
            runs, size = [], 0
            for b in chosen:
                nbytes = b.chunk * self.world * self.units[b.index].full.element_size()
                # the first unit alone: the next module waits for it only, not for a whole batch
                # a large unit's own collective costs less than copying it out of a batch: it joins none
                # int8-held units gather their own packed bytes: never batched
                small = nbytes < GATHER_ALONE_BYTES and not self.quantizes(b.group)
                if small and len(runs) > 1 and runs[-1][0].group is b.group and size + nbytes <= GATHER_BATCH_BYTES:
                    runs[-1].append(b)
                    size += nbytes
                else:
                    runs.append([b])
                    size = nbytes if small else GATHER_BATCH_BYTES + 1
        for run in runs:
            if len(run) == 1:
                self.gather(run[0], async_op=True)
            else:
                self._gather_batch(run)

    def _gather_batch(self, run: list[Bucket]) -> None:
        """Start one all-gather for the units of ``run`` (SHARDED, one flat group): see ``GatherBatch``."""
        self.divergence.settle()
        if not self.record.steady:
            for b in run:
                self.divergence.agree(b, self.phase)
        run = sorted(run, key=lambda b: b.index)
        shard = self.param_shard[run[0].group.index]
        lo, hi = run[0].shard_offset, run[-1].shard_offset + run[-1].chunk
        comm = self.rt.comm_ctx
        with record_function("zero::gather"), comm.on(comm.gather_stream) as event:
            if hi - lo == sum(b.chunk for b in run):  # adjacent units: their chunks already lie side by side
                send = shard[lo:hi]
            else:
                send = torch.cat([self.gather_source(b) for b in run])
            for b in run:
                self.units[b.index].allocate()
            batch = GatherBatch({b: b.chunk for b in run}, send, self.group, self.world)
        for b in run:
            self.units[b.index].inflight = (batch, None, event)
            self._set_state(b, ShardState.GATHERING)
            self.gathers += 1

    def begin_backward(self) -> None:
        """Forward is over: issue the comparison of this forward's unit order across ranks (one 4-integer check,
        asynchronous: compared before the next gather or reduction, or at ``end_backward``), settle the trace used
        for prefetching.

        Raises:
            RankDivergenceError: on every rank, when the ranks' forwards gathered different units (raised by the
                first gather, reduction or ``end_backward`` after this).
        """
        self.divergence.agree_order()
        self.record.end_forward()
        self.phase = BACKWARD

    def end_backward(self) -> None:
        """Release everything still gathered (frozen units, unused units) and get ready for the next forward.

        Raises:
            RankDivergenceError: the forward's order check found the ranks apart (none of this backward's
                collectives ran).
        """
        self.divergence.settle()
        for g in self.rt.flat_groups:
            for b in g.buckets:
                self.release(b)
        self.phase = FORWARD
        self.record.end_pass()

    @torch.no_grad()
    def refresh(self, master) -> None:
        """After the optimizer step (or a load): ``master.write_params`` into each trainable unit's stored chunk,
        rebuild hpZ's secondary shards (synchronously, before any gather or prefetch can read them),
        re-gather persistent (and pinned) units."""
        for g in self.rt.flat_groups:
            if g.group_index is None:
                continue
            for b in g.buckets:
                master.write_params(b, self.param_shard[g.index][b.shard_slice()])
        self._fence()  # the stepped (or loaded) shards are written: peers may read them
        if self.rt.zeropp.hpz is not None:
            self.rt.zeropp.refresh_secondary(self.rt.flat_groups, self.param_shard)
        self._regather_persistent()

    def master_chunk(self, b: Bucket) -> None:
        """None: a unit's full buffer is freed between uses, so no master can live in it."""
        return None

    def shard_view(self, g: FlatGroup) -> torch.Tensor | None:
        """This rank's stored shard (``shard_numel`` elements, storage dtype): writes reach the gathered
        parameters at their next gather. None for a frozen group held as int8 blocks."""
        return self.param_shard[g.index]

    def resident(self) -> list[torch.Tensor]:
        """The stored shards on the device and the int8 blocks of the frozen units (gathered units' buffers are
        the parameters' storage)."""
        held = [t for t in self.param_shard if t is not None]
        return held + (list(self.frozen_q.packed.values()) if self.frozen_q is not None else [])

    def shard_values(self, g: FlatGroup) -> torch.Tensor:
        """This rank's stored shard (the tensor itself; for a group held as int8 blocks, a dequantized copy in the
        storage dtype)."""
        if self.quantizes(g):
            return self.frozen_q.shard_values(g, self.rt.precision.param_dtype)
        return self.param_shard[g.index]

    @torch.no_grad()
    def load_frozen(self, g: FlatGroup, shard: torch.Tensor) -> None:
        """Frozen group ``g``: new stored shard (quantized again when held as int8 blocks); persistent units
        re-gathered by the next ``refresh``."""
        if self.quantizes(g):
            self.frozen_q.load(g, shard)
            return
        self.param_shard[g.index].copy_(shard.reshape(-1))

    @torch.no_grad()
    def close(self) -> None:
        """Remove every hook; gather each unit exactly and give every parameter its own dense storage holding its
        current values (the stored shards, not a qwZ copy). Collective: every rank closes together."""
        if self.rt is None:
            return
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._end_first_pass()  # a first forward that never finished leaves its check mode entered
        self.pinned.clear()
        self.held.clear()
        for g in self.rt.flat_groups:
            for b in g.buckets:
                unit = self.units[b.index]
                if self.rt.zeropp.gathers_specially or unit.state is not ShardState.GATHERED:
                    if unit.state is ShardState.GATHERING:
                        self._wait(b)
                    self._set_state(b, ShardState.SHARDED)
                    self.gather(b, phase=STEP, exact=True)
                unit.detach_params()
                self._set_state(b, ShardState.SHARDED)
        self._fence()  # every peer's closing gathers have read this rank's shard
        self.param_shard = []
        self.frozen_q = None
        for w in self.windows:
            if w is not None:
                w.close()
        self.windows = []
        self.divergence.close()
        self.needs.clear()
        self.external.clear()
        self.record.forget()
        self.kept.clear()
        self.rt = None

    def shards_edited(self) -> None:
        """Stored shards were written outside a step (``GatheredParameters`` with a modifier): rebuild hpZ's
        secondary shards and re-gather persistent units. Collective."""
        self._fence()
        self.rt.zeropp.refresh_secondary(self.rt.flat_groups, self.param_shard)
        if self.rt.zeropp.gathers_specially:
            self._regather_persistent()

    def _regather_persistent(self) -> None:
        for g in self.rt.flat_groups:
            for b in g.buckets:
                if b.persistent or self.units[b.index].state is not ShardState.SHARDED:
                    self._set_state(b, ShardState.SHARDED)  # stale: fetch the stepped values
                    self.gather(b, phase=STEP)
        self.phase = FORWARD


def lookup(p: torch.Tensor) -> tuple[Stage3, Bucket] | None:
    """The live stage-3 store and unit that hold ``p``, or None."""
    return registry.stage3_unit(p)
