"""ZenFlow's columns: which elements of this rank's master shards belong to the selected (important) columns.

A parameter of two or more dimensions, shape ``(R, ...)``, is seen as a matrix of ``R`` rows and
``C = numel // R`` columns (row-major, as it is flattened into the flat group); its column ``j`` is the elements
``r * C + j``. Column importance is the sum of |gradient| over the column, summed over every rank's piece of the
parameter (one all-reduce of one value per column of every matrix), so every rank selects the same columns of a
parameter whatever the shard boundaries. The ``max(1, int(C * topk_ratio))`` most important columns of each
matrix are selected (DeepSpeed's count); one-dimensional parameters (biases, norm weights) are always selected
whole, as DeepSpeed steps them on the device every step.

Work stays proportional to the shard: a piece of a matrix in a shard is a partial first row, whole rows and a
partial last row, so column sums and selections are row views, not per-element index tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    """One parameter's elements in one master shard.

    Attributes:
        start, end: the range in the shard.
        offset: the parameter-local flat index of ``start``.
        cols: columns of the parameter seen as a matrix (0: one-dimensional, always selected whole).
        base: the parameter's first column in the global column vector (same on every rank).
        param: position of the parameter in the global list of matrices (-1 for one-dimensional ones).
    """

    start: int
    end: int
    offset: int
    cols: int
    base: int
    param: int


def _segments(p: Piece):
    """(shard start, count, first column, rows) runs of ``p``: a partial row, whole rows, a partial row."""
    lo, hi, c = p.offset, p.offset + (p.end - p.start), p.cols
    out, at = [], lo
    first_full = -(-lo // c) * c
    if at < min(first_full, hi):  # partial first row
        n = min(first_full, hi) - at
        out.append((p.start + at - lo, n, at % c, 1))
        at += n
    rows = (hi - at) // c
    if rows:
        out.append((p.start + at - lo, rows * c, 0, rows))
        at += rows * c
    if at < hi:  # partial last row
        out.append((p.start + at - lo, hi - at, 0, 1))
    return out


class ColumnPlan:
    """The matrices and pieces of this rank's trainable master shards, and the column selection over them.

    Args:
        groups: the trainable flat groups, in the master store's shard order.

    Attributes:
        pieces: per shard, the :class:`Piece` list in shard order.
        num_columns: length of the global column vector (sum of ``C`` over every matrix of every group).
        matrices: per matrix, (base column, columns, rows).
    """

    def __init__(self, groups):
        self.pieces: list[list[Piece]] = []
        self.matrices: list[tuple[int, int, int]] = []
        base_of: dict[tuple[int, int], tuple[int, int]] = {}
        for gi, g in enumerate(groups):  # every slot of every group, in the same order on every rank
            for si, s in enumerate(g.slots):
                if len(s.shape) >= 2 and s.numel > 0:
                    rows = int(s.shape[0])
                    cols = s.numel // rows
                    base_of[(gi, si)] = (sum(c for _, c, _ in self.matrices), len(self.matrices))
                    self.matrices.append((base_of[(gi, si)][0], cols, rows))
        self.num_columns = sum(c for _, c, _ in self.matrices)
        for gi, g in enumerate(groups):
            out, i = [], 0
            for b in g.buckets:
                lo, hi = b.chunk_range(g.rank)
                for s in b.slots:
                    a, e = max(lo, s.bucket_offset), min(hi, s.bucket_offset + s.numel)
                    if e > a:
                        base, m = base_of.get((gi, i), (0, -1))
                        cols = self.matrices[m][1] if m >= 0 else 0
                        start = b.shard_offset + a - lo
                        out.append(Piece(start, start + e - a, a - s.bucket_offset, cols, base, m))
                    i += 1
            self.pieces.append(out)

    def column_sums(self, grads: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Add this rank's sum of |gradient| per column of every matrix into ``out`` (``num_columns`` fp32
        elements, zeroed by the caller) from the gradient shards ``grads`` (one per shard, any float dtype)."""
        for grad, pieces in zip(grads, self.pieces):
            for p in pieces:
                if not p.cols:
                    continue
                for at, n, col, rows in _segments(p):
                    seg = grad[at : at + n].abs().float()
                    lo = p.base + col
                    if rows > 1:
                        out[lo : lo + p.cols].add_(seg.view(rows, p.cols).sum(0))
                    else:
                        out[lo : lo + n].add_(seg)
        return out

    def choose(self, sums: torch.Tensor, topk_ratio: float) -> torch.Tensor:
        """A bool vector over the global columns: the ``max(1, int(C * topk_ratio))`` largest ``sums`` of each
        matrix (``sums`` identical on every rank, so the choice is too)."""
        chosen = torch.zeros(self.num_columns, dtype=torch.bool, device=sums.device)
        for base, cols, _ in self.matrices:
            k = max(1, int(cols * topk_ratio))
            top = torch.topk(sums[base : base + cols], k).indices if k < cols else slice(None)
            chosen[base : base + cols][top] = True
        return chosen

    def selected_positions(self, chosen: torch.Tensor, shard: int) -> torch.Tensor:
        """Sorted int64 positions in shard ``shard`` of the selected elements (every element of a one-dimensional
        parameter; the chosen columns' elements of a matrix), on ``chosen``'s device."""
        parts = []
        for p in self.pieces[shard]:
            if not p.cols:
                parts.append(torch.arange(p.start, p.end, device=chosen.device))
                continue
            mask_cols = chosen[p.base : p.base + p.cols]
            for at, n, col, rows in _segments(p):
                mask = mask_cols.repeat(rows) if rows > 1 else mask_cols[col : col + n]
                parts.append(at + torch.nonzero(mask).reshape(-1))
        if not parts:
            return torch.zeros(0, dtype=torch.int64, device=chosen.device)
        return torch.cat(parts)
