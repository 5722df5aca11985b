"""The data side of Ulysses: batches sharded along the sequence, and the shard losses combined into the loss of
the whole sequence.

Mirrors DeepSpeed 0.19.8's ``UlyssesSPDataLoaderAdapter`` (``deepspeed/runtime/sequence_parallel/ulysses_sp.py``)
and the loss aggregation of transformers' ``deepspeed_sp_compute_loss`` (what the HF Trainer runs under
``ParallelismConfig(sp_backend="deepspeed")``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import torch
import torch.distributed as dist

from zero_comm import all_gather_into_tensor, all_reduce

IGNORE_INDEX = -100
"""The label of a position that does not count in the loss (transformers' and torch's ``ignore_index``)."""


class UlyssesSPDataLoaderAdapter:
    """Wraps each rank's data loader so that the ranks of a sequence-parallel group work on one batch at a time.

    Each rank's loader yields its own batch (a dict of ``[b, s]`` tensors with ``input_ids``, ``position_ids`` and
    ``labels``; other tensors of the same shape and non-tensor values may come along). On refill every rank's batch
    is shared with the group; then the adapter yields ``sp`` micro-batches: the ``j``-th is rank ``j``'s batch, of
    which this rank gets positions ``[r*s/sp, (r+1)*s/sp)`` of every tensor (``r`` = ``sp_rank``). ``labels`` are
    replaced by ``shift_labels``, shifted left by one over the whole sequence before sharding (the last position
    gets ``-100``), so that the label of each shard's last position is the first token of the next shard. Tensors
    come back on ``device``. One pass yields ``sp`` x the wrapped loader's batches (``len``).

    Args (DeepSpeed's names):
        dl: the wrapped loader (any iterable of dicts with a ``len``).
        sp_rank, sp_group, sp_world_size: this rank's place in the sequence-parallel group.
        device: where the yielded tensors live.

    Raises (on ``next``):
        ValueError: a batch lacks ``input_ids``, ``position_ids`` or ``labels``; a tensor's first two dimensions
            differ from ``input_ids``'; a sequence length not divisible by ``sp_world_size``; ranks' batches with
            other keys or batch sizes.
    """

    def __init__(self, dl: Iterable, sp_rank: int, sp_group, sp_world_size: int, device) -> None:
        self.dl = dl
        self.sp_rank = sp_rank
        self.sp_group = sp_group
        self.sp_world_size = sp_world_size
        self.device = torch.device(device)
        self.iter = iter(dl)  # restarted when it ends, so that the next epoch can run
        self.micro_batches: deque[dict] = deque()  # this rank's shards of the group's batches, not yet yielded

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        """Take the next batch of every rank of the group and queue this rank's shard of each."""
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)
            raise
        for need in ("input_ids", "position_ids", "labels"):
            if need not in batch:
                raise ValueError(
                    f"the batch has no {need!r}: Ulysses needs input_ids, labels and the global position_ids of "
                    "every token (torch.arange(seq_len) per sample, restarting per document when packed)"
                )
        shape = tuple(batch["input_ids"].shape[:2])
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and tuple(value.shape[:2]) != shape:
                raise ValueError(
                    f"{key} has shape {tuple(value.shape)}; expected [batch, seq] = {shape} like input_ids"
                )
        for source in self._gather(batch):
            self.micro_batches.append(self._shard(source))

    def _gather(self, batch: dict) -> list[dict]:
        """Every rank's batch of the group, in rank order (tensors padded to the longest sequence for the
        exchange, then cut back)."""
        sp, group = self.sp_world_size, self.sp_group
        metas: list = [None] * sp
        meta = sorted((k, isinstance(v, torch.Tensor) and (v.dtype, tuple(v.shape[2:]))) for k, v in batch.items())
        dist.all_gather_object(metas, (tuple(batch["input_ids"].shape[:2]), meta), group=group)
        if any(m[1] != meta or m[0][0] != metas[0][0][0] for m in metas):
            raise ValueError(f"the ranks of the sequence-parallel group hold batches of other keys, dtypes or batch "
                             f"sizes: {metas}")  # fmt: skip
        lengths = [m[0][1] for m in metas]
        longest = max(lengths)
        out: list[dict] = [{} for _ in range(sp)]
        for key, value in batch.items():
            if not isinstance(value, torch.Tensor):
                values: list = [None] * sp
                dist.all_gather_object(values, value, group=group)
                for rank in range(sp):
                    out[rank][key] = values[rank]
                continue
            padded = torch.zeros((value.shape[0], longest, *value.shape[2:]), dtype=value.dtype)
            padded[:, : value.shape[1]] = value.detach().cpu()
            gathered = torch.empty((sp, *padded.shape), dtype=value.dtype)
            all_gather_into_tensor(gathered.view(-1), padded.view(-1), group)
            for rank in range(sp):
                out[rank][key] = gathered[rank, :, : lengths[rank]]
        return out

    def _shard(self, batch: dict) -> dict:
        seq = batch["input_ids"].shape[1]
        if seq % self.sp_world_size:
            raise ValueError(f"sequence length {seq} is not divisible by sp_world_size={self.sp_world_size}")
        labels = batch.pop("labels")
        batch["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
        chunk = seq // self.sp_world_size
        own = slice(self.sp_rank * chunk, (self.sp_rank + 1) * chunk)
        return {
            k: v[:, own].contiguous().to(self.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
        }


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group; the gradient of each input is the sum of the outputs' gradients over the group (the
    adjoint), as ``torch.distributed.nn.functional.all_gather`` followed by a sum gives."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.detach().clone().contiguous()
        all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.detach().clone().contiguous()
        all_reduce(out, ctx.group)
        return out, None


def sequence_parallel_loss(
    shard_loss: torch.Tensor, shift_labels: torch.Tensor, group, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """The mean loss over the whole sequence from each rank's mean loss over its shard.

    ``sum_r(loss_r * n_r) / max(sum_r n_r, 1)``, with ``n_r`` the positions of rank ``r``'s ``shift_labels`` that are
    not ``ignore_index`` (a shard without any contributes 0, not its NaN). Every rank gets the same value.
    Backward: each rank's ``shard_loss`` gets the gradient summed over the group, so each rank's parameter
    gradients are sp x its share, and their mean over the sequence-parallel group (ZeRO's average over sp x dp) is
    the full-sequence gradient. Mirrors transformers' ``deepspeed_sp_compute_loss``.

    Args:
        shard_loss: 0-d float tensor, the mean loss over this rank's counted positions.
        shift_labels: this rank's ``[b, s/sp]`` shifted labels (what the data-loader adapter yields).
        group: the sequence-parallel group.

    Raises:
        ValueError: ``shard_loss`` is not 0-d.
    """
    if shard_loss.dim() != 0:
        raise ValueError(
            f"shard_loss must be a 0-d tensor (the shard's mean loss), got shape {tuple(shard_loss.shape)}"
        )
    counted = (shift_labels != ignore_index).sum().to(shard_loss.dtype)
    weighted = torch.where(counted > 0, shard_loss * counted, torch.zeros_like(shard_loss))
    total = counted.detach().clone().reshape(1)
    all_reduce(total, group)
    return _AllReduceSum.apply(weighted, group) / total[0].clamp(min=1)
