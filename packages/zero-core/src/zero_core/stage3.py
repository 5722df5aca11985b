"""ZeRO stage 3's parameter store: parameters sharded, each unit gathered just before its module runs and released
after.

A *unit* is a bucket of one flat group (the parameters a module owns directly, FSDP1-style, or a subtree:
``zero_core.unit_plan``), so one all-gather materialises a module. Parameters with at most
``stage3_param_persistence_threshold`` elements go to *persistent* buckets that stay gathered (refreshed after each
step). Releasing frees a unit's full buffer (``resize_(0)``) and gathering re-allocates the same storage, so views
autograd saved during forward see the re-gathered values in backward (PyTorch FSDP1 does the same); a released
parameter's ``.data`` is an empty tensor (``numel() == 0``, never freed memory). The module and the optimizer hold
the ``Parameter`` objects, so ``.data`` is swapped. The pieces, one job each: ``zero_core.units`` (gathering,
releasing, holds, the live count; a unit's state is one ``UnitBuffer`` there), ``zero_core.prefetch`` (the recorded
order, prefetch runs, reuse), ``zero_core.shard_storage`` (where the stored chunks live: the storage policy the
store is given; on the device by default, in shared windows with ``stage3_shared_shards``, int8 blocks for frozen
weights with ``zero_quantized_nontrainable_weights``, host memory or NVMe from zero_offload),
``zero_core.divergence`` and ``zero_core.first_pass`` (checks). This module hooks them to the modules.

Ranks that run different modules raise ``RankDivergenceError`` on every rank instead of pairing different units
(silently wrong) or different sizes (gloo aborts the process). Until the first step ends, and while a pass departs
from the recorded order, every gather is agreed first (one 4-integer all-gather on a side gloo group); on a pass
that follows the record only a hash of the forward's units is compared, issued when backward begins and compared
before the backward's first gather or reduction, so the rank whose forward ends first does not wait for the other.

Each forward gather also prefetches the next units of the recorded order, and a unit whose next use is near stays
gathered after its module (``zero_core.prefetch``: DeepSpeed's ``stage3_prefetch_bucket_size``,
``stage3_max_live_parameters`` and ``stage3_max_reuse_distance`` rules). Writes to shared shards are fenced
(``zero_core.shard_storage``).
"""

from __future__ import annotations

from functools import partial

import torch
from torch.utils import _pytree as pytree

from zero_core import registry
from zero_core.divergence import DivergenceCheck, RankDivergenceError
from zero_core.first_pass import FirstPassCheck, eager
from zero_core.frozen_quant import QuantizedFrozenChunks, init_asked_quantized
from zero_core.heap_trim import FreedHeapTrim
from zero_core.layout import Bucket, FlatGroup
from zero_core.materialize import HOST_THRESHOLDS
from zero_core.param_store import ParamStoreInputs, Stage3Settings
from zero_core.partitioned_param import adopt
from zero_core.prefetch import Prefetcher
from zero_core.shard_state import BACKWARD, FORWARD, STEP, ShardState
from zero_core.shard_storage import DeviceShards, ShardStorage
from zero_core.stage3_readout import PartitionReadout
from zero_core.tree import output_tensors
from zero_core.unit_plan import module_needs, plan_units
from zero_core.units import UnitBuffer, Units

__all__ = ["RankDivergenceError", "ShardState", "Stage3", "lookup", "plan_units"]

_GATHERED = ShardState.GATHERED
_graph_task_id = torch._C._current_graph_task_id  # -1 outside autograd's backward


