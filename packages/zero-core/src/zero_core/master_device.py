"""The default :class:`zero_core.master.MasterStore`: master shards and optimizer state on the parameters' device,
stepped by the user's ``torch.optim.Optimizer``.

Memory (ZeRO formula, arXiv 1910.02054 section 5): when the stored parameter shard is contiguous and already in
the master dtype (fp32 at stage 0, fp32 stages 1/2 with one bucket per flat group, fp32 stage 3) the master *is*
that shard (no second copy). With several buckets per flat group at fp32 stages 1/2 a rank's chunks are not
contiguous (each bucket's full buffer must be, for its all-gather): the master is then one tensor per bucket, each
this rank's chunk of that bucket's parameter buffer, again no copy. Otherwise (bf16/fp16 storage) one
fp32 copy of this rank's shard per flat group.

The optimizer steps *pieces*: one view of the master per parameter (the part of it this rank owns), so that, as
in single-process torch, a parameter whose gradient is None this step (frozen for now, or unused on every rank)
is skipped: no moment update, no weight decay, and Adam's per-parameter ``step`` (bias correction) starts at its
first real step (DeepSpeed's flat buffer moves such parameters with momentum and decay instead). The views
hold no memory of their own; the optimizer state per piece adds up to exactly one shard, as before. Checkpoints
see the state in the shard layout (``state_shard``): a per-element tensor for each state, and ``step`` a scalar
when every piece agrees, else per element.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from zero_core.layout import Bucket, FlatGroup
from zero_core.master import MasterStoreInputs, ParamShards, StepDecision
from zero_core.matrix_step import WholeMatrixOptimizer, step_whole_matrices
from zero_core.precision import PrecisionPolicy


class DeviceMaster:
    """Master shards on device, stepped by the user's optimizer; see :mod:`zero_core.master` for the protocol.

    Builds one master shard per trainable flat group, carries over any optimizer state the optimizer already holds
    (sharded like the parameters), and makes the optimizer's param groups hold the masters.

    Args:
        optimizer: the user's optimizer (None: forward only, nothing to build).
        flat_groups: every flat group (``FlatGroup.index`` order).
        params: the parameter store (the stored shards the masters start from, or are).
        precision: ``master_dtype`` and ``compute`` decide whether the master is the stored shard itself.
        group: the data-parallel process group (Muon's whole-matrix all-gathers).
        reduce_bucket_size: most elements one whole-matrix all-gather assembles.

    Raises:
        ValueError: the optimizer holds state for only some parameters of a group (names the group).
    """

    takes_grad_shards = False  # the reducer keeps the gradient shards
    reads_ahead = False  # the state is already where the step reads it: begin_backward does nothing
    watches_grads = False  # the optimizer reads the reducer's gradient shard at step: on_grad_ready does nothing

    def __init__(
        self,
        *,
        optimizer: torch.optim.Optimizer | None,
        flat_groups: Sequence[FlatGroup],
        params: ParamShards,
        precision: PrecisionPolicy,
        group,
        reduce_bucket_size: int,
    ):
        self.optimizer = optimizer
        self.param_groups: list[dict[str, Any]] = optimizer.param_groups if optimizer is not None else []
        self._original = [list(pg["params"]) for pg in self.param_groups]  # given back by close()
        self._trainable = [g for g in flat_groups if g.group_index is not None]
        self._group, self._max_numel = group, reduce_bucket_size
        self._dtype = precision.master_dtype
        # FlatGroup.index -> master shard (None: frozen, or held per bucket in ``chunks``)
        self.masters: list[torch.nn.Parameter | None] = [None] * len(flat_groups)
        self.chunks: dict[int, torch.Tensor] = {}  # Bucket.index -> this rank's chunk of its buffer: the master
        self._copies: dict[int, torch.Tensor] = {}  # FlatGroup.index -> master_shard()'s copy of per-bucket chunks
        self.params_written = False  # the last step wrote the parameter store's own shards (see _in_place)
        self.closed = False  # close() ran: the optimizer has its own parameters back
        md = self._dtype
        copied = False  # some master is a copy of its stored shard (write_params has something to write)
        for g in self._trainable:
            view = params.shard_view(g)
            if view is not None and view.dtype == md:
                self.masters[g.index] = torch.nn.Parameter(view)  # the stored shard is the master: no second copy
            elif precision.compute == md and params.master_chunk(g.buckets[0]) is not None:
                for b in g.buckets:  # one master tensor per bucket: this rank's chunk of its parameter buffer
                    self.chunks[b.index] = params.master_chunk(b)
            else:
                self.masters[g.index] = torch.nn.Parameter(params.shard_values(g).to(md, copy=True))
                copied = True
        # every master is the parameter store's own memory: a step writes the parameters (params_written), so the
        # store's refresh need not ask write_params for each bucket (each would find its source is the destination)
        self._in_place = not copied
        # Bucket.index -> where write_params reads this rank's chunk (a view of the master)
        self._src: dict[int, torch.Tensor] = {}
        for g in self._trainable:
            for b in g.buckets:
                m = self.masters[g.index]
                self._src[b.index] = self.chunks[b.index] if m is None else m.detach()[b.shard_slice()]
        # FlatGroup.index -> (slot index, shard start, shard end, view of the master) per piece (see _cut)
        self.pieces: dict[int, list[tuple[int, int, int, torch.nn.Parameter]]] = {}
        for g in self._trainable:
            self.pieces[g.index] = self._cut(g)
        self.mixed: set[int] = set()  # flat groups whose parameters no longer share one step count
        # flat groups whose param group needs whole matrices (Muon's): step_whole_matrices steps them
        opt = optimizer
        self._whole = {g.index for g in self._trainable if isinstance(opt, WholeMatrixOptimizer)
                       and opt.whole_matrix_group(self.param_groups[g.group_index])}  # fmt: skip
        old = self._sharded_optimizer_state()
        for pg in self.param_groups:
            pg["params"] = []
        for g in self._trainable:
            self.param_groups[g.group_index]["params"] += [piece for *_, piece in self.pieces[g.index]]
        for g, state in old:
            self.load_state_shard(g, state)

    @classmethod
    def from_inputs(cls, inputs: MasterStoreInputs, **options) -> DeviceMaster:
        """The store from what the runtime offers (``ZeroRuntime``'s default builder); ``options``: a subclass's
        own keyword arguments."""
        return cls(optimizer=inputs.optimizer, flat_groups=inputs.flat_groups, params=inputs.params,
                   precision=inputs.precision, group=inputs.group, reduce_bucket_size=inputs.reduce_bucket_size,
                   **options)  # fmt: skip

    def checkpoint_pieces(self, g) -> None:
        """The masters live in device memory: a checkpoint reads them with ``master_shard``."""
        return None

    def _view(self, g: FlatGroup, a: int, e: int) -> torch.Tensor:
        """Shard elements ``[a, e)`` of ``g``'s master (within one bucket's chunk) as a view of the master."""
        if self.masters[g.index] is not None:
            return self.masters[g.index].detach()[a:e]
        b = next(b for b in g.buckets if b.shard_offset <= a < b.shard_offset + b.chunk)
        return self.chunks[b.index][a - b.shard_offset : e - b.shard_offset]

    def _cut(self, g: FlatGroup) -> list[tuple[int, int, int, torch.nn.Parameter]]:
        """(slot index, shard start, shard end, view of the master) for each parameter with elements here, in
        shard order."""
        out = [(i, a, e, torch.nn.Parameter(self._view(g, a, e))) for i, a, e in g.slot_pieces()]
        # padding pieces (slot -1, stepped with their zero gradient every step): the pieces tile the shard, so
        # every rank holds state of every name and the state is exactly one shard (ZeRO formula, padding included);
        # cut at bucket ends, so that each piece lies in one bucket's chunk
        covered = sorted([(a, e) for _, a, e, _ in out] + [(b.shard_offset, b.shard_offset) for b in g.buckets])
        pos = 0
        for a, e in covered + [(g.shard_numel, g.shard_numel)]:
            if a > pos:
                out.append((-1, pos, a, torch.nn.Parameter(self._view(g, pos, a))))
            pos = max(pos, e)
        return sorted(out, key=lambda piece: piece[1])

    def _sharded_optimizer_state(self) -> list[tuple[FlatGroup, dict[str, Any]]]:
        """State the optimizer already holds (Adagrad creates it in its constructor; a run may also wrap an
        optimizer that has stepped), flattened and sharded like the parameters (scalars such as ``step`` taken as
        they are), per flat group; the optimizer's state is cleared.

        Raises:
            ValueError: some parameters of a group have state and others not, or with different keys.
        """
        old = self.optimizer.state if self.optimizer is not None else None
        if not old:
            return []
        out = []
        for g in self._trainable:
            state = shard_param_state(g, [old.get(s.param) for s in g.slots], self._dtype)
            if state is not None:
                out.append((g, state))
        old.clear()
        return out

    def begin_backward(self, is_boundary: bool | None) -> None:
        """Nothing to do: the state is already where the step reads it."""

    def on_grad_ready(
        self, bucket: Bucket, grad_shard: torch.Tensor, boundary: bool | None, start: int | None = None
    ) -> None:
        """Nothing to do: the gradient shard already lives where the optimizer reads it."""

    def grad_edited(self, g: FlatGroup, shard: torch.Tensor) -> None:
        """Nothing to do: the optimizer reads the reducer's gradient shard, which the edit wrote, at ``step``."""

    def read_grad_shard(self, g: FlatGroup) -> torch.Tensor | None:
        """None: the reducer holds the gradient shards."""
        return None

    def step(self, decision: StepDecision) -> bool:
        """Scale the gradient shards (``decision.grad_shards``) by ``decision.coef``, give each piece whose
        parameter got a gradient its slice of the shard as ``.grad`` (the others None: skipped, as torch) and run
        ``optimizer.step()``; False on overflow. Param groups of a
        :class:`~zero_core.matrix_step.WholeMatrixOptimizer` that need whole matrices (Muon's) are stepped first
        through :func:`~zero_core.matrix_step.step_whole_matrices`. Where every master is the parameter store's own
        memory the step has written the parameters: ``params_written`` is set (stage 3's ``refresh`` then skips
        ``write_params``)."""
        if decision.overflow:
            return False
        stepped = []
        md, coef = self._dtype, decision.coef
        for g in self._trainable:
            shard = decision.grad_shards[g.index]
            if coef != 1.0:
                shard.mul_(coef)
            grad = shard if shard.dtype == md else shard.to(md)
            got = decision.has_grad.get(g.index)
            if got is not None and not all(got):
                self.mixed.add(g.index)  # steps now differ between parameters (the same decision on every rank)
            if g.index in self._whole:  # Muon: whole matrices
                step_whole_matrices(self.optimizer, g, self.pieces[g.index], grad, got, self._group,
                                    max_numel=self._max_numel)  # fmt: skip
                continue
            for i, a, e, piece in self.pieces[g.index]:
                if got is None or i < 0 or got[i]:
                    piece.grad = grad[a:e]
                    stepped.append(piece)
        self.optimizer.step()
        for piece in stepped:
            piece.grad = None
        self._copies.clear()
        self.params_written = self._in_place
        return True

    @torch.no_grad()
    def write_params(self, bucket: Bucket, dst: torch.Tensor) -> None:
        """This rank's chunk of ``bucket`` from the master into ``dst`` (cast); nothing when ``dst`` is the master."""
        src = self._src[bucket.index]
        if src.data_ptr() != dst.data_ptr() or src.dtype != dst.dtype:
            dst.copy_(src)

    def master_shard(self, g: FlatGroup) -> torch.Tensor | None:
        """The master shard (``g.shard_numel`` elements; the tensor the optimizer steps), None for a frozen group.
        Held per bucket (several buckets, fp32 stages 1/2): a copy, the same object until the next step or load
        (what checkpoints read; an edit reaches the master through ``load_master_shard``, as an offloaded store's)."""
        if g.index >= len(self.masters):
            return None
        if self.masters[g.index] is not None or g.group_index is None:
            return self.masters[g.index]
        if g.index not in self._copies:
            self._copies[g.index] = torch.cat([self.chunks[b.index] for b in g.buckets])
        return self._copies[g.index]

    def _write(self, g: FlatGroup, start: int, values: torch.Tensor) -> None:
        """Shard elements ``[start, start + values.numel())`` of ``g``'s master := ``values`` (cast)."""
        self._copies.pop(g.index, None)
        flat = values.detach().reshape(-1)
        if self.masters[g.index] is not None:
            self.masters[g.index].detach()[start : start + flat.numel()].copy_(flat)
            return
        end = start + flat.numel()
        for b in g.buckets:
            lo, hi = max(start, b.shard_offset), min(end, b.shard_offset + b.chunk)
            if hi > lo:
                self.chunks[b.index][lo - b.shard_offset : hi - b.shard_offset].copy_(flat[lo - start : hi - start])

    def state_shard(self, g: FlatGroup) -> dict[str, Any]:
        """``g``'s optimizer state in the shard layout (a new dict): per-element state as ``shard_numel`` tensors
        (zero where a piece has none), ``step`` a scalar when every piece with state agrees, else per element
        (0: never stepped) once some parameter missed a step; other values from the first piece. Empty when no
        piece has state. The format depends only on decisions every rank shares, so all ranks write the same."""
        states = [(a, e, self.optimizer.state.get(piece)) for _, a, e, piece in self.pieces.get(g.index, [])]
        states = [(a, e, st) for a, e, st in states if st]
        if not states:
            return {}
        out: dict[str, Any] = {}
        for k, v in states[0][2].items():
            per_element = isinstance(v, torch.Tensor) and v.dim() > 0
            if k == "step" and isinstance(v, torch.Tensor) and v.dim() == 0:
                if g.index not in self.mixed:  # every parameter stepped every time: one count
                    out[k] = v.clone()
                    continue
                per_element = True
            if not per_element:
                out[k] = v.clone() if isinstance(v, torch.Tensor) else v
                continue
            dtype = torch.float32 if k == "step" else v.dtype
            flat = torch.zeros(g.shard_numel, dtype=dtype, device=g.device)
            for a, e, st in states:
                flat[a:e] = st[k]
            out[k] = flat
        return out

    @torch.no_grad()
    def write_master(self, g: FlatGroup, where: slice, values: torch.Tensor) -> None:
        """Overwrite elements ``where`` of the master shard in place (where the master is the stored shard itself,
        fp32 without a separate copy, this rewrites the values the parameter store just wrote)."""
        start, stop, _ = where.indices(g.shard_numel)
        self._write(g, start, values.reshape(-1)[: stop - start])

    @torch.no_grad()
    def load_master_shard(self, g: FlatGroup, shard: torch.Tensor) -> None:
        """Copy ``shard`` (``g.shard_numel`` elements) into the master."""
        self._write(g, 0, shard)

    def load_state_shard(self, g: FlatGroup, state: dict[str, Any]) -> None:
        """Replace ``g``'s optimizer state with ``state`` in the shard layout (as ``state_shard`` gives, or a
        checkpoint written with one flat tensor per group): floating tensors other than ``step`` are cast to the
        master's dtype and device (as ``Optimizer.load_state_dict``); a per-element ``step`` of 0 means the piece
        has never been stepped (no state)."""
        self.clear_state(g)
        if not state:
            return
        step = state.get("step")
        if isinstance(step, torch.Tensor) and step.dim() > 0:
            self.mixed.add(g.index)
        else:
            self.mixed.discard(g.index)
        for _, a, e, piece in self.pieces.get(g.index, []):
            st = {}
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == g.shard_numel:
                    v = v[a:e]
                    if k == "step":
                        v = v[0].to(torch.float32)
                    elif v.is_floating_point():
                        v = v.to(dtype=piece.dtype, device=piece.device)
                    st[k] = v.clone()
                else:
                    st[k] = v.clone() if isinstance(v, torch.Tensor) else v
            if isinstance(step, torch.Tensor) and step.dim() > 0 and float(st["step"]) == 0:
                continue  # never stepped: torch keeps no state for it
            self.optimizer.state[piece] = st

    def resident(self) -> list[torch.Tensor]:
        """The master shards (on the parameters' device; per-bucket chunks alias the parameter buffers)."""
        return [m for m in self.masters if m is not None] + list(self.chunks.values())

    def clear_state(self, g: FlatGroup) -> None:
        """Drop ``g``'s optimizer state (as a freshly built optimizer)."""
        for *_, piece in self.pieces.get(g.index, []):
            self.optimizer.state.pop(piece, None)

    def close(self) -> None:
        """Give the optimizer its original parameters back, with no state (the sharded state cannot apply)."""
        if self.closed:
            return
        for g in self._trainable:
            self.clear_state(g)
        self.masters, self.chunks, self._copies, self._src = [], {}, {}, {}
        self.pieces = {}
        for pg, params in zip(self.param_groups, self._original):
            pg["params"] = params
        self._original = []
        self.closed = True


def shard_param_state(g: FlatGroup, per: list, dtype: torch.dtype) -> dict[str, Any] | None:
    """One flat group's per-parameter optimizer state (``per``: one state dict or None per slot, flat order) in
    the shard layout: per-element tensors concatenated, cast to ``dtype`` on their own device and sharded like the
    parameters (``shard_numel`` elements); other values (``step``) taken as they are. None when no slot has state.

    Raises:
        ValueError: some slots have state and others not, or with different keys.
    """
    if all(st is None for st in per):
        return None
    if any(st is None for st in per) or any(st.keys() != per[0].keys() for st in per):
        raise ValueError(f"optimizer param group {g.group_index}: some parameters have optimizer state and "
                         "others do not, or with different keys; cannot shard it")  # fmt: skip
    state = {}
    for k, v in per[0].items():
        if isinstance(v, torch.Tensor) and all(st[k].shape == s.shape for st, s in zip(per, g.slots)):
            state[k] = g.shard_from_full(torch.cat([st[k].detach().reshape(-1) for st in per]).to(dtype))
        else:
            state[k] = v.clone() if isinstance(v, torch.Tensor) else v
    return state
