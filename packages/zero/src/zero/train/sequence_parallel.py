"""``zero train --sequence-parallel N``: Ulysses sequence parallelism for the main job's Llama (zero_parallel).

Ranks form groups of ``N`` consecutive ranks that share each sequence (DeepSpeed's layout); the data-parallel
rank picks the windows (every rank of a group draws the same ones) and each rank feeds its ``seq_len / N``
positions with their global ``position_ids`` and labels shifted over the whole window. The loss of a group is the
whole windows' mean (``sequence_parallel_loss``), so the logged loss and the gradients equal a run without
sequence parallelism on the same windows. Evaluation runs in eval mode on whole windows (the adapter steps aside).
"""

from __future__ import annotations

import torch

from zero_parallel import IGNORE_INDEX, SequenceParallelMPU, UlyssesSPAttentionHF, sequence_parallel_loss


def check(sp: int, nproc: int, seq_len: int, heads: int) -> str | None:
    """Why ``--sequence-parallel sp`` cannot run on ``nproc`` ranks with ``seq_len`` and ``heads`` (None: it can)."""
    if sp < 1:
        return f"--sequence-parallel must be >= 1, got {sp}"
    if nproc % sp:
        return f"--sequence-parallel {sp} must divide the ranks (--nproc-per-node {nproc})"
    if seq_len % sp:
        return f"--sequence-parallel {sp} must divide --seq-len {seq_len} (each rank an equal shard)"
    if heads % sp:
        return f"--sequence-parallel {sp} must divide the model's {heads} attention heads"
    return None


class SequenceShards:
    """One rank's part of each window: ``inputs(x)`` gives the forward's keyword arguments for windows ``x``
    ``[b, seq_len]`` (int64), ``loss(out, inputs)`` the whole windows' mean loss (0-d, equal on the group's ranks).

    Args:
        mpu: the sequence-parallel mpu ``UlyssesSPAttentionHF.register_with_transformers`` returned.
    """

    def __init__(self, mpu: SequenceParallelMPU):
        self.group = mpu.get_sequence_parallel_group()
        self.size = mpu.get_sequence_parallel_world_size()
        self.rank = mpu.get_sequence_parallel_rank()
        self.data_rank = mpu.get_data_parallel_rank()

    @classmethod
    def register(cls, model, sp: int, micro: int, seq_len: int) -> tuple[SequenceShards, SequenceParallelMPU]:
        """Put the Ulysses adapter in front of ``model``'s sdpa attention; returns the shards and the mpu (for
        ``initialize(mpu=...)``)."""
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model, "sdpa", sp, micro, seq_length=seq_len, seq_length_is_variable=False, disable_in_eval=True
        )
        return cls(mpu), mpu

    def inputs(self, x: torch.Tensor) -> dict:
        b, s = x.shape
        part = slice(self.rank * s // self.size, (self.rank + 1) * s // self.size)
        shift = torch.cat([x[:, 1:], torch.full((b, 1), IGNORE_INDEX, dtype=x.dtype)], dim=1)[:, part].contiguous()
        positions = torch.arange(s).expand(b, -1)[:, part].contiguous()
        return {"input_ids": x[:, part].contiguous(), "position_ids": positions, "labels": shift,
                "shift_labels": shift}  # fmt: skip

    def loss(self, out, inputs: dict) -> torch.Tensor:
        return sequence_parallel_loss(out.loss, inputs["shift_labels"], self.group)
