"""``OffloadMaster``: zero_core's master-store variation point with the masters and optimizer state off the device.

Plugs into ``zero_core.ZeroRuntime(..., master_store=OffloadMaster.builder("cpu", ...))`` (protocol:
``zero_core.master``):

* when built: copies this rank's fp32 master shards to host memory (``device: cpu``, :class:`HostOptimizer`) or
  to swap files (``device: nvme``, :class:`NVMeOptimizer`), carrying over state the optimizer already holds;
* ``on_grad_ready``: at the accumulation boundary, each reduced gradient chunk (a bucket, or a piece of one) is
  copied to the host as it lands, on the runtime's copy stream without blocking the training thread (overlapped with
  the rest of backward); with ``super_offload`` the sub-groups it completes start their speculative step in the
  worker (:class:`SpeculativeStep`), which waits for their copies first;
* ``step``: CPU Adam's one-pass step with the runtime's clip coefficient and overflow decision (or validation of
  the speculative one); ``write_params``: the updated values in the storage dtype for the all-gather;
* NVMe at stage 3 with ``offload_param`` (ZeRO-Infinity): ``takes_grad_shards``; the core keeps no gradient
  shard, each reduced chunk of every micro-batch streams to the swap files (:class:`NVMeOptimizer`
  ``stream_grads``), the clipping norm comes from ``grad_sq_norm``, the masters are read unit by unit from the
  parameter store at start and the step writes each unit's new values straight into it (``params_written``: the
  store's refresh then writes nothing again);
* a whole-matrix optimizer's groups (Muon's; ``zero_core.matrix_step``) step on the host too: one momentum
  buffer per parameter piece in host memory, Newton-Schulz on the CPU, an all-gather where a matrix straddles a
  shard boundary (device ``cpu``, ``ratio`` 1, no SuperOffload);
* checkpoints see one fp32 master shard and torch's Adam state per flat group, the same layout as without offload,
  so checkpoints move between offloaded and non-offloaded runs; ``close`` frees host memory and swap files.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from zero_core.comm_context import CommContext
from zero_core.layout import FlatGroup
from zero_core.master import LossScale, MasterStoreInputs, ParamShards
from zero_core.master_device import shard_param_state
from zero_core.matrix_step import WholeMatrixOptimizer, load_pieces_state, pieces_state, step_whole_matrices
from zero_offload.host_optimizer import HostOptimizer
from zero_offload.nvme_optimizer import NVMeOptimizer
from zero_offload.speculative import SpeculativeStep
from zero_offload.stream import UnitWriter


@dataclass(frozen=True)
class OffloadOptions:
    """The ``offload_optimizer`` keys an :class:`OffloadMaster` uses, checked when made.

    Attributes:
        device: ``"cpu"`` or ``"nvme"`` (``offload_optimizer.device``).
        pin_memory, ratio, super_offload, cpuadam_cores_perc: the ``offload_optimizer`` keys of the same names.
        sub_group_size: ``zero_optimization.sub_group_size`` (elements).
        nvme: for ``device="nvme"``, a callable ``(masters, indices, optimizer, out_dtype, cuts, stream=None) ->
            NVMeOptimizer`` that the engine builds after its start-up checks (see ``zero_offload.build``).

    Raises:
        ValueError: an unknown device, ``super_offload`` with ``device="nvme"`` (named by key), or ``nvme``
            missing for ``device="nvme"``.
    """

    device: str = "cpu"
    pin_memory: bool = False
    ratio: float = 1.0
    super_offload: bool = False
    cpuadam_cores_perc: float = 0.8
    sub_group_size: int = 1_000_000_000
    nvme: Callable | None = None

    def __post_init__(self):
        if self.device not in ("cpu", "nvme"):
            raise ValueError(f"zero_optimization.offload_optimizer.device must be 'cpu' or 'nvme', got {self.device!r}")
        if self.super_offload and self.device != "cpu":
            raise ValueError("zero_optimization.offload_optimizer.super_offload needs device 'cpu' (the speculative "
                             f"step keeps its backups in host memory); got device {self.device!r}")  # fmt: skip
        if self.device == "nvme" and self.nvme is None:
            raise ValueError("OffloadMaster(device='nvme') needs the nvme factory (see zero_offload.build)")


def offered(inputs: MasterStoreInputs) -> dict[str, Any]:
    """The keyword arguments :class:`OffloadMaster` takes from what the runtime offers a master store."""
    return dict(optimizer=inputs.optimizer, flat_groups=inputs.flat_groups, params=inputs.params, stage=inputs.stage,
                param_dtype=inputs.precision.param_dtype, device=inputs.device, group=inputs.group,
                reduce_bucket_size=inputs.reduce_bucket_size, loss_scaler=inputs.loss_scaler,
                comm=inputs.comm)  # fmt: skip


class OffloadMaster:
    """Masters and optimizer state of one rank in host memory or on NVMe; see the module docstring.

    Built (by :meth:`builder`'s callable, which ``ZeroRuntime`` calls) after the parameter store holds the weights:
    the masters start from the stored shards and the optimizer's param groups then hold them.

    Args:
        options: the ``offload_optimizer`` keys (:class:`OffloadOptions`).
        optimizer: the user's optimizer.
        flat_groups: every flat group (``FlatGroup.index`` order); the trainable ones get a master shard.
        params: the parameter store; at stage 3 with ``offload_param`` and ``device="nvme"`` the step writes the new
            values straight into its unit chunks (``offloaded_chunks()``, :class:`~zero_offload.stream.UnitChunks`).
        stage: the ZeRO stage.
        param_dtype: the parameters' storage dtype (what ``write_params`` writes).
        device: the parameters' device (Twin-Flow's device sub-groups, Muon's all-gathers).
        group: the data-parallel process group (Muon's all-gathers).
        reduce_bucket_size: most elements one of Muon's all-gathers assembles.
        loss_scaler: the runtime's loss scaler (SuperOffload's speculative step unscales with its ``scale``).
        comm: the runtime's side streams (``device="cpu"``: gradients are copied to the host on its copy stream);
            None: each copy blocks.
    """

    def __init__(
        self,
        *,
        options: OffloadOptions,
        optimizer: torch.optim.Optimizer,
        flat_groups: Sequence[FlatGroup],
        params: ParamShards,
        stage: int,
        param_dtype: torch.dtype,
        device: torch.device,
        group,
        reduce_bucket_size: int,
        loss_scaler: LossScale,
        comm: CommContext | None = None,
    ):
        self.device = options.device  # "cpu" or "nvme": where the masters and the optimizer state live
        self.super_offload = options.super_offload
        self.reads_ahead = self.device == "nvme"  # NVMe: the step's reads start as backward begins
        self.watches_grads = True  # on_grad_ready copies each final gradient chunk to the host (or swap files)
        self.optimizer = optimizer
        self._param_device, self._group, self._max_numel = device, group, reduce_bucket_size
        self._loss_scaler = loss_scaler
        self.param_groups: list[dict[str, Any]] = optimizer.param_groups
        self._original = [list(pg["params"]) for pg in self.param_groups]  # the optimizer's own lists, for close()
        self._groups = [g for g in flat_groups if g.group_index is not None]  # master shard i is _groups[i]
        self._pos = {g.index: i for i, g in enumerate(self._groups)}  # FlatGroup.index -> master shard
        self._received: dict[int, int] = {}  # id() of a bucket -> elements of its final gradient chunk received
        self._cache: dict[int, torch.Tensor] = {}  # master shard -> master_shard()'s host copy (NVMe, Twin-Flow)
        # stage 3, NVMe, offload_param: the store keeps the gradients (see the module docstring)
        self.takes_grad_shards = self.device == "nvme" and stage == 3 and params.offloaded
        self.params_written = False
        self._skipped_last: frozenset[int] = frozenset()  # sub-groups the last step left alone (no gradient)
        masters = [] if self.takes_grad_shards else [params.shard_values(g).to(torch.float32) for g in self._groups]
        carried = self._carry_state()
        indices = [g.group_index for g in self._groups]
        cuts, self._owner = self._param_pieces()  # per master shard: sub-group cuts; (start, end, slot) pieces
        # streamed gradients: the step's new values go unit by unit into the parameter store (None: not streamed)
        self._writer: UnitWriter | None = None
        if self.takes_grad_shards:
            for i, g in enumerate(self._groups):  # sub-groups end at unit boundaries: a chunk is whole sub-groups
                cuts[i] += [x for b in g.buckets for x in (b.shard_offset, b.shard_offset + b.chunk)]
            chunks = params.offloaded_chunks()  # not None: takes_grad_shards needs offloaded shards
            self._writer = UnitWriter(chunks, self._groups)
            store = options.nvme(None, indices, optimizer, param_dtype, cuts, stream=self._writer)
        elif self.device == "cpu":
            store = HostOptimizer(masters, indices, optimizer, sub_group_size=options.sub_group_size,
                                  ratio=options.ratio, pin_memory=options.pin_memory, out_dtype=param_dtype,
                                  device=device, cuts=cuts, comm=comm)  # fmt: skip
        else:
            store = options.nvme(masters, indices, optimizer, param_dtype, cuts)
        del masters
        self.store: HostOptimizer | NVMeOptimizer | None = store  # who holds and steps the masters (None: closed)
        for i, st in carried.items():
            self.store.load_shard_state(i, st)
        self.spec: SpeculativeStep | None = None  # SuperOffload's speculative step (its worker thread)
        if options.super_offload:
            self.spec = SpeculativeStep(self.store, options.cpuadam_cores_perc)
        # shard position -> (slot, start, end, view of the host master) for Muon's whole-matrix groups
        self._matrix: dict[int, list[tuple[int, int, int, torch.nn.Parameter]]] = self._matrix_pieces()
        for gi, pg in enumerate(self.param_groups):
            if self.takes_grad_shards:  # no whole master in host memory: empty stand-ins (checkpoints ask the store)
                pg["params"] = [torch.empty(0) for g in self._groups if g.group_index == gi]
                continue
            pg["params"] = [m for g in self._groups if g.group_index == gi if (m := self.master_shard(g)) is not None]

    @classmethod
    def from_inputs(cls, inputs: MasterStoreInputs, *, options: OffloadOptions | None = None) -> OffloadMaster:
        """The store from what the runtime offers and the ``offload_optimizer`` keys (default: host memory)."""
        return cls(options=options or OffloadOptions(), **offered(inputs))

    @classmethod
    def builder(cls, device: str = "cpu", **keys) -> Callable[[MasterStoreInputs], OffloadMaster]:
        """What ``ZeroRuntime(master_store=...)`` takes: ``device`` and ``keys`` as :class:`OffloadOptions`
        (checked now, before any runtime exists)."""
        return functools.partial(cls.from_inputs, options=OffloadOptions(device, **keys))

    def _matrix_pieces(self) -> dict[int, list[tuple[int, int, int, torch.nn.Parameter]]]:
        """Per shard of a whole-matrix param group (Muon's): one view of the live host master per parameter
        piece, the keys of its momentum in the optimizer's state (host memory).

        Raises:
            ValueError: such a group with NVMe, SuperOffload or Twin-Flow's ``ratio`` < 1 (named by key).
        """
        opt = self.optimizer
        if not isinstance(opt, WholeMatrixOptimizer):
            return {}
        out = {}
        for i, g in enumerate(self._groups):
            if not opt.whole_matrix_group(self.param_groups[g.group_index]):
                continue
            live = self.store.master_view(i) if self.device == "cpu" and not self.super_offload else None
            if live is None:
                raise ValueError("zero_optimization.offload_optimizer: Muon's whole-matrix step needs device 'cpu', "
                                 "ratio 1 and super_offload false")  # fmt: skip
            out[i] = [(slot, a, e, torch.nn.Parameter(live[a:e], requires_grad=False)) for slot, a, e in
                      g.slot_pieces()]  # fmt: skip
        return out

    def _step_matrices(self, decision) -> None:
        """Muon's groups: momentum and Newton-Schulz on the host pieces, all-gathers where matrices straddle."""
        for i, pieces in self._matrix.items():
            g = self._groups[i]
            grad = self.store.grad_view(i)
            grad = grad * decision.coef if decision.coef != 1.0 else grad
            step_whole_matrices(self.optimizer, g, pieces, grad, decision.has_grad.get(g.index), self._group,
                                self._param_device, self._max_numel)  # fmt: skip
            self.store.refresh_out(i)

    def _param_pieces(self) -> tuple[list[list[int]], list[list[tuple[int, int, int]]]]:
        """Per trainable group: the shard offsets where parameters start and end (sub-group cuts), and the
        (start, end, slot index) pieces of this rank's shard, so a parameter without a gradient in a step is
        skipped whole (torch skips ``grad is None``; Adam's step count is per parameter)."""
        cuts, owner = [], []
        for g in self._groups:
            pieces = [(a, e, i) for i, a, e in g.slot_pieces()]
            cuts.append([x for a, e, _ in pieces for x in (a, e)])
            owner.append(pieces)
        return cuts, owner

    def _skipped(self, decision) -> frozenset[int]:
        """Sub-groups of parameters that got no gradient on any rank in this step."""
        out = set()
        for i, g in enumerate(self._groups):
            flags = decision.has_grad.get(g.index)
            if not flags or all(flags):
                continue
            self.store.mixed.add(i)  # step counts differ from now on (the same on every rank)
            missing = [(a, e) for a, e, slot in self._owner[i] if not flags[slot]]
            for sg in self.store.sub_groups:
                if sg.shard == i and any(a <= sg.start < e for a, e in missing):
                    out.add(sg.index)
        return frozenset(out)

    def _carry_state(self) -> dict[int, dict]:
        """State the optimizer already holds per parameter, flattened and sharded like the master (as the device
        master store does); the optimizer's own copy is dropped."""
        old, out = self.optimizer.state, {}
        if not old:
            return out
        for i, g in enumerate(self._groups):
            # host state: fp32 on the CPU
            per = [None if st is None else {k: v.cpu() if torch.is_tensor(v) and v.dim() else v for k, v in st.items()}
                   for st in (old.get(s.param) for s in g.slots)]  # fmt: skip
            state = shard_param_state(g, per, torch.float32)
            if state is not None:
                out[i] = state
        old.clear()
        return out

    # ------------------------------------------------------------------ training
    def begin_backward(self, is_boundary: bool | None) -> None:
        """NVMe: start reading the state the next step moves (as much as the swap ring holds), so the reads
        overlap this backward; the gradients, reduced at its end at stages 0-2, would start them too late."""
        if self.device == "nvme":
            self.store.read_ahead()

    def on_grad_ready(self, bucket, grad_shard: torch.Tensor, boundary: bool | None, start: int | None = None) -> None:
        """Copy the bucket's reduced gradient chunk (or the part of it at shard offset ``start``) to the host when it
        is final (``boundary`` True); earlier micro-batches stay on the device, where the reducer accumulates them.
        Streamed (``takes_grad_shards``): every micro-batch's chunk, or part of it, goes to the swap files."""
        i = self._pos.get(bucket.group.index)
        if self.takes_grad_shards:
            if i is not None:
                at = bucket.shard_offset if start is None else start
                self.store.receive_grad(i, at, grad_shard, final=boundary is True)
            return
        if boundary is not True:
            return
        if i is None:
            return
        if self.spec is not None and not self._received:
            self.spec.begin(self._loss_scaler.scale)
        self._received[id(bucket)] = self._received.get(id(bucket), 0) + grad_shard.numel()
        done = self.store.receive_grad(i, bucket.shard_offset if start is None else start, grad_shard)
        if self.spec is not None:
            self.spec.on_ready(done)

    def grad_edited(self, g, shard: torch.Tensor) -> None:
        """``g``'s gradient shard was overwritten after backward (zero_core.master): copies taken at the boundary
        are dropped, so ``step`` copies the edited shard again; SuperOffload's speculative steps of ``g``'s
        sub-groups are undone first (``step`` then steps them with the edited gradient); streamed gradients are
        written back to the swap files (their sums of squares recomputed for the norm)."""
        i = self._pos.get(g.index)
        if i is None:
            return
        if self.takes_grad_shards:
            self.store.write_grad_shard(i, shard)
            return
        copied = [b for b in g.buckets if id(b) in self._received]
        if not copied:
            return  # nothing left the reducer yet: step() copies the shard as it is now
        if self.spec is not None:
            self.spec.undo([sg for sg in self.store.sub_groups if sg.shard == i])
        for b in copied:
            del self._received[id(b)]

    def read_grad_shard(self, g) -> torch.Tensor | None:
        """Streamed gradients: ``g``'s accumulated shard read back from the swap files (fp32); else None."""
        i = self._pos.get(g.index)
        return None if i is None or not self.takes_grad_shards else self.store.read_grad_shard(i)

    def step(self, decision) -> bool:
        """Step with ``decision.coef`` unless ``decision.overflow`` (then weights and state stay bitwise as they
        were, speculative updates included); returns whether it stepped."""
        # chunks that did not arrive at the boundary (stages 0/1, no overlap); streamed ones all arrived
        for i, g in enumerate([] if self.takes_grad_shards else self._groups):
            shard = decision.grad_shards[g.index]
            for b in g.buckets:
                if self._received.get(id(b), 0) < b.chunk:
                    self.store.receive_grad(i, b.shard_offset, shard[b.shard_slice()])
        self._received.clear()
        matrix = frozenset(sg.index for sg in self.store.sub_groups if sg.shard in self._matrix)
        skip = self._skipped_last = self._skipped(decision) | matrix
        if self._matrix and not decision.overflow:
            self._step_matrices(decision)
        if self.spec is not None:
            self.spec.finish(decision.overflow, decision.coef, skip)
        elif not decision.overflow:
            if self.takes_grad_shards:
                self._writer.begin(skip, self.store.sub_groups)
            self.store.step(decision.coef, skip)
            if self.takes_grad_shards:
                self._writer.finish()
                self.params_written = True
        self.store.begin_round()
        self._cache.clear()
        return not decision.overflow

    def drop_grads(self) -> None:
        """Streamed gradients: forget what this step accumulated (the runtime's ``zero_grad``)."""
        self._received.clear()
        if self.store is not None:
            self.store.begin_round()

    def grad_sq_norm(self) -> torch.Tensor:
        """Streamed gradients: this rank's sum of squares (float64, scaled loss units); see zero_core.master."""
        return torch.tensor([self.store.grad_sq_norm()], dtype=torch.float64)

    @torch.no_grad()
    def write_params(self, bucket, dst: torch.Tensor) -> None:
        """This rank's updated chunk of ``bucket`` in ``dst``'s dtype into ``dst``."""
        self.store.write_back(self._pos[bucket.group.index], dst, bucket.shard_offset)

    # ------------------------------------------------------------------ checkpoints
    def master_shard(self, g) -> torch.Tensor | None:
        """The fp32 master shard of ``g`` (a stable host tensor; for NVMe or Twin-Flow a host copy refreshed on
        each call), None for a frozen group."""
        i = self._pos.get(g.index)
        if i is None:
            return None
        live = self.store.master_view(i)
        if live is not None:
            return live
        values = self.store.master_shard(i)
        cached = self._cache.setdefault(i, torch.empty_like(values))
        return cached.copy_(values)

    def checkpoint_pieces(self, g) -> dict | None:
        """NVMe: ``g``'s master and optimizer state streamed from the swap files for a checkpoint (see
        ``NVMeOptimizer.checkpoint_pieces``); None where they live in memory (host store) or for a frozen group."""
        i = self._pos.get(g.index)
        return None if i is None else self.store.checkpoint_pieces(i)

    def state_shard(self, g) -> dict[str, Any]:
        """torch's optimizer state of ``g``'s master shard (``step``, ``exp_avg``, ``exp_avg_sq`` for Adam)."""
        i = self._pos.get(g.index)
        if i in self._matrix:
            return {k: v.cpu() for k, v in pieces_state(self.optimizer, g, self._matrix[i]).items()}
        return {} if i is None else self.store.shard_state(i)

    @torch.no_grad()
    def write_master(self, g, where: slice, values: torch.Tensor) -> None:
        """Overwrite elements ``where`` of ``g``'s master: in place on a live host master; through the store
        (device sub-groups of a Twin-Flow split, NVMe swap files) otherwise, so the next step starts from them."""
        i = self._pos[g.index]
        live = self.store.master_view(i)
        if live is not None:
            live[where] = values
            return
        full = self.store.master_shard(i).clone()
        full[where] = values
        self.store.load_master_shard(i, full)

    def load_master_shard(self, g, shard: torch.Tensor) -> None:
        self.store.load_master_shard(self._pos[g.index], shard)

    def load_state_shard(self, g, state: dict[str, Any]) -> None:
        i = self._pos[g.index]
        if i in self._matrix:
            load_pieces_state(self.optimizer, g, self._matrix[i], state)
            return
        self.store.clear_state(i)
        self.store.load_shard_state(i, state)

    def resident(self) -> list[torch.Tensor]:
        """Nothing: the masters live in host memory (or on NVMe), not on the parameters' device."""
        return []

    def clear_state(self, g) -> None:
        i = self._pos[g.index]
        if i in self._matrix:
            load_pieces_state(self.optimizer, g, self._matrix[i], {})
            return
        self.store.clear_state(i)

    def host_bytes(self) -> int:
        """Host bytes of masters, gradients and optimizer state (NVMe: buffers and gradients)."""
        return self.store.host_bytes() if self.store is not None else 0

    def close(self) -> None:
        """Stop the speculative worker, free host memory and swap files, give the optimizer its parameters back."""
        if self.spec is not None:
            self.spec.close()
            self.spec = None
        for pieces in self._matrix.values():
            for *_, piece in pieces:
                self.optimizer.state.pop(piece, None)
        self._matrix = {}
        if self.store is not None:
            self.store.close()
            self.store = None
        for pg, params in zip(self.param_groups, self._original):
            pg["params"] = params
        self._cache.clear()
        self._groups, self._pos = [], {}
