"""Tensors in nested lists, tuples and dicts moved between devices (DeepSpeed's ``move_to_device``, served as
``deepspeed.runtime.utils``, which Accelerate's examples import), and ``noop_context``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch


def move_to_device(item, device: torch.device | str, criterion_func: Callable[[object], bool] | None = None):
    """``item`` with its tensors on ``device``, as DeepSpeed's ``move_to_device``.

    Args:
        item: a tensor, or lists, tuples and dicts of them (nested); other leaves are returned unchanged.
        device: the target device.
        criterion_func: when given, only leaves for which it is true move, in place (their ``.data`` is replaced,
            so other references see the new device); the others are returned as they are. Without it every tensor
            is copied with ``.to(device)``.

    Returns:
        the same structure (new lists, tuples and dicts) holding the moved tensors.
    """
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    if isinstance(item, torch.Tensor) and criterion_func is None:
        return item.to(device)
    return item


def noop_context() -> contextlib.AbstractContextManager:
    """A context manager that does nothing (DeepSpeed's ``noop_context``, used for streams on the CPU)."""
    return contextlib.nullcontext()


__all__ = ["move_to_device", "noop_context"]