class Stage3(PartitionReadout):
    """Stage 3's ``ParamStore`` for one runtime: materialises each unit's stored chunk in its storage, installs the
    module hooks that gather and release units (:class:`~zero_core.units.Units`). Building it is collective.

    Args (keyword-only; :meth:`from_inputs` takes them from the runtime's ``ParamStoreInputs``, where each is
    described): ``module``, ``flat_groups``, ``unit_owner``, ``group``, ``rank``, ``world``, ``settings``,
    ``precision``, ``comm``, ``zeropp``, ``forward_only``, ``wait_reduced``; and
    ``storage``: where the stored chunks live (``zero_core.shard_storage.ShardStorage``); None: on the device
    (``DeviceShards``, in shared windows where ``stage3_shared_shards`` allows).

    Attributes:
        units: the units, their gathers and the live count (``units.buffers[b.index]``: unit ``b``'s state).
        prefetch: the recorded unit order and what to gather ahead (:class:`~zero_core.prefetch.Prefetcher`).
        frozen_q: the int8 storage of the frozen flat groups (``zero_quantized_nontrainable_weights``), or None.
        heap_trim: training on the CPU, what gives back the freed host memory glibc keeps after a step
            (:class:`~zero_core.heap_trim.FreedHeapTrim`); else None.
        shards: per flat group, its stored shard on the device, or None (offloaded, int8).

    Raises:
        ValueError: hpZ (``zero_hpz_partition_size`` > 1) with shards off the device (hpZ builds its secondary
            shards from device-resident ones).
    """

    gathers_units = True

    def __init__(self, *, module: torch.nn.Module, flat_groups: list[FlatGroup], unit_owner: dict, group, rank: int,
                 world: int, settings: Stage3Settings, precision, comm, zeropp, forward_only: bool, wait_reduced,
                 storage: ShardStorage | None = None):  # fmt: skip
        if storage is not None and storage.offloaded and zeropp.hpz is not None:
            raise ValueError("zero_optimization.offload_param with zero_hpz_partition_size > 1 is not supported: hpZ "
                             "builds its secondary shards from device-resident shards")  # fmt: skip
        self.module = module
        self.flat_groups = flat_groups
        self.group, self.rank, self.world = group, rank, world
        self.param_dtype, self.compute_dtype = precision.param_dtype, precision.compute
        self.zeropp = zeropp
        self.gathers_specially = zeropp.gathers_specially  # qwZ/hpZ: unit gathers go through zeropp.all_gather
        self.forward_only = forward_only
        self.wait_reduced = wait_reduced
        self._shared: DeviceShards | None = None  # the default storage, where it holds shared windows (fenced)
        if storage is None:
            refused = ("ZeRO++ qwZ/hpZ gather their own way" if self.gathers_specially else
                       "an offload section is set (memory first: shards stay in their own storage)"
                       if settings.offloads else None)  # fmt: skip
            storage = self._shared = DeviceShards(group=group, world=world, dtype=self.param_dtype,
                                                  shared=settings.shared_shards, refused=refused)  # fmt: skip
        self.storage: ShardStorage = storage
        self.offloaded = storage.offloaded
        self.frozen_q: QuantizedFrozenChunks | None = None
        if settings.quantize_frozen or init_asked_quantized(flat_groups):
            self.frozen_q = QuantizedFrozenChunks(group, block=settings.quant_block, quantizer=settings.quantizer,
                                                  dtype=self.param_dtype)  # fmt: skip
        self.closed = False
        self.divergence = DivergenceCheck(group, world, rank)
        buffers: list[UnitBuffer] = []
        batches = world > 1 and not self.gathers_specially and not settings.offloads and storage.batches
        self.prefetch = Prefetcher(buffers, prefetch_numel=settings.prefetch_numel, max_live=settings.max_live,
                                   reuse_distance=settings.reuse_distance, world=world, batches=batches)  # fmt: skip
        self._place = [self._storage_of(g) for g in flat_groups]  # per flat group: the storage of its chunks
        for st in self._storages():
            st.allocate([g for g, where in zip(flat_groups, self._place) if where is st])
        if self._shared is not None and not self._shared.windows:
            self._shared = None  # nothing shared: no fences, no window gathers
        self.shards: list[torch.Tensor | None] = [st.shard(g) for g, st in zip(flat_groups, self._place)]
        self.units = Units(buffers, group=group, world=world, comm=comm, zeropp=zeropp, divergence=self.divergence,
                           prefetch=self.prefetch, max_live=settings.max_live, shards=self.shards,
                           shared=self._shared)  # fmt: skip
        # all of a unit's gradients are in (or backward ended): it is not needed again this backward
        self.on_grads_done = self.units.release
        # training on the CPU: freed heap pages glibc keeps are given back once they pile up (zero_core.heap_trim)
        cpu = any(g.device.type == "cpu" for g in flat_groups)
        self.heap_trim = FreedHeapTrim() if cpu and not forward_only and not self.offloaded else None
        self._materialize(forward_only)
        self._trainable = [g for g in flat_groups if g.group_index is not None]
        self._persistent = any(b.persistent for g in flat_groups for b in g.buckets)
        self.needs: dict[torch.nn.Module, list[Bucket]] = {}  # module -> the units its forward gathers
        self.external: dict[torch.nn.Module, set[Bucket]] = {}  # module -> units it reads that others own
        self._returned: set[Bucket] = set()  # units whose parameters a module returned this pass: pinned till its end
        self._on_backward: dict[torch.nn.Module, partial] = {}  # module -> its outputs' pre-backward hook
        self._hooks: list = []  # every module hook handle this store installed, removed by close()
        for m, units in module_needs(module, flat_groups, unit_owner).items():
            for b in units:
                self._add_need(m, b)
        names = {id(s.param): s.name for g in flat_groups for b in g.buckets if not b.persistent for s in b.slots}
        self.first_pass = FirstPassCheck(module, names, self.prefetch)
        if forward_only:  # no backward ends the pass: the model's own forward does (not when it raised)
            self._hooks.append(module.register_forward_hook(eager(self._end_forward_pass)))
        # torch marks the hook function itself, so it must be a plain function, not a bound method
        self._hooks.append(module.register_state_dict_post_hook(lambda *a: self._warn_released(*a)))
        for g in flat_groups:
            for s in g.slots:
                adopt(s.param)  # ds_* properties answered by param_status / param_shape / param_partition

    @classmethod
    def from_inputs(cls, inputs: ParamStoreInputs, storage: ShardStorage | None = None) -> Stage3:
        """The store for what the runtime offers (the builder ``ZeroRuntime`` uses at stage 3), its stored chunks
        in ``storage`` (None: on the device)."""
        return cls(module=inputs.module, flat_groups=inputs.flat_groups, unit_owner=inputs.unit_owner,
                   group=inputs.group, rank=inputs.rank, world=inputs.world, settings=inputs.settings,
                   precision=inputs.precision, comm=inputs.comm, zeropp=inputs.zeropp,
                   forward_only=inputs.forward_only, wait_reduced=inputs.wait_reduced, storage=storage)  # fmt: skip

    def __deepcopy__(self, memo):
        """The store itself: ``copy.deepcopy`` of a hooked module copies its hooks, bound to this store, which
        then do nothing for the copy (not a module it manages; its parameters are whole copies: see
        ``zero_core.partitioned_param``). A store is one per runtime and holds process groups: never copied."""
        return self

    @torch.no_grad()
    def _materialize(self, forward_only: bool) -> None:
        """Every unit's starting values into its storage (``Units.materialize``), then the shards are readable by
        the peers, hpZ's secondary copy is built and persistent units hold the values every gather gives."""
        if any(g.device.type == "cpu" for g in self.flat_groups):
            # serving and offloaded parameters (memory first): released unit buffers must not turn the forward's
            # allocations into resident heap; training: heap reuse, as fresh mappings for every activation cost
            # more step time than the RSS they save
            HOST_THRESHOLDS.pin() if forward_only or self.offloaded else HOST_THRESHOLDS.for_training()
        windows = self._shared.windows if self._shared is not None else {}
        self.units.materialize(self.flat_groups, self._place, self.compute_dtype, self.param_dtype, windows,
                               packed=self.frozen_q)  # fmt: skip
        for st in self._storages():
            st.flush()
        self._fence()  # the stored chunks are written: peers may read them
        self.zeropp.refresh_secondary(self.flat_groups, self.shards)
        if self.gathers_specially or self.frozen_q is not None:  # persistent units hold gathered values
            self.units.regather(STEP)
            self.units.phase = FORWARD

    def _add_need(self, m: torch.nn.Module, b: Bucket) -> None:
        """``m``'s forward gathers ``b`` before it runs and releases it after (hooks installed once per module)."""
        units = self.needs.get(m)
        if units is None:
            units = self.needs[m] = []
            self._on_backward[m] = partial(self._pre_backward, units)  # a tensor hook: called with the gradient
            self._hooks.append(m.register_forward_pre_hook(eager(self._pre_forward)))
            self._hooks.append(m.register_forward_hook(eager(self._post_forward)))
        if b not in units:
            units.append(b)

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
        return self.first_pass.active

    # ---------------------------------------------------------------- per unit (GatheredParameters, ds_*)
    @property
    def gathers(self) -> int:
        """Gathers issued so far (units gathered from a shared window included)."""
        return self.units.gathers

    def state_of(self, b: Bucket) -> ShardState:
        """Whether unit ``b`` is gathered, being gathered or released."""
        return self.units.buffers[b.index].state

    def full_of(self, b: Bucket) -> torch.Tensor:
        """Unit ``b``'s full buffer (``padded_numel`` elements, compute dtype; empty storage while released)."""
        return self.units.buffers[b.index].full

    def live_numel(self) -> int:
        """Elements of non-persistent units gathered or being gathered now (what ``stage3_max_live_parameters``
        bounds)."""
        return self.units.live

    def gather(self, b: Bucket, *, async_op: bool = False, phase: int | None = None, exact: bool = False) -> None:
        """Materialise ``b``: :meth:`zero_core.units.Units.gather`."""
        self.units.gather(b, async_op=async_op, phase=phase, exact=exact)

    def release(self, b: Bucket, *, keep_views: bool = False) -> None:
        """Free ``b``'s full buffer unless it is persistent or pinned: :meth:`zero_core.units.Units.release`."""
        self.units.release(b, keep_views=keep_views)

    def hold(self, b: Bucket) -> None:
        """A block (``GatheredParameters``, ``gathered_for_compute``) holds gathered unit ``b``: :meth:`Units.hold`."""
        self.units.hold(b)

    def unhold(self, b: Bucket) -> None:
        """The block that called :meth:`hold` ends (the caller releases ``b`` if it should)."""
        self.units.unhold(b)

    def is_pinned(self, b: Bucket) -> bool:
        """Whether something (a block, an external reader's forward) forbids releasing ``b`` now."""
        return self.units.buffers[b.index].pinned > 0

    def mark_stale(self, b: Bucket) -> None:
        """``b``'s gathered values are not its stored shard's (a qwZ copy): the next ``gather`` fetches them again."""
        self.units.mark_stale(b)

    # ---------------------------------------------------------------- hooks
    def _pre_forward(self, module, args):
        needed = self.needs.get(module)
        units = self.units
        if needed is None or units.holding and all(units.buffers[b.index].held for b in needed):
            return  # a deep copy of a module this store hooks, or units a GatheredParameters block holds (e.g.
            # generation): nothing to gather, record, check
        if _graph_task_id() != -1:  # recompute inside backward (activation checkpointing)
            for b in needed:
                units.gather(b, phase=BACKWARD)
            return
        prefetch, note, buffers = self.prefetch, self.divergence.note, units.buffers
        for b in needed:
            note(b, FORWARD)
            prefetch.follow(b)
            if buffers[b.index].state is not _GATHERED:  # kept from an earlier use: nothing to do
                units.gather(b)
        external = self.external.get(module)
        if external:
            for b in external:
                units.buffers[b.index].pinned += 1  # the owner's post-forward must not release it
        runs = prefetch.runs(units.live)
        if runs:
            units.gather_runs(runs)

    def _post_forward(self, module, args, output):
        needed = self.needs.get(module)
        units = self.units
        if needed is None or units.holding and all(units.buffers[b.index].held for b in needed):  # see _pre_forward
            return
        grad = torch.is_grad_enabled()
        if grad and not self.forward_only:  # forward only: no backward will need them
            hook = self._on_backward[module]
            if isinstance(output, torch.Tensor):
                if output.requires_grad:
                    output.register_hook(hook)
            else:
                for t in output_tensors(output, module):
                    if t.requires_grad:
                        t.register_hook(hook)
        if _graph_task_id() != -1:
            return  # a recompute's tensors are used right away by backward: keep them
        external = self.external.get(module)
        if external:
            for b in external:
                units.buffers[b.index].pinned -= 1
        self._keep_returned(output)
        units.after_forward(needed, grad)

    def _keep_returned(self, output) -> None:
        """A module returned one of its stage-3 parameters (an "external" parameter its caller reads, as
        DeepSpeed detects them): its unit stays gathered (pinned) until the pass ends (``end_backward``), so the
        caller's forward reads it AVAILABLE and its backward finds the values autograd saved."""
        for t in pytree.tree_leaves(output):
            if isinstance(t, torch.nn.Parameter):
                found = registry.lookup(t)
                if found is not None and found.store is self and not found.bucket.persistent:
                    b = found.bucket
                    if b not in self._returned:
                        self._returned.add(b)
                        self.units.buffers[b.index].pinned += 1

    def _pre_backward(self, needed: list[Bucket], grad=None) -> None:
        units = self.units
        units.phase = BACKWARD
        if self.offloaded:  # gradients may be streamed off the device: the last unit's reduction lands before this
            self.wait_reduced()  # unit arrives (host memory: one unit's gradient, not two)
        buffers = units.buffers
        for b in needed:
            if buffers[b.index].state is not _GATHERED:  # kept since its forward: nothing to do
                units.gather(b)
        runs = self.prefetch.runs(units.live, before=needed[0])  # backward meets units in reverse forward order
        if runs:
            units.gather_runs(runs)

    def _end_forward_pass(self, module, args, output) -> None:
        """Forward-only runtime (no optimizer): the model's forward returned, which ends a pass as ``end_backward``
        does for training: the ranks' unit order is compared (one small all-gather on the side group), the first
        pass's order is recorded for prefetching the next ones, and every unit still gathered is released.

        Raises:
            RankDivergenceError: on every rank, when the ranks' forwards gathered different units."""
        if _graph_task_id() != -1 or not self.prefetch.pass_sequence:
            return  # nothing gathered this pass (a GatheredParameters block holds every unit): nothing to compare
        self.begin_backward()
        self.end_backward()

    def before_reduce(self) -> None:
        """A reduction starts: this forward's order check (issued by ``begin_backward``) must have agreed first."""
        if self.divergence.pending is not None:
            self.divergence.settle()

    def begin_backward(self) -> None:
        """Forward is over: issue the comparison of this forward's unit order across ranks (one 4-integer check,
        asynchronous: compared before the next gather or reduction, or at ``end_backward``), settle the record
        used for prefetching.

        Raises:
            RankDivergenceError: on every rank, when the ranks' forwards gathered different units (raised by the
                first gather, reduction or ``end_backward`` after this).
        """
        self.divergence.agree_order()
        self.prefetch.end_forward()
        self.units.phase = BACKWARD
        if self.first_pass.hooks:
            self.first_pass.stop()

    def end_backward(self) -> None:
        """Release everything still gathered (frozen units, unused units) and get ready for the next forward.

        Raises:
            RankDivergenceError: the forward's order check found the ranks apart (none of this backward's
                collectives ran).
        """
        if self.divergence.pending is not None:
            self.divergence.settle()
        units = self.units
        for b in self._returned:
            units.buffers[b.index].pinned -= 1
        self._returned.clear()
        if units.live:
            units.release_all()
        units.phase = FORWARD
        self.prefetch.end_pass()

    def empty_cache(self) -> None:
        """DeepSpeed's ``empty_partition_cache``: every unit not persistent is released (those kept gathered for a
        near reuse and prefetches in flight, waited for first) and the recorded order, the prefetch state and the
        reuse plan are forgotten: the next forward records the order again, each gather agreed with the peers
        (every rank calls this at the same point, between steps, as DeepSpeed requires)."""
        units = self.units
        for u in units.buffers:
            u.pinned = 0
        self._returned.clear()
        units.release_all()
        self.prefetch.forget()
        units.phase = FORWARD
        self.first_pass.watch()

    # ---------------------------------------------------------------- stored shards
    def _storage_of(self, g: FlatGroup) -> ShardStorage:
        frozen_q = self.frozen_q
        return frozen_q if frozen_q is not None and frozen_q.holds_group(g) else self.storage

    def _storages(self) -> list[ShardStorage]:
        return [self.storage] if self.frozen_q is None else [self.storage, self.frozen_q]

    def _fence(self) -> None:
        """Every rank's writes to its stored shards so far are visible to every peer's reads after this (a barrier,
        only where shards live in shared windows). Collective."""
        if self._shared is not None:
            self._shared.fence()

    def before_write(self) -> None:
        """The stored shards are about to be written outside a step (a load, a ``GatheredParameters`` edit): with
        shared windows, wait until no peer still reads them (a fence). The step itself needs none: every peer's
        gathers of the pass are done once the gradient-norm all-reduce, which precedes every step, has completed.
        Collective."""
        self._fence()

    @torch.no_grad()
    def refresh(self, master) -> None:
        """After the optimizer step (or a load): ``master.write_params`` into each trainable unit's stored chunk
        (unless the master wrote them during its step, ``params_written``), rebuild hpZ's secondary shards
        (synchronously, before any gather or prefetch can read them), re-gather persistent (and pinned) units."""
        if master.params_written:
            master.params_written = False
        else:
            storage, buffers, opened = self.storage, self.units.buffers, False
            for g in self._trainable:
                for b in g.buckets:
                    dst = buffers[b.index].stored
                    if dst is not None:
                        master.write_params(b, dst)
                    else:
                        master.write_params(b, storage.open_chunk(b, keep=False))
                        storage.close_chunk(b)
                        opened = True
            if opened:
                storage.flush()
        if self._shared is not None:  # the stepped (or loaded) shards are written: peers may read them
            self._shared.fence()
        if self.zeropp.hpz is not None:
            self.zeropp.refresh_secondary(self.flat_groups, self.shards)
        if self._persistent or self.units.live:  # what is gathered holds the values before the step
            self.units.regather(STEP)
        self.units.phase = FORWARD
        if self.heap_trim is not None:
            self.heap_trim.after_step()

    def master_chunk(self, b: Bucket) -> None:
        """None: a unit's full buffer is freed between uses, so no master can live in it."""
        return None

    def offloaded_chunks(self) -> ShardStorage | None:
        """The storage policy when it keeps the shards off the device (host memory, NVMe), else None."""
        return self.storage if self.offloaded else None

    def shard_view(self, g: FlatGroup) -> torch.Tensor | None:
        """This rank's stored shard (``shard_numel`` elements, storage dtype): writes reach the gathered
        parameters at their next gather. None where it lives off the device or as int8 blocks."""
        return self.shards[g.index]

    def shard_values(self, g: FlatGroup) -> torch.Tensor:
        """This rank's stored shard on the compute device: the tensor itself, else a copy in the storage dtype
        (dequantized for a group held as int8 blocks)."""
        shard = self.shards[g.index]
        if shard is not None:
            return shard
        storage = self._place[g.index]
        out = torch.zeros(g.shard_numel, dtype=self.param_dtype, device=g.device)
        for b in g.buckets:
            out[b.shard_slice()] = storage.read_chunk(b)
        return out

    def resident(self) -> list[torch.Tensor]:
        """The stored shards on the device and the int8 blocks of the frozen units (gathered units' buffers are
        the parameters' storage)."""
        return [t for st in self._storages() for t in st.resident()]

    @torch.no_grad()
    def write_shard(self, b: Bucket, chunk: torch.Tensor) -> None:
        """Store ``chunk`` (``b.chunk`` elements, any float dtype) as this rank's stored chunk of ``b``
        (``GatheredParameters`` with a modifier writes edits back through it)."""
        storage = self._place[b.group.index]
        storage.open_chunk(b, keep=False).copy_(chunk)
        storage.close_chunk(b)
        storage.flush()

    @torch.no_grad()
    def load_frozen(self, g: FlatGroup, shard: torch.Tensor) -> None:
        """Frozen group ``g``: new stored shard (quantized again when held as int8 blocks); persistent units
        re-gathered by the next ``refresh``."""
        storage, flat = self._place[g.index], shard.reshape(-1)
        for b in g.buckets:
            storage.open_chunk(b, keep=False).copy_(flat[b.shard_slice()])
            storage.close_chunk(b)
        storage.flush()

    def shards_edited(self) -> None:
        """Stored shards were written outside a step (``GatheredParameters`` with a modifier): rebuild hpZ's
        secondary shards and re-gather persistent units. Collective."""
        self._fence()
        self.zeropp.refresh_secondary(self.flat_groups, self.shards)
        if self.gathers_specially:
            self.units.regather(STEP)
            self.units.phase = FORWARD

    @torch.no_grad()
    def close(self) -> None:
        """Remove every hook; gather each unit exactly and give every parameter its own dense storage holding its
        current values (the stored shards, not a qwZ copy); free the storage. Collective: every rank closes
        together."""
        if self.closed:
            return
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.first_pass.close()  # a first forward that never finished leaves its check mode entered
        units = self.units
        for u in units.buffers:
            u.pinned = u.held = 0
        units.holding = 0
        for u in units.buffers:
            b = u.bucket
            if self.gathers_specially or u.state is not _GATHERED:
                if u.state is ShardState.GATHERING:
                    units.wait(b)
                units.mark_stale(b)
                units.gather(b, phase=STEP, exact=True)
            u.detach_params()
            units.mark_stale(b)
            u.kept = False
        units.kept = 0
        self._fence()  # every peer's closing gathers have read this rank's shard
        self.shards.clear()
        for st in self._storages():
            st.close()
        self.frozen_q, self._shared = None, None
        self.divergence.close()
        self.needs.clear()
        self.external.clear()
        self._on_backward.clear()
        self.prefetch.forget()
        self.closed = True


def lookup(p: torch.Tensor) -> tuple[Stage3, Bucket] | None:
    """The live stage-3 store and unit that hold ``p``, or None."""
    return registry.stage3_unit(p)
