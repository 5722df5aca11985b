"""DeepSpeed 0.19.8 refuses ``loss.backward()`` called directly on a ZeRO stage-0 engine's output (bypassing
``engine.backward``, which scales by the accumulation steps and reduces at the boundary): a RuntimeError telling to
use ``engine.backward(loss)``. :func:`guard_outputs` reproduces it with a gradient hook on the forward's outputs."""

from __future__ import annotations

from collections.abc import Callable

import torch

MESSAGE = ("Direct calls to tensor.backward() are not supported with ZeRO stage 0: the gradients would be neither "
           "scaled by the accumulation steps nor reduced. Please use engine.backward(loss) instead.")  # fmt: skip


def _tensors(out, found: list[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        if out.requires_grad:
            found.append(out)
    elif isinstance(out, dict):  # transformers' ModelOutput is a dict too
        for v in out.values():
            _tensors(v, found)
    elif isinstance(out, list | tuple):
        for v in out:
            _tensors(v, found)
    return found


def guard_outputs(out, in_engine_backward: Callable[[], bool]):
    """Hook every output tensor that requires grad: its gradient raises RuntimeError (:data:`MESSAGE`) unless
    ``in_engine_backward()`` says ``engine.backward`` runs it. Returns ``out`` unchanged."""

    def check(grad: torch.Tensor) -> torch.Tensor:
        if not in_engine_backward():
            raise RuntimeError(MESSAGE)
        return grad

    for t in _tensors(out, []):
        t.register_hook(check)
    return out
