"""The training dataloader DeepSpeed's engine builds from ``training_data``: one DistributedSampler per rank."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler


def build_dataloader(dataset: torch.utils.data.Dataset, micro_batch: int, rank: int, world_size: int,
                     collate_fn=None, seed: int = 0, drop_last: bool = False) -> DataLoader:  # fmt: skip
    """A DataLoader yielding this rank's micro-batches of ``micro_batch`` samples.

    Mirrors DeepSpeed's ``deepspeed_io``: a ``DistributedSampler(num_replicas=world_size, rank=rank, shuffle=True,
    seed)``; call ``loader.sampler.set_epoch(e)`` each epoch for a new order.
    """
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    return DataLoader(dataset, batch_size=micro_batch, sampler=sampler, collate_fn=collate_fn, drop_last=drop_last)
