"""Picklable Python objects across ranks without numpy.

``torch.distributed.all_gather_object`` / ``broadcast_object_list`` turn the received bytes back into objects
through ``Tensor.numpy()``, and torch does not require numpy: in an environment without it they raise
"Numpy is not available". These do the same with two plain collectives each (sizes, then the padded bytes) and
``bytes(tensor.tolist())`` / ``torch.frombuffer``. Meant for small control messages (ids, error strings,
set-up records), not tensors.
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist


def _to_tensor(obj) -> torch.Tensor:
    data = pickle.dumps(obj)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _from_tensor(t: torch.Tensor, size: int):
    return pickle.loads(bytes(t[:size].tolist()))


def all_gather_object(obj, group) -> list:
    """Every rank's ``obj`` in group-rank order (as ``torch.distributed.all_gather_object``, returned instead of
    filled in). Collective over ``group``; CPU tensors, so the group needs a CPU backend (gloo)."""
    data = _to_tensor(obj)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(group.size())]
    dist.all_gather(sizes, torch.tensor([data.numel()]), group=group)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    out = [torch.empty(longest, dtype=torch.uint8) for _ in range(group.size())]
    dist.all_gather(out, padded, group=group)
    return [_from_tensor(t, int(s)) for t, s in zip(out, sizes)]


def broadcast_object(obj, src: int, group):
    """``obj`` of global rank ``src`` on every rank of ``group`` (as ``torch.distributed.broadcast_object_list``
    with one element; the other ranks' ``obj`` is ignored). Collective over ``group``."""
    data = _to_tensor(obj) if dist.get_rank() == src else torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([data.numel()])
    dist.broadcast(size, src=src, group=group)
    buf = data if dist.get_rank() == src else torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    return _from_tensor(buf, int(size))
