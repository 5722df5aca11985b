"""Variation point 3: where the fp32 master shard and the optimizer state live, and who steps them.

``ZeroRuntime`` talks to a :class:`MasterStore`; :class:`~zero_core.master_device.DeviceMaster` (the default) keeps
them on the parameters' device and steps them with the user's ``torch.optim.Optimizer``. zero_offload plugs in here
(host memory or NVMe, CPU Adam, SuperOffload's speculative step) by passing ``ZeroRuntime(..., master_store=...)``:
a *builder*, a callable that takes the :class:`MasterStoreInputs` the runtime offers and returns the store.

Who calls what, per step (all on every rank; shards are ``FlatGroup.shard_numel`` elements, layout in
``zero_core.layout``):

1. The builder once, after the parameter store holds the weights and before the gradient reduction exists: the
   store builds its master shards from ``inputs.flat_groups`` and ``inputs.params`` (:class:`ParamShards`:
   ``shard_view(g)`` / ``shard_values(g)`` / ``master_chunk(b)``) and takes over the optimizer.
2. ``begin_backward(is_boundary)`` as every backward starts, for a store with ``reads_ahead`` (``is_boundary`` as
   ``ZeroRuntime.backward`` got it): a store whose state lives on slow storage starts reading what the next step
   needs, so the reads overlap backward (the NVMe store; the state does not change before ``step``).
   ``on_grad_ready(bucket, grad_shard, boundary)``, for a store with ``watches_grads``, each time the reducer
   finished adding a bucket's reduced gradient into this rank's gradient shard (``grad_shard``: the bucket's
   ``chunk`` elements of the reducer's gradient shard of its flat group, in the accumulation dtype; a bucket
   reduced in several pieces, e.g. DDP-sized ones, is handed piece by piece, ``start=`` giving the shard offset of
   each part). During backward, as each reduction lands, at stages 2/3 (overlap on), at the boundary backward or
   at ``step()`` at stages 0/1. ``boundary`` True: the last backward before ``step()`` (False: more may follow;
   None: unknown).
3. ``step(decision)`` once per ``ZeroRuntime.step()`` with the global :class:`StepDecision` (overflow, clip
   coefficient, which parameters got a gradient, the reducer's gradient shards). On overflow it must leave weights
   and state unchanged (or roll back a speculative step) and return False.
4. ``write_params(bucket, dst)`` after a step that returned True and after loads, once per trainable bucket: write
   this rank's updated chunk in ``dst``'s dtype (the parameter storage dtype) into ``dst`` (``bucket.chunk``
   elements); the parameter store all-gathers from it.
5. Checkpoints: ``master_shard(g)``, ``state_shard(g)``, ``load_master_shard(g, t)``, ``load_state_shard(g, d)``,
   ``clear_state(g)``; hyper-parameters through ``param_groups``. Tensors are in the shard layout.
6. ``close()`` when the runtime closes.

Optional, stage 3: a store with ``takes_grad_shards = True`` (decided when it is built) keeps the gradients itself:
the reducer then holds no gradient shard and calls ``on_grad_ready`` with each reduced chunk of every micro-batch
(``boundary`` False before the last; with ``start=``, the shard offset of a part of the chunk: a unit reduced in
pieces of ``reduce_bucket_size``), and the runtime asks the store's ``grad_sq_norm()`` (a float64 tensor: the
sum of squares of this rank's accumulated gradient, in units of the scaled loss) for the clipping norm; the
reducer's ``zero()`` calls the store's ``drop_grads()`` (the accumulated gradients are discarded).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from zero_core.comm_context import CommContext
from zero_core.layout import Bucket, FlatGroup
from zero_core.precision import PrecisionPolicy
from zero_core.shard_storage import ShardStorage


@dataclass(frozen=True)
class StepDecision:
    """What ``ZeroRuntime.step()`` decided before stepping (identical on every rank).

    Attributes:
        overflow: the global gradient norm is inf/nan: skip (or roll back) the step.
        coef: multiply the accumulated gradient shards by this before stepping (1/loss scale times the clip
            factor of ``torch.nn.utils.clip_grad_norm_``).
        grad_norm: the pre-clip global norm (unscaled).
        has_grad: flat-group index -> one bool per slot (``g.slots`` order): the parameter got a gradient since
            the last step on some rank. A parameter without one is skipped, as torch skips ``grad is None``.
        grad_shards: trainable flat-group index -> this rank's accumulated gradient shard (the reducer's own
            tensor: ``g.shard_numel`` elements, the accumulation dtype, in units of the scaled loss; a store may
            scale it in place), or None where the master store keeps the gradients itself (``takes_grad_shards``).
    """

    overflow: bool
    coef: float
    grad_norm: float
    has_grad: dict[int, list[bool]] = field(default_factory=dict)
    grad_shards: dict[int, torch.Tensor | None] = field(default_factory=dict)


class ParamShards(Protocol):
    """What a master store reads of the parameter store (``zero_core.param_store.ParamStore`` offers all of it)."""

    offloaded: bool
    """The stored shards live off the compute device between uses (zero_offload's parameter offload)."""

    def master_chunk(self, b: Bucket) -> torch.Tensor | None:
        """This rank's chunk of bucket ``b``'s full buffer when it stays allocated (a same-dtype master can be that
        chunk itself), else None."""
        ...

    def shard_view(self, g: FlatGroup) -> torch.Tensor | None:
        """This rank's stored shard as one tensor that *is* the storage, or None."""
        ...

    def shard_values(self, g: FlatGroup) -> torch.Tensor:
        """This rank's stored shard (``g.shard_numel`` elements, storage dtype); may be a copy."""
        ...

    def offloaded_chunks(self) -> ShardStorage | None:
        """Where an offloaded stage-3 store keeps each unit's chunk (its storage policy: ``read_chunk`` /
        ``open_chunk`` / ``close_chunk`` / ``flush``), so a master store can step into it unit by unit; None when
        the shards are not offloaded."""
        ...


class LossScale(Protocol):
    """The runtime's loss scaler, as a master store reads it (``zero_core.precision``'s scalers)."""

    scale: float
    """The factor the loss of the current backward was multiplied by."""


@dataclass(frozen=True)
class MasterStoreInputs:
    """What ``ZeroRuntime`` offers a master store when it builds one (see the module docstring); a store takes
    what it uses in its constructor and keeps no reference to this object.

    Attributes:
        optimizer: the user's optimizer (None: a forward-only runtime, with no trainable flat group).
        flat_groups: every flat group, in ``FlatGroup.index`` order (frozen ones have ``group_index`` None).
        params: the parameter store, through what a master reads of it.
        precision: the dtypes (``master_dtype``, ``param_dtype``, ``compute``...).
        group, rank, world: the data-parallel process group, this rank in it, its size.
        device: the parameters' (compute) device.
        stage: the ZeRO stage (0-3).
        reduce_bucket_size: ``zero_optimization.reduce_bucket_size`` (elements): bounds transient full copies
            (Muon's whole-matrix all-gathers).
        gradient_clipping: the max global gradient norm (0: off), for a store that clips on its own (ZenFlow).
        loss_scaler: the runtime's loss scaler (its ``scale`` during backward, for a store that starts stepping
            before ``step``).
        comm: the runtime's side streams (``zero_core.comm_context.CommContext``: a store that copies gradients to
            host memory does so on its ``copy_stream``); None: none.
    """

    optimizer: torch.optim.Optimizer | None
    flat_groups: tuple[FlatGroup, ...]
    params: ParamShards
    precision: PrecisionPolicy
    group: Any
    rank: int
    world: int
    device: torch.device
    stage: int
    reduce_bucket_size: int
    gradient_clipping: float
    loss_scaler: LossScale
    comm: CommContext | None = None


@runtime_checkable
class MasterStore(Protocol):
    """Where the master shard and optimizer state live and who steps them (see the module docstring)."""

    param_groups: list[dict[str, Any]]
    """The optimizer's hyper-parameter dicts (``lr``...), one per optimizer param group; schedulers write here."""
    takes_grad_shards: bool
    """Stage 3: the store keeps the gradients itself (see the module docstring); the reducer then holds no shard."""
    params_written: bool
    """The last step wrote the new parameter values into the parameter store itself; the store's refresh resets it
    and skips asking for them again."""
    reads_ahead: bool
    """``begin_backward`` does work (a store on slow storage starts its reads); False: the runtime skips it."""
    watches_grads: bool
    """``on_grad_ready`` does work (a store that copies each reduced gradient off the device, or starts stepping);
    False: the reducer does not call it for buckets reduced into its own gradient shards (a store that keeps the
    gradients itself, ``takes_grad_shards``, is handed every chunk regardless)."""

    def begin_backward(self, is_boundary: bool | None) -> None: ...

    def on_grad_ready(
        self, bucket: Bucket, grad_shard: torch.Tensor, boundary: bool | None, start: int | None = None
    ) -> None: ...

    def grad_edited(self, g: FlatGroup, shard: torch.Tensor) -> None:
        """``g``'s accumulated gradient shard was overwritten between backward and ``step`` (DeepSpeed's
        ``safe_set_full_grad`` / ``safe_set_local_grad``); ``shard`` holds the new values (``g.shard_numel``
        elements: the reducer's shard itself, or what ``read_grad_shard`` returned, edited). A store that has
        copied the gradient already (to host memory or swap files) or started stepping it takes the new values, so
        that the norm, the clip and the update all see the edit."""
        ...

    def read_grad_shard(self, g: FlatGroup) -> torch.Tensor | None:
        """A store that keeps the gradients itself (``takes_grad_shards``): a new tensor with ``g``'s accumulated
        gradient shard (``g.shard_numel`` elements, fp32, in units of the scaled loss); None for other stores."""
        ...

    def step(self, decision: StepDecision) -> bool: ...

    def write_params(self, bucket: Bucket, dst: torch.Tensor) -> None: ...

    def master_shard(self, g: FlatGroup) -> torch.Tensor | None: ...

    def state_shard(self, g: FlatGroup) -> dict[str, Any]: ...

    def load_master_shard(self, g: FlatGroup, shard: torch.Tensor) -> None: ...

    def write_master(self, g: FlatGroup, where: slice, values: torch.Tensor) -> None:
        """Overwrite elements ``where`` of ``g``'s master shard with ``values`` (any float dtype): how an edit
        made under ``GatheredParameters(modifier_rank=...)`` reaches the master wherever it lives."""
        ...

    def load_state_shard(self, g: FlatGroup, state: dict[str, Any]) -> None: ...

    def clear_state(self, g: FlatGroup) -> None: ...

    def checkpoint_pieces(self, g: FlatGroup) -> dict | None:
        """``g``'s master and optimizer state for a checkpoint as pieces streamed from where they live
        (``zero_core.checkpoint.pieces``), never read whole; None: read them with ``master_shard`` /
        ``state_shard``."""
        ...

    def resident(self) -> list[torch.Tensor]:
        """The master tensors this store keeps on the parameters' device (memory accounting; empty when they
        live elsewhere, e.g. offloaded to host memory)."""
        ...

    def close(self) -> None: ...


MasterStoreBuilder = Callable[[MasterStoreInputs], MasterStore]
"""What ``ZeroRuntime(master_store=...)`` takes: builds the store from what the runtime offers."""
