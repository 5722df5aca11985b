"""Whole-matrix optimizer updates over ZeRO's flat shards (Muon's orthogonalised step).

The master store hands the optimizer one 1-D view per parameter piece (``FlatGroup.slot_pieces``); at stages 1-3 a
shard boundary may cut a matrix in two, so an update that is a function of the whole matrix (Muon's Newton-Schulz
orthogonalisation) cannot be computed from a piece. An optimizer that needs the whole matrix for some param groups
implements :class:`WholeMatrixOptimizer`; :func:`step_whole_matrices` then steps those groups in three phases:

1. ``blend(piece, grad, group)`` per piece: the elementwise part (Muon: momentum and Nesterov blend), with the
   piece's state sharded exactly like the master (ZeRO's 1/P of optimizer state);
2. the blended pieces of every bucket holding a matrix that straddles a chunk boundary are all-gathered (one
   collective per run of buckets of up to ``max_numel`` elements), so each rank holds those matrices whole;
   ``finish(matrix, group)`` turns each matrix this rank holds a piece of into its update (a matrix inside one
   rank's chunk is finished by that rank alone and needs no communication);
3. ``apply(piece, update, group)`` with this rank's slice of the update (Muon: decoupled weight decay, ``-lr``).

Why all-gather rather than one owner per matrix that scatters its result: one collective instead of two, every
rank finishes only the matrices its shard touches (a straddling matrix is finished by each rank holding a piece,
on identical inputs), and the volume equals the parameter all-gather every step already does for those buckets.
The cost is a transient full copy of one run of straddling buckets' blended update at a time.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from zero_comm import all_gather_into_tensor
from zero_core.layout import FlatGroup


@runtime_checkable
class WholeMatrixOptimizer(Protocol):
    """An optimizer whose update of some param groups is a function of each whole parameter (see module)."""

    def whole_matrix_group(self, group: dict[str, Any]) -> bool:
        """True when ``group`` (one of the optimizer's param-group dicts) needs whole matrices."""
        ...

    def blend(self, param: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """The elementwise part for ``param`` (any shape; its state is keyed by it) and its ``grad``: returns a
        new tensor of ``grad``'s shape, updating the state in place."""
        ...

    def finish(self, matrix: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """The update of one whole parameter from its blended tensor (the parameter's logical shape)."""
        ...

    def apply(self, param: torch.Tensor, update: torch.Tensor, group: dict[str, Any]) -> None:
        """Apply ``update`` (``param``'s elements, any shape) to ``param`` in place."""
        ...


def _straddles(g: FlatGroup, b) -> bool:
    """Some parameter of bucket ``b`` has elements in more than one rank's chunk."""
    return g.partitions > 1 and any(s.bucket_offset // b.chunk != (s.bucket_offset + s.numel - 1) // b.chunk
                                    for s in b.slots if s.numel > 0)  # fmt: skip


def _batches(g: FlatGroup, max_numel: int) -> list[list]:
    """``g``'s buckets in flat order, cut into runs of at most ``max_numel`` padded elements (a larger bucket
    alone): what one all-gather assembles at a time (the same on every rank: it depends on the layout only)."""
    out, cur, size = [], [], 0
    for b in g.buckets:
        if cur and size + b.padded_numel > max_numel:
            out.append(cur)
            cur, size = [], 0
        cur.append(b)
        size += b.padded_numel
    return out + [cur] if cur else out


@torch.no_grad()
def step_whole_matrices(
    optimizer: WholeMatrixOptimizer,
    g: FlatGroup,
    pieces: list[tuple[int, int, int, torch.Tensor]],
    grad: torch.Tensor,
    got: list[bool] | None,
    comm_group,
    comm_device: torch.device | None = None,
    max_numel: int = 500_000_000,
) -> None:
    """Step the pieces of flat group ``g`` (a whole-matrix group of ``optimizer``) in place.

    Args:
        pieces: ``(slot index, shard start, shard end, master view)`` in shard order (slot -1: padding, skipped).
        grad: this rank's gradient shard (``g.shard_numel`` elements, the master's dtype, already scaled).
        got: per slot, whether the parameter got a gradient this step on some rank (None: all did); the others
            are skipped (no state change, no decay), as torch skips ``grad is None``.
        comm_group: the process group of ``g``'s partitions (every rank of it must call this, same order).
        comm_device: where the all-gather runs (default: the gradient's device; an offloaded store whose pieces
            live in host memory passes the parameters' device, which its backend serves).
        max_numel: most padded elements assembled by one all-gather (buckets in runs up to it; the engine passes
            ``reduce_bucket_size``), which bounds the transient full copies at stage 3.
    """
    group = optimizer.param_groups[g.group_index]
    live = [(i, a, e, p) for i, a, e, p in pieces if i >= 0 and (got is None or got[i])]
    blended = torch.zeros_like(grad)
    for _, a, e, piece in live:
        blended[a:e] = optimizer.blend(piece, grad[a:e], group)
    slots = g.slots
    for batch in _batches(g, max_numel):
        full: dict[int, torch.Tensor] = {}  # bucket index -> the bucket's padded flat blended update
        wide = [b for b in batch if _straddles(g, b)]
        if wide:
            send = torch.cat([blended[b.shard_slice()] for b in wide]).to(comm_device or blended.device)
            out = torch.empty(g.partitions * send.numel(), dtype=send.dtype, device=send.device)
            all_gather_into_tensor(out, send, comm_group)
            rows, pos = out.to(blended.device).view(g.partitions, send.numel()), 0
            for b in wide:
                full[b.index] = rows[:, pos : pos + b.chunk].reshape(-1)
                pos += b.chunk
        finished: dict[int, torch.Tensor] = {}
        lo, hi = batch[0].shard_offset, batch[-1].shard_offset + batch[-1].chunk
        for i, a, e, piece in live:
            if not lo <= a < hi:
                continue
            s = slots[i]
            b = next(b for b in batch if b.shard_offset <= a < b.shard_offset + b.chunk)
            local = a - b.shard_offset + g.rank * b.chunk - s.bucket_offset  # the piece's first element in the slot
            if i not in finished:
                if b.index in full:
                    whole = full[b.index][s.bucket_offset : s.bucket_offset + s.numel]
                else:  # the slot lies inside this rank's chunk: the piece is the whole parameter
                    whole = blended[a:e]
                finished[i] = optimizer.finish(whole.reshape(s.shape), group).reshape(-1)
            optimizer.apply(piece, finished[i][local : local + e - a], group)


def pieces_state(optimizer: torch.optim.Optimizer, g: FlatGroup, pieces) -> dict[str, torch.Tensor]:
    """The per-element state of ``pieces`` (as :func:`step_whole_matrices` takes them) in ``g``'s shard layout:
    one ``g.shard_numel`` tensor per state name, zero where a piece has none; empty when no piece has state."""
    out: dict[str, torch.Tensor] = {}
    for _, a, e, piece in pieces:
        for k, v in optimizer.state.get(piece, {}).items():
            if isinstance(v, torch.Tensor) and v.numel() == e - a:
                if k not in out:
                    out[k] = torch.zeros(g.shard_numel, dtype=v.dtype, device=v.device)
                out[k][a:e] = v.reshape(-1)
    return out


def load_pieces_state(optimizer: torch.optim.Optimizer, g: FlatGroup, pieces, state: dict[str, torch.Tensor]) -> None:
    """Replace the state of ``pieces`` by ``state`` (``pieces_state``'s layout, any device and float dtype: cast
    to each piece's). Raises ValueError naming a state tensor whose size is not ``g.shard_numel``."""
    for k, v in state.items():
        if not isinstance(v, torch.Tensor) or v.numel() != g.shard_numel:
            raise ValueError(f"flat group {g.key!r}: state {k!r} must be a tensor of {g.shard_numel} elements")
    for _, a, e, piece in pieces:
        optimizer.state.pop(piece, None)
        if state:
            optimizer.state[piece] = {k: v.reshape(-1)[a:e].to(piece.device, piece.dtype).clone().view(piece.shape)
                                      for k, v in state.items()}  # fmt: skip
