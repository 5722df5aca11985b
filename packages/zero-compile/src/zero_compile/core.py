"""Where the compiled path joins zero_core: a parameter store and a gradient reduction for ``ZeroRuntime``'s seam.

``ZeroRuntime(..., param_store=path.params, grad_reduction=path.grads)`` (``path.grads`` builds the reduction from
the runtime's ``ReductionInputs``; the engine does this when
``compile.deepcompile`` is true) keeps the core's layout (``rt.flat_groups``: flat groups of buckets padded to
equal chunks), its master store (fp32 master shards, the user's optimizer, clipping, overflow; with
``offload_opt_states`` the same store whose state over a budget goes to host memory between steps,
``path.master``) and checkpoints, and replaces two variation points:

* **where parameters live between uses** (stage 3, :class:`CompiledParamStore`): each bucket is a unit; this rank's
  chunk lives in the store's ``param_shard[g.index]`` (storage dtype); a parameter holds a placeholder (0 elements
  at rest, its full shape over an empty storage from a compiled forward to the next step), installs no hook, and
  is gathered by the graphs' operations; outside the graphs (``GatheredParameters``) the store gathers it
  (``zero_compile.param_gathers``). ``refresh`` writes the stepped master values into the chunks and drops
  gathered buffers; ``close`` gives every parameter dense storage with its current values (collective). At stages
  1/2 the core's dense store stays.
* **how gradients are reduced** (:class:`CompiledGradReduction`): no autograd hooks; the backward graphs
  reduce-scatter each bucket (rank average, ``precision.reduce`` dtype) and the chunk is added into
  this rank's gradient shard (``grad_shard(g)[bucket.shard_slice()]``), then the master store is told
  (``on_grad_ready``). At stage 1, as in the core, micro-steps before the accumulation boundary add into a local
  full-bucket buffer and the boundary's backward (or ``step()``) reduce-scatters once.

The unit layout handed to zero_compile's passes is read from those buckets once (:class:`RuntimeSource`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zero_comm import all_gather_into_tensor
from zero_compile.compiled import CompiledZero
from zero_compile.layout import CompiledLayout
from zero_compile.offload_states import OffloadedStatesMaster
from zero_compile.param_gathers import OutsideGathers
from zero_core.grad_reduction import ReductionInputs
from zero_core.materialize import bucket_values
from zero_core.param_store import ParamStoreInputs
from zero_core.partition_records import forget


class RuntimeSource:
    """The :class:`~zero_compile.layout.ShardSource` over a ``ZeroRuntime``'s buckets (see the module docstring).

    Args (keyword-only):
        flat_groups: the runtime's layout; stage: its ZeRO stage; world / rank: the data-parallel group.
        reduce_dtype: the gradient reduction dtype (``precision.reduce``).
        params: the runtime's parameter store: stage 3's stored shards (``shard_view``), stages 1/2's full
            buffers (``full_of``).
        reduction: the compiled gradient reduction (``grad_shard``, ``got``, ``boundary``).
        on_grad_ready: the master store's ``on_grad_ready(bucket, grad_shard, boundary)``.
    """

    def __init__(self, *, flat_groups, stage: int, world: int, rank: int, reduce_dtype: torch.dtype, params,
                 reduction: CompiledGradReduction, on_grad_ready: Callable):  # fmt: skip
        self.stage, self.params, self.reduction, self.on_grad_ready = stage, params, reduction, on_grad_ready
        groups = [g for g in flat_groups if stage == 3 or g.group_index is not None]
        self.buckets = [(g, b) for g in groups for b in g.buckets]
        self.layout = CompiledLayout(tuple(b for _g, b in self.buckets), world, rank)
        self.reduce_dtype = reduce_dtype
        self._slot_in_group = [[g.slots.index(s) for s in b.slots] for g, b in self.buckets]

    def shard(self, unit: int) -> torch.Tensor:
        g, b = self.buckets[unit]
        if self.stage == 3:
            return self.params.shard_view(g)[b.shard_slice()]
        return self.params.full_of(b)[slice(*b.chunk_range(g.rank))]

    def add_grad_shard(self, unit: int, chunk: torch.Tensor, slots: list[int], *, offset: int = 0,
                       ready: bool = True) -> None:  # fmt: skip
        g, b = self.buckets[unit]
        dst = self.reduction.grad_shard(g)[b.shard_slice()]
        dst[offset : offset + chunk.numel()].add_(chunk.to(dst.dtype))
        got = self.reduction.got[g.index]
        for i in slots:
            got[self._slot_in_group[unit][i]] = True
        if ready:  # the master store hears of a bucket once per reduction, after its last piece
            self.on_grad_ready(b, dst, bool(self.reduction.boundary))


class CompiledParamStore(OutsideGathers):
    """Stage 3's ``ParamStore`` for the compiled path (see the module docstring). Building it shards every bucket
    from rank 0's values into ``param_shard`` (one collective per bucket) and leaves parameters holding 0-element
    placeholders. It is the ``zero_core.registry.UnitHolder`` of its parameters: ``GatheredParameters`` gathers
    them through it (:class:`~zero_compile.param_gathers.OutsideGathers`).

    Args (keyword-only; :meth:`from_inputs` takes the first three from the runtime's ``ParamStoreInputs``):
        flat_groups: the layout; group: the data-parallel process group; precision: storage and compute dtypes.
        end_step: drops the buffers the compiled graphs keep gathered (after a step or a load, and for
            ``empty_cache``); the compiled graphs exist only once the gradient reduction is built.
        module: the model, whose ``state_dict()`` gets 0-element entries for released parameters (never a view
            of an empty storage); None: no hook.
    """

    offloaded = False
    gathers_units = True  # the graphs gather inside; GatheredParameters gathers outside through this store

    @torch.no_grad()
    def __init__(self, *, flat_groups, group, precision, end_step: Callable[[], None],
                 module: torch.nn.Module | None = None):  # fmt: skip
        super().__init__(flat_groups=flat_groups, group=group, param_dtype=precision.param_dtype,
                         compute_dtype=precision.compute)  # fmt: skip
        self.end_step = end_step
        self.closed = False
        # torch marks the hook function itself, so it must be a plain function, not a bound method
        self._hook = None if module is None else module.register_state_dict_post_hook(
            lambda *a: self.empty_released(*a))  # fmt: skip
        dtype = self.param_dtype
        # FlatGroup.index -> this rank's stored shard
        self.param_shard = [torch.zeros(g.shard_numel, dtype=dtype, device=g.device) for g in flat_groups]
        for g in flat_groups:
            for b in g.buckets:
                full = torch.empty(b.padded_numel, dtype=dtype, device=g.device)
                bucket_values(b, group, dtype, full)  # one collective per bucket (as the core's stage 3)
                self.param_shard[g.index][b.shard_slice()] = full[slice(*b.chunk_range(g.rank))]
                for s in b.slots:
                    s.param.data = torch.empty(0, dtype=self.compute_dtype, device=g.device)
                    forget(s.param)

    @classmethod
    def from_inputs(cls, inputs: ParamStoreInputs, end_step: Callable[[], None]) -> CompiledParamStore:
        """The store for what the runtime offers."""
        return cls(flat_groups=inputs.flat_groups, group=inputs.group, precision=inputs.precision, end_step=end_step,
                   module=inputs.module)  # fmt: skip

    def master_chunk(self, b) -> None:
        """None: a unit's full buffer exists only inside the compiled graph."""
        return None

    def offloaded_chunks(self) -> None:
        """None: the stored shards stay on the device."""
        return None

    def shard_view(self, g) -> torch.Tensor:
        """This rank's stored shard (``shard_numel`` elements, storage dtype)."""
        return self.param_shard[g.index]

    def shard_values(self, g) -> torch.Tensor:
        """This rank's stored shard (the tensor itself)."""
        return self.param_shard[g.index]

    def resident(self) -> list[torch.Tensor]:
        """The stored shards (``zero_core.memory``)."""
        return list(self.param_shard)

    @torch.no_grad()
    def refresh(self, master) -> None:
        """After a step or a load: stepped values into the stored chunks; gathered buffers are stale, drop them."""
        for g in self.flat_groups:
            if g.group_index is None:
                continue
            for b in g.buckets:
                master.write_params(b, self.param_shard[g.index][b.shard_slice()])
        self.end_step()
        self.to_rest()  # between steps a released parameter reads as an empty tensor, never freed memory

    @torch.no_grad()
    def load_frozen(self, g, shard: torch.Tensor) -> None:
        """Frozen group ``g``: new stored shard."""
        self.param_shard[g.index].copy_(shard.reshape(-1))

    def begin_backward(self) -> None:
        """Nothing: the backward graphs gather what they use."""

    def end_backward(self) -> None:
        """Nothing: the backward graphs released what they used."""

    def before_reduce(self) -> None:
        """Nothing to settle: the graphs run no divergence check."""

    def before_write(self) -> None:
        """Nothing: the graphs all-gather; no peer reads the stored shards directly."""

    def shards_edited(self) -> None:
        """Stored chunks were written outside a step (``GatheredParameters`` with a modifier): the buffers the
        graphs keep gathered are stale, drop them."""
        self.end_step()

    def on_grads_done(self, bucket) -> None:
        """Nothing to release: no eager hooks hold gathered units."""

    def outside_writes(self) -> tuple[list, torch.Tensor]:
        """None watched: no parameter holds values between uses (a write into a placeholder raises or holds no
        element)."""
        return [], torch.zeros(0, dtype=torch.float64)

    def empty_cache(self) -> None:
        """Drop every gathered buffer the graphs keep (waiting for gathers in flight): the next graphs gather
        again (DeepSpeed's ``empty_partition_cache``)."""
        self.end_step()

    @torch.no_grad()
    def close(self) -> None:
        """Give every parameter dense storage holding its current values (collective: one all-gather per bucket)."""
        if self.closed:
            return
        if self._hook is not None:
            self._hook.remove()
        for g in self.flat_groups:
            for b in g.buckets:
                full = torch.empty(b.padded_numel, dtype=self.param_dtype, device=g.device)
                chunk = self.param_shard[g.index][b.shard_slice()].contiguous()
                all_gather_into_tensor(full, chunk, self.group)
                for s in b.slots:
                    s.param.data = (
                        full[s.bucket_offset : s.bucket_offset + s.numel].view(s.shape).to(self.compute_dtype)
                    )
        self.param_shard = []
        self.closed = True


class CompiledGradReduction:
    """The ``GradReduction`` of the compiled path (see the module docstring). :meth:`CompiledPath.grads` builds it
    (last, once layout, parameter store and master store exist) and the :class:`CompiledZero` with it.

    Args:
        path: the compiled path whose graphs reduce into this reduction's shards.
        flat_groups: the layout; each trainable group gets a gradient shard.
        stage: the ZeRO stage (1: micro-steps accumulate locally until the boundary).
        accum_dtype: the gradient shards' dtype (``precision.accum``).
    """

    def __init__(self, *, path: CompiledPath, flat_groups, stage: int, accum_dtype: torch.dtype):
        self.path = path
        self.stage = stage
        self.boundary: bool | None = None
        self.got = {g.index: [False] * len(g.slots) for g in flat_groups if g.group_index is not None}
        self._stepping = False
        # FlatGroup.index -> gradient shard (None: frozen)
        self.shards: list[torch.Tensor | None] = [
            None if g.group_index is None else torch.zeros(g.shard_numel, dtype=accum_dtype, device=g.device)
            for g in flat_groups
        ]
        self.streamed = False  # the graphs reduce into the shards above; nothing goes to the master store early

    def wait_reduced(self) -> None:
        """Nothing is streamed on the compiled path (``streamed`` is False)."""

    def begin_backward(self, is_boundary: bool | None) -> None:
        # stage 1 (as the core's): accumulate locally and reduce in the boundary's backward (or at step())
        self.boundary = is_boundary
        self.path.compiled.store.defer = self.stage == 1 and not is_boundary

    def end_backward(self) -> None:
        self.path.compiled.after_backward()

    def finish_round(self, final: bool = False) -> None:
        if final:
            self.boundary, self._stepping = True, True
            self.path.compiled.store.reduce_deferred()
        self.path.compiled.after_backward()

    def has_grad(self) -> dict[int, list[bool]]:
        return self.got

    def grad_shard(self, g) -> torch.Tensor | None:
        """This rank's accumulated gradient shard of ``g`` (None: frozen, or closed)."""
        return self.shards[g.index] if g.index < len(self.shards) else None

    def resident(self) -> list[torch.Tensor]:
        """The gradient shards (the graphs' bucket buffers are transient)."""
        return [t for t in self.shards if t is not None]

    def zero(self) -> None:
        self.path.compiled.store.flush()
        self.path.compiled.store.drop_deferred()
        for t in self.shards:
            if t is not None:
                t.zero_()
        for flags in self.got.values():
            flags[:] = [False] * len(flags)
        if self._stepping:  # the zero() that ends runtime.step(): advance the schedule
            self._stepping = False
            self.path.compiled.after_step()

    def close(self) -> None:
        if self.path.compiled is not None:
            self.path.compiled.close()
        self.shards = []


class CompiledPath:
    """The compiled path of one runtime: ``params`` (stage 3: the :class:`CompiledParamStore` builder; else None:
    the core's dense store) and ``grads`` to pass to ``ZeroRuntime``, then :meth:`forward` as the model's forward.

    Args: as :class:`~zero_compile.compiled.CompiledZero` (``stage``, ``backend``, ``warmup_steps``,
    ``budget_bytes``, ``unshard``, ``prefetch``, ``debug_dir``), plus ``offload_opt_states`` (``master``: the
    builder of an :class:`~zero_compile.offload_states.OffloadedStatesMaster` keeping ``opt_states_budget_bytes``
    of optimizer state on the device; else None: the core's device store) and ``pin_memory`` for its host buffers.
    """

    def __init__(self, *, stage: int, offload_opt_states: bool = False, opt_states_budget_bytes: int = 0,
                 pin_memory: bool = True, **options):  # fmt: skip
        self.stage, self.options = stage, options
        # the master store's builder (None: the core's device store)
        self.master = OffloadedStatesMaster.builder(opt_states_budget_bytes, pin_memory) if offload_opt_states else None
        # stage 3: the parameter store's builder (``ZeroRuntime(param_store=...)``); else the core's dense store
        self.params = self._param_store if stage == 3 else None
        self.compiled: CompiledZero | None = None
        self._param_store_built: CompiledParamStore | None = None  # stage 3's, once the runtime built it

    def _param_store(self, inputs: ParamStoreInputs) -> CompiledParamStore:
        self._param_store_built = CompiledParamStore.from_inputs(inputs, end_step=self._end_step)
        return self._param_store_built

    def _end_step(self) -> None:
        """Drop the buffers the compiled graphs keep gathered (nothing before they are compiled)."""
        if self.compiled is not None:
            self.compiled.store.end_step()

    def grads(self, inputs: ReductionInputs) -> CompiledGradReduction:
        """The ``grad_reduction`` builder to pass to ``ZeroRuntime``: the path's :class:`CompiledGradReduction`,
        with ``inputs.module`` compiled over the runtime's buckets (:class:`RuntimeSource`)."""
        reduction = CompiledGradReduction(path=self, flat_groups=inputs.flat_groups, stage=inputs.stage,
                                          accum_dtype=inputs.precision.accum)  # fmt: skip
        source = RuntimeSource(flat_groups=inputs.flat_groups, stage=inputs.stage, world=inputs.world,
                               rank=inputs.rank, reduce_dtype=inputs.precision.reduce, params=inputs.params,
                               reduction=reduction, on_grad_ready=inputs.master.on_grad_ready)  # fmt: skip
        self.compiled = CompiledZero(inputs.module, source, inputs.group, stage=self.stage, **self.options)
        return reduction

    def forward(self, *args, **kwargs):
        """The compiled model's forward (stage 3: the parameters take full-shaped placeholders first, and 0-element
        ones again after a forward without autograd)."""
        store = self._param_store_built
        if store is not None:
            store.shape_for_graphs()
        out = self.compiled(*args, **kwargs)
        if store is not None and not torch.is_grad_enabled():  # no backward follows (evaluation)
            store.to_rest()
        return out
