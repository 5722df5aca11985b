"""``ZeroRuntime``: ZeRO stages 0-3 around a user's module and ``torch.optim.Optimizer`` (arXiv 1910.02054)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.profiler import record_function

from zero_comm import all_gather_into_tensor, all_reduce, broadcast
from zero_core import registry, stage3
from zero_core.checkpoint.zero_runtime import ZeroRuntimeCheckpoint
from zero_core.comm_context import CommContext, StreamOps
from zero_core.config import ZeroConfig
from zero_core.frozen_quant import asked_int8
from zero_core.grad_norm import sq_norm
from zero_core.grad_reduction import GradReduction, GradReductionBuilder, ReductionInputs
from zero_core.layout import FlatGroup, build_flat_group, split_by_size
from zero_core.leaf import apply_leaf_config, mark_by_granularity
from zero_core.master import MasterStore, MasterStoreBuilder, MasterStoreInputs, StepDecision
from zero_core.master_device import DeviceMaster
from zero_core.memory import model_state_bytes
from zero_core.model_parallel import ModelParallel, split_sq_norms
from zero_core.param_store import DenseParamStore, ParamStore, ParamStoreInputs, Stage3Settings
from zero_core.partitioned_param import PartitionedWriteError
from zero_core.precision import LossScaler, PrecisionPolicy, StaticLossScaler
from zero_core.reducer import GradReducer
from zero_core.zero_init import unpartition
from zero_core.zeropp import ZeroPP, check_zeropp


@dataclass(frozen=True)
class StepResult:
    """What ``step()`` did. ``grad_norm``: full-model pre-clip gradient norm (unscaled; identical on every rank;
    inf/nan on overflow)."""

    stepped: bool
    overflow: bool
    grad_norm: float


class ZeroRuntime:
    """Shard a module's training state over a process group at ZeRO stage 0, 1, 2 or 3.

    Args:
        module: the model; its parameters are re-laid into flat buffers (each ``param.data`` becomes a view of its
            bucket's buffer: the only way the forward can read flat storage without copies, as Megatron does).
        optimizer: any ``torch.optim.Optimizer`` built over ``module``'s parameters; afterwards its param groups
            hold this rank's fp32 master shard (one tensor per group), hyper-parameters untouched, and any state it
            already had is sharded the same way. None: a forward-only runtime (DeepSpeed's ZeRO-Inference: a
            frozen reference or teacher model): every parameter is held as frozen (stage 3: partitioned, gathered
            per unit in forward only; stages 0-2: one whole copy), no gradient buffer, master copy or optimizer
            state is allocated, and ``backward``/``step`` raise ``RuntimeError``.
        config: the ``zero_optimization`` section (stage, buckets, stage-3 knobs, ZeRO++: ``zero_core.zeropp``).
        precision: dtypes for storage/communication, compute, reduction, master and accumulation.
        group: the data-parallel process group (None: WORLD).
        gradient_clipping: max global gradient norm (0: off), ``torch.nn.utils.clip_grad_norm_`` semantics.
        loss_scaler: e.g. ``DynamicLossScaler`` for fp16 (a ``zero_core.precision.LossScaler``: ``scale``,
            ``dynamic``, ``update``); None: a static scale of 1 (non-finite steps still skip).
        param_store: a builder of where parameters live between uses: called with the
            ``zero_core.param_store.ParamStoreInputs``, it returns the ``ParamStore`` (e.g. zero_offload's
            ``param_store_for``); None: ``DenseParamStore.from_inputs`` at stages 0-2, ``Stage3.from_inputs`` at
            stage 3.
        grad_reduction: a builder of how gradients are reduced: called once, last, with a
            ``zero_core.grad_reduction.ReductionInputs``, it returns a ``GradReduction``; None:
            ``zero_core.reducer.GradReducer.from_inputs`` (the collective the config asks for).
        master_store: builds where the master shard and optimizer state live and who steps them: a callable
            taking ``zero_core.master.MasterStoreInputs`` and returning a ``zero_core.master.MasterStore``;
            None: ``zero_core.master_device.DeviceMaster.from_inputs``.
        model_parallel: the model is also split over a model-parallel (tensor-parallel) group and ``group`` is
            the data-parallel group of this rank's shard (``zero_core.model_parallel.ModelParallel``); the global
            gradient norm then counts each split parameter's shard on every model-parallel rank and each
            replicated parameter once. None: the model is whole on every rank of ``group``.
        streams: the device's stream and event calls (``zero_core.comm_context.StreamOps``); None: CUDA's on a CUDA
            device, none elsewhere. ``zero_core.stream_record.RecordedStreams`` records the schedule on CPU (tests).

    The three are attached in this order: parameter store, master store, gradient reduction. ``close()`` detaches
    them (every hook removed, the module left with plain dense parameters holding the current values).

    Initial weights are broadcast from the group's rank 0. Gradients are the sum over ``backward`` calls of the
    rank-average of each micro-batch's gradient: divide the loss by the number of micro-batches for a mean (the
    engine does). Unused parameters get a zero gradient.

    Raises:
        ValueError: an optimizer parameter is not in ``module``, a trainable parameter is in no optimizer group,
            or the optimizer holds state for only some parameters of a group, or ``zero_hpz_partition_size``
            does not divide the world size (raised before any communication).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        config: ZeroConfig | None = None,
        precision: PrecisionPolicy | None = None,
        group=None,
        gradient_clipping: float = 0.0,
        loss_scaler: LossScaler | None = None,
        *,
        param_store: Callable[[ParamStoreInputs], ParamStore] | None = None,
        grad_reduction: GradReductionBuilder | None = None,
        master_store: MasterStoreBuilder | None = None,
        model_parallel: ModelParallel | None = None,
        streams: StreamOps | None = None,
    ):
        self.module = module
        self.optimizer = optimizer
        self.forward_only = optimizer is None
        self.config = config or ZeroConfig()
        self.precision = precision or PrecisionPolicy()
        self.group = group or dist.group.WORLD
        self.model_parallel = model_parallel if model_parallel is not None and model_parallel.group.size() > 1 else None
        self.world = self.group.size()
        self.rank = dist.get_rank(self.group)
        self.stage = self.config.stage
        self.gradient_clipping = float(gradient_clipping)
        self.loss_scaler: LossScaler = loss_scaler or StaticLossScaler()
        self.overflow = False
        self.skipped_steps = 0
        self.closed = False
        if gradient_clipping < 0:
            raise ValueError(f"gradient_clipping must be >= 0, got {gradient_clipping}")
        check_zeropp(self.config, self.world)  # before any communication
        for prm in module.parameters():
            if not prm.is_floating_point():
                unpartition(prm)  # built under zero_init, but kept out of the flat groups (rank 0's values)
        for prm in module.parameters():
            prm.grad = None  # gradients flow through the buckets; a stale .grad would be added in once
        first = next(iter(module.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.unit_owner: dict[int, torch.nn.Module] = {}  # stage 3: id(param) -> the module whose unit holds it
        self.flat_groups: list[FlatGroup] = self._plan()
        self._trainable = [g for g in self.flat_groups if g.group_index is not None]
        self._partitioned = any(g.partitions > 1 for g in self._trainable)  # gradient shards: norms summed over ranks
        # stage 3: the parameters in no optimizer group, which must not require grad (see _check_unmanaged_grads)
        frozen = [s for g in self.flat_groups if g.group_index is None for s in g.slots]
        self._unmanaged = frozen if self.stage == 3 else []
        self.zeropp = ZeroPP(self.config, self.group) if self.stage == 3 else None
        self.comm_ctx = CommContext(self.device, streams)  # side streams on CUDA (a no-op on CPU)
        self.params = self._build_param_store(param_store)
        # before the gradient reduction attaches: the compiled path's store finds its units through the claims
        registry.claim(self, self.params if self.params.gathers_units else None)
        try:
            self.master = self._build_master_store(master_store)
            self.reducer = self._build_grad_reduction(grad_reduction)
        except BaseException:
            registry.release(self)
            raise

    # ---------------------------------------------------------------- the three stores, in this order
    def _build_param_store(self, given: Callable[[ParamStoreInputs], ParamStore] | None) -> ParamStore:
        def wait_reduced() -> None:  # stage 3's pre-backward: a streamed reduction lands before the next unit
            if self.reducer.streamed:
                self.reducer.wait_reduced()

        inputs = ParamStoreInputs(module=self.module, flat_groups=self.flat_groups, unit_owner=self.unit_owner,
                                  group=self.group, rank=self.rank, world=self.world,
                                  settings=Stage3Settings.from_config(self.config), precision=self.precision,
                                  comm=self.comm_ctx, zeropp=self.zeropp, forward_only=self.forward_only,
                                  device=self.device, wait_reduced=wait_reduced)  # fmt: skip
        build = given or (stage3.Stage3.from_inputs if self.stage == 3 else DenseParamStore.from_inputs)
        return build(inputs)

    def _build_master_store(self, build: MasterStoreBuilder | None) -> MasterStore:
        inputs = MasterStoreInputs(
            optimizer=self.optimizer,
            flat_groups=tuple(self.flat_groups),
            params=self.params,
            precision=self.precision,
            group=self.group,
            rank=self.rank,
            world=self.world,
            device=self.device,
            stage=self.stage,
            reduce_bucket_size=self.config.reduce_bucket_size,
            gradient_clipping=self.gradient_clipping,
            loss_scaler=self.loss_scaler,
            comm=self.comm_ctx,
        )
        return (build or DeviceMaster.from_inputs)(inputs)

    def _build_grad_reduction(self, builder: GradReductionBuilder | None) -> GradReduction:
        if builder is not None and not callable(builder):
            raise TypeError(f"ZeroRuntime: grad_reduction takes a builder (ReductionInputs -> GradReduction, e.g. "
                            f"GradReducer.from_inputs), got {type(builder).__name__}")  # fmt: skip
        inputs = ReductionInputs(module=self.module, flat_groups=tuple(self.flat_groups), group=self.group,
                                 rank=self.rank, world=self.world, stage=self.stage, config=self.config,
                                 precision=self.precision, comm_ctx=self.comm_ctx, zeropp=self.zeropp,
                                 params=self.params, master=self.master)  # fmt: skip
        return (builder or GradReducer.from_inputs)(inputs)

    # ---------------------------------------------------------------- layout
    def _plan(self) -> list[FlatGroup]:
        named = []
        for name, p in self.module.named_parameters():
            if p.is_floating_point():
                named.append((name, p))
            else:  # integer parameters (frozen by necessity) are left as they are, rank 0's values everywhere
                broadcast(p.data, dist.get_global_rank(self.group, 0), self.group)
        order = {id(p): i for i, (_, p) in enumerate(named)}
        key: dict[int, int | None] = {}
        param_groups = [] if self.forward_only else self.optimizer.param_groups
        for gi, pg in enumerate(param_groups):
            for p in pg["params"]:
                if not p.is_floating_point():
                    continue  # dropped from the optimizer: it cannot be trained
                if id(p) not in order:
                    raise ValueError(f"optimizer param group {gi} holds a tensor of shape {tuple(p.shape)} that is "
                                     "not a parameter of the module")  # fmt: skip
                if not p.requires_grad and self._holds_frozen_int8(p):
                    continue  # DeepSpeed's stage 3 leaves it out of its groups too: frozen, held as int8
                key[id(p)] = gi  # frozen now, maybe unfrozen later: it gets a master shard and grad buffer
        for name, p in named:
            if p.requires_grad and id(p) not in key and not self.forward_only:
                raise ValueError(f"trainable parameter {name!r} is in no optimizer param group; add it to the "
                                 "optimizer or set requires_grad=False")  # fmt: skip
            key.setdefault(id(p), None)
        keys = list(range(len(param_groups))) + [None]
        by_key = {k: [(n, p) for n, p in named if key[id(p)] == k] for k in keys}
        lm = self.config.leaf_module  # DeepSpeed marks them at every stage; only stage 3's units use the marks
        apply_leaf_config(self.module, lm.classes, lm.names, lm.name_suffixes)
        if self.stage == 3 and self.config.stage3_module_granularity_threshold > 0:
            mark_by_granularity(self.module, self.config.stage3_module_granularity_threshold)
        if self.stage == 3:
            plans, self.unit_owner = stage3.plan_units(self.module, key, self.config, keys)
        else:
            plans = {k: (split_by_size(v, self.config.reduce_bucket_size), None) for k, v in by_key.items()}
        groups, first = [], 0
        for k in keys:
            buckets, persistent = plans[k]
            if k is None and not buckets:
                continue
            parts = self.world if (self.stage == 3 or (k is not None and self.stage >= 1)) else 1
            persistent = persistent or [True] * len(buckets)
            fg = build_flat_group(len(groups), k, self.precision.param_dtype, parts, self.rank if parts > 1 else 0,
                                  buckets, persistent, first, order)  # fmt: skip
            first += len(buckets)
            groups.append(fg)
        return groups

    def _holds_frozen_int8(self, p: torch.nn.Parameter) -> bool:
        """Stage 3 with ``zero_quantized_nontrainable_weights`` (the config key, or ``zero.Init`` asked for it when
        it partitioned ``p``): a parameter with ``requires_grad=False`` goes to the frozen groups, held as int8
        (``zero_core.frozen_quant``), even when the optimizer lists it; it cannot be unfrozen later."""
        return self.stage == 3 and (self.config.zero_quantized_nontrainable_weights or asked_int8(p))

    # ---------------------------------------------------------------- training
    def backward(self, loss: torch.Tensor, *, is_boundary: bool | None = None, retain_graph: bool = False) -> None:
        """Backward of ``loss * loss_scale``; gradients accumulate until ``step()``/``zero_grad()``.

        ``is_boundary``: True marks the last micro-batch before ``step()`` so stages 0/1 reduce during this backward
        (overlapped); otherwise they reduce at ``step()``. Stages 2/3 reduce every backward. Never drops gradients.
        """
        if self.closed or self.forward_only:  # one test per call; the precise error only when it fails
            self._check_open()
            self._check_trains("backward")
        if self._unmanaged:
            self._check_unmanaged_grads()
        self.reducer.begin_backward(is_boundary)
        self.params.begin_backward()
        if self.master.reads_ahead:
            self.master.begin_backward(is_boundary)
        scale = self.loss_scaler.scale
        (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
        self.params.end_backward()
        self.reducer.end_backward()

    def _grad_norm(self) -> tuple[float, dict[int, list[bool]]]:
        """The global pre-clip gradient norm and, per trainable flat group, which parameters got a gradient on
        some rank since the last step; one small all-reduce carries both (world > 1)."""
        trainable = self._trainable
        # per-shard squared norms from short fp32 rows, summed in fp64 (grad_norm.py: a whole-shard fp32 sum drifts)
        shards = [self.reducer.grad_shard(g) for g in trainable]
        mp = self.model_parallel
        if any(t is None for t in shards):  # streamed gradients: the master store summed them on the way
            if mp is not None:
                raise RuntimeError("ZeroRuntime: streamed gradients (offloaded to NVMe) cannot be split into "
                                   "model-parallel and replicated parts for the gradient norm")  # fmt: skip
            local = self.master.grad_sq_norm().to(torch.float64).reshape(1)
        elif mp is not None:  # [replicated, split] squared norms of this rank's shard
            local = split_sq_norms(trainable, shards, mp)
        else:
            squares = [sq_norm(t) for t in shards]
            local = torch.stack(squares).sum().reshape(1) if squares else torch.zeros(1, dtype=torch.float64)
        width = local.numel()
        got = self.reducer.has_grad()
        flags = [float(f) for g in trainable for f in got[g.index]]
        partitioned = self._partitioned
        total = torch.cat([local if partitioned else torch.zeros(width, dtype=torch.float64),
                           torch.tensor(flags, dtype=torch.float64)])  # fmt: skip
        watched, written = self.params.outside_writes()  # persistent stage-3 values a step would silently undo
        if watched:
            total = torch.cat([total, written.to(total.device)])
        if self.world > 1:
            all_reduce(total, self.group, op="sum")
        if watched:
            _refuse_outside_writes(watched, total[-len(watched) :])
        sums = total[:width] if partitioned else local
        if mp is None:
            value = sums[0].item()
        else:  # each model-parallel rank holds other shards of the split parameters, the same replicated ones
            split = sums[1:2].clone()
            all_reduce(split, mp.group, op="sum")
            value = (sums[0] + split[0]).item()
        pos, has_grad = width, {}
        for g in trainable:
            has_grad[g.index] = (total[pos : pos + len(g.slots)] > 0).tolist()
            pos += len(g.slots)
        norm = math.sqrt(value) / self.loss_scaler.scale if math.isfinite(value) else float("nan")
        return norm, has_grad

    def check_outside_writes(self) -> None:
        """Collective where the store watches persistent stage-3 parameters (one small all-reduce): raises
        PartitionedWriteError on every rank when some rank wrote one in place outside ``GatheredParameters`` since
        it was gathered, before the ranks compute with different values. A forward-only engine (no optimizer, so
        no step to catch it) calls it before each forward."""
        watched, written = self.params.outside_writes()
        if not watched:
            return
        if self.world > 1:
            all_reduce(written, self.group, op="sum")
        _refuse_outside_writes(watched, written, "each rank would now compute with its own values (no step "
                               "restores them on an engine without an optimizer). The forward was not run")  # fmt: skip

    def step(self) -> StepResult:
        """Reduce what is pending, compute the global norm, skip on overflow, clip, step the shard, refresh params.

        On a non-finite norm (all ranks agree: it comes from one all-reduce) parameters and optimizer state are
        left bitwise unchanged, the loss scaler backs off, ``skipped_steps`` grows and ``overflow`` is True.
        Gradients are cleared either way.
        """
        if self.closed or self.forward_only:
            self._check_open()
            self._check_trains("step")
        self.reducer.finish_round(final=True)
        norm, has_grad = self._grad_norm()
        self.overflow = not math.isfinite(norm)
        coef = 1.0 / self.loss_scaler.scale
        if self.gradient_clipping > 0 and not self.overflow:
            coef *= min(1.0, self.gradient_clipping / (norm + 1e-6))
        grads = {}  # the reducer's gradient shards, handed to the master store's step
        for g in self._trainable:
            grads[g.index] = self.reducer.grad_shard(g)
        decision = StepDecision(self.overflow, coef, norm, has_grad, grads)
        with record_function("zero::step"):
            stepped = self.master.step(decision)
        if stepped:
            self.params.refresh(self.master)
        if self.overflow or self.loss_scaler.dynamic:  # a fixed scale's update counts overflows only
            self.loss_scaler.update(self.overflow)
        if self.overflow:
            self.skipped_steps += 1
        self.zero_grad()
        return StepResult(stepped, self.overflow, norm)

    def write_master(self, g: FlatGroup, where: slice, values: torch.Tensor) -> None:
        """``values`` (edited outside a step: ``GatheredParameters`` with a ``modifier_rank``) become the master of
        trainable flat group ``g`` at ``where`` in this rank's shard, wherever the master store keeps it."""
        self.master.write_master(g, where, values)

    def _check_unmanaged_grads(self) -> None:
        """Stage 3: a parameter in no optimizer group that now requires grad cannot accumulate a gradient (its
        storage is a released shard). Stages 0-2 let autograd fill its ``.grad`` and never step it, as torch."""
        for s in self._unmanaged:
            if s.param.requires_grad:
                raise ValueError(f"parameter {s.name!r} requires grad but is in no optimizer param group, "
                                 "which stage 3 cannot hold a gradient for; add it to the optimizer "
                                 "before initialize or keep requires_grad=False")  # fmt: skip

    def _check_trains(self, what: str) -> None:
        if self.forward_only:
            raise RuntimeError(f"{what}(): this runtime was built without an optimizer (forward only: a frozen "
                               "reference or teacher model); build it with an optimizer to train")  # fmt: skip

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("ZeroRuntime: this runtime was closed; its module holds plain parameters now")

    def close(self) -> None:
        """Detach the runtime: every hook removed, each parameter a plain dense tensor of its own holding its
        current values (what the last forward used), the optimizer given its original parameters back with no
        state, registries emptied. Collective at stage 3 (units are gathered). Idempotent. DeepSpeed:
        ``engine.destroy()``; DeepCompile calls the same before its graph takes over."""
        if self.closed:
            return
        self.reducer.finish_round()
        self.reducer.close()
        self.params.close()
        self.master.close()
        registry.release(self)
        for g in self.flat_groups:
            for s in g.slots:
                s.param.grad = None
        self.closed = True

    def empty_partition_cache(self) -> None:
        """Release every gathered parameter and forget the prefetch state (DeepSpeed's ``empty_partition_cache``;
        stage 3 only, a no-op at stages 0-2). Every rank calls it at the same point, outside forward/backward."""
        self._check_open()
        self.params.empty_cache()

    def zero_grad(self) -> None:
        """Clear accumulated gradients (the optimizer's ``zero_grad`` has nothing to clear: ``.grad`` is transient)."""
        self.reducer.zero()

    # ---------------------------------------------------------------- accessors
    def _gather_shard(self, g: FlatGroup, shard: torch.Tensor) -> torch.Tensor:
        """Unpadded flat vector from every rank's ``shard`` (collective when partitioned)."""
        if g.partitions == 1:
            return g.full_from_shards([shard.detach()])
        out = torch.empty(g.shard_numel * g.partitions, dtype=shard.dtype, device=shard.device)
        all_gather_into_tensor(out, shard.detach().contiguous(), self.group)
        return g.full_from_shards(list(out.view(g.partitions, g.shard_numel).unbind(0)))

    def _stored(self, g: FlatGroup) -> torch.Tensor:
        """``shards()``'s entry for ``g``: the master shard (trainable), the stored shard (frozen, partitioned) or
        the unpadded whole buffer (frozen, one partition)."""
        master = self.master.master_shard(g)
        if master is not None:
            return master.detach()
        if g.partitions == 1 and self.stage < 3:  # the historical form at stages 0-2 (checkpoints expect it)
            return g.full_from_shards([self.params.shard_values(g)])
        return self.params.shard_values(g)

    def _stored_numel(self, g: FlatGroup) -> int:
        """``_stored(g).numel()`` without reading it."""
        if g.group_index is None and g.partitions == 1 and self.stage < 3:
            return sum(b.numel for b in g.buckets)
        return g.shard_numel

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Name -> full fp32 parameter (new tensors, logical shapes): masters for trainable parameters, the stored
        values for frozen ones. Collective: every rank must call it."""
        out = {}
        for g in self.flat_groups:
            stored = self._stored(g)
            unpadded = g.partitions == 1 and self.stage < 3 and self.master.master_shard(g) is None
            flat = stored if unpadded else self._gather_shard(g, stored)
            for s in g.slots:
                out[s.name] = flat[s.offset : s.offset + s.numel].view(s.shape).float().clone()
        return out

    def full_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """The full accumulated gradient of ``param`` (fp32, logical shape; unscaled by nothing: it is what the
        optimizer would see before clipping and loss-scale division), like DeepSpeed's ``safe_get_full_grad``.
        Finishes pending reductions first. None for frozen parameters. Collective: every rank must call it."""
        found = registry.lookup(param)
        if found is None or found.owner is not self:
            raise ValueError(f"full_grad: tensor of shape {tuple(param.shape)} is not a parameter of this runtime")
        g, s = found.group, found.slot
        if g.group_index is None or not param.requires_grad:
            return None
        flat = self._gather_shard(g, self.grad_values(g))
        return flat[s.offset : s.offset + s.numel].view(s.shape).float().clone()

    def grad_values(self, g: FlatGroup) -> torch.Tensor | None:
        """This rank's accumulated gradient shard of ``g`` (``g.shard_numel`` elements, the accumulation dtype, in
        units of the scaled loss) after pending reductions land: the reducer's own tensor, or where the master
        store keeps the gradients (streamed to NVMe) a copy read from it. None for a frozen group. After writing
        into it, call :meth:`grad_edited`."""
        if g.group_index is None:
            return None
        self.reducer.finish_round()
        shard = self.reducer.grad_shard(g)
        return shard if shard is not None else self.master.read_grad_shard(g)

    def grad_edited(self, g: FlatGroup, shard: torch.Tensor) -> None:
        """``shard`` (from :meth:`grad_values`) was written: the master store takes the new values, so the next
        ``step()``'s norm, clip and update use them on every path (host or NVMe copies made during backward,
        SuperOffload's speculative steps, gradients streamed to swap files)."""
        self.master.grad_edited(g, shard)

    def checkpointable(self) -> ZeroRuntimeCheckpoint:
        """This runtime seen through ``zero_core.checkpoint``'s ``Checkpointable`` protocol (what save and load
        take)."""
        return ZeroRuntimeCheckpoint(self)

    def shards(self) -> list[torch.Tensor]:
        """Per flat group: the fp32 master shard (trainable) or the stored parameter shard (frozen; unpadded whole
        buffer when not partitioned): what a checkpoint saves and ``load_master_shards`` takes back."""
        return [self._stored(g) for g in self.flat_groups]

    @torch.no_grad()
    def load_master_shards(self, shards: list[torch.Tensor]) -> None:
        """Copy this rank's shards (as ``shards()`` returns, one per flat group; reshard with ``FlatGroup``
        ``full_from_shards``/``shard_from_full``) in and refresh the model's parameters. Collective.

        Raises ValueError naming the flat group when a count or size does not match.
        """
        if len(shards) != len(self.flat_groups):
            raise ValueError(f"load_master_shards: expected {len(self.flat_groups)} shards, got {len(shards)}")
        for g, src in zip(self.flat_groups, shards):
            want = self._stored_numel(g)
            if src.numel() != want:
                raise ValueError(f"load_master_shards: flat group {g.index} ({g.names[:3]}...) expects "
                                 f"{want} elements, got {src.numel()}")  # fmt: skip
        self.params.before_write()
        for g, src in zip(self.flat_groups, shards):
            if g.group_index is not None:  # trainable: into its master (read none back: it may be on NVMe)
                self.master.load_master_shard(g, src)
            elif g.partitions == 1 and self.stage < 3:
                self.params.load_frozen(g, g.shard_from_full(src.reshape(-1)))
            else:
                self.params.load_frozen(g, src)
        self.params.refresh(self.master)

    def model_state_bytes(self) -> dict[str, int]:
        """This rank's bytes of params, grads, master weights and optimizer state (see ``zero_core.memory``)."""
        params = [s.param for g in self.flat_groups for s in g.slots]  # views of the full buffers (deduplicated)
        params += self.params.resident()  # stage 3: the stored shards (frozen units held as int8: their blocks)
        state = self.optimizer.state if self.optimizer is not None else {}
        return model_state_bytes(params=params, grads=self.reducer.resident(), master=self.master.resident(),
                                 optimizer_state=state)  # fmt: skip


def _refuse_outside_writes(watched, counts: torch.Tensor, consequence: str | None = None) -> None:
    """PartitionedWriteError (on every rank: ``counts`` is all-reduced) naming the persistent parameters some
    rank wrote in place outside ``GatheredParameters``: the step would restore them from the master silently
    (``consequence`` says what else would go wrong instead)."""
    hit = [s for s, c in zip(watched, counts.tolist()) if c > 0]
    if hit:
        named = ", ".join(f"{s.name!r} of shape {tuple(s.shape)}" for s in hit[:4]) + (" ..." if len(hit) > 4 else "")
        raise PartitionedWriteError(
            f"stage 3: {len(hit)} parameter(s) were written in place outside a gather since the last step ({named}); "
            "they stay gathered (stage3_param_persistence_threshold), so the write reached this rank's copy only and "
            + (consequence or "the step would undo it from the partitioned master. No step was taken")
            + ". Write inside `with GatheredParameters(params, modifier_rank=0):` (zero.zero / deepspeed.zero)"
        )
