"""``clone_tensors_for_torch_save``: compact copies for ``torch.save`` (served as ``deepspeed.checkpoint.utils``)."""

from __future__ import annotations

import torch

_CPU = torch.device("cpu")


def clone_tensors_for_torch_save(item, device: torch.device = _CPU):
    """Copies of every tensor in ``item`` (nested dicts, lists and tuples too) on ``device``, each with its own
    storage so that ``torch.save`` writes only its elements (views of flat buffers would save the whole buffer).
    Parameters hold the values after the last optimizer step whenever ``step()`` has returned. Non-tensor values
    are returned as they are.
    """
    return _clone(item, device)


def _clone(item, device):
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, dict):
        return type(item)({k: _clone(v, device) for k, v in item.items()})
    if isinstance(item, list | tuple):
        return type(item)(_clone(v, device) for v in item)
    return item
