"""Per-rank model-state memory accounting (ZeRO paper, arXiv 1910.02054, section 5 / figure 1).

The paper counts, per rank, parameters, gradients and optimizer states (fp32 master weights plus K bytes of
optimizer state per element; Adam: momentum and variance). We measure the tensors this rank actually holds, each
storage counted once (an alias such as a stage-0 fp32 master that *is* the model's buffer is counted once, under
``params``), padding included.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch


def _nbytes(tensors, seen: set) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def model_state_bytes(
    *,
    params: Iterable[torch.Tensor | None],
    grads: Iterable[torch.Tensor | None],
    master: Iterable[torch.Tensor | None],
    optimizer_state: Mapping[Any, Mapping[str, Any]],
) -> dict[str, int]:
    """Bytes held by this rank, each storage counted once, under the first key that holds it, in this order:
    ``params`` (model parameter storage: full buffers resident plus stage-3 shards), ``grads`` (bucket gradient
    buffers and gradient shards), ``master`` (fp32 master shards not aliased to params), ``optimizer`` (the
    per-element tensors of ``optimizer_state``: torch's ``Optimizer.state``, parameter -> name -> value) and
    ``total``. Transient buffers (stage-3 gathered units, in-flight bucket gradients) are counted only if resident
    when called. ``ZeroRuntime.model_state_bytes`` passes its stores' ``resident()`` tensors."""
    seen: set = set()
    out = {"params": _nbytes(params, seen)}
    out["grads"] = _nbytes(grads, seen)
    out["master"] = _nbytes(master, seen)
    state = []
    for per_param in optimizer_state.values():
        state += [v for v in per_param.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    out["optimizer"] = _nbytes(state, seen)
    out["total"] = sum(out.values())
    return out
