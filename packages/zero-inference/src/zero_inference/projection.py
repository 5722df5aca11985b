"""The weight layout of a fused block's projections: ``[out, in]`` (``nn.Linear``'s, ``F.linear(x, w)``) or
``[in, out]`` (``x @ w``), whichever the device's matrix library reads faster for one token.

A decode step multiplies one token's ``[1, in]`` activations by every weight: a matrix-vector product bound by how
fast the weight is streamed from memory. On CPU, oneDNN/MKL stream the two layouts at different rates depending on
the shape and dtype (measured figures in docs/benchmarks.md), so each projection shape is timed once per process in
both layouts on a one-token input and stored in the faster one (a clear margin is required to leave ``nn.Linear``'s
layout). Other devices keep ``nn.Linear``'s layout. Both layouts compute the same products; only the order of the
library's partial sums may differ.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

_MARGIN = 0.9
"""``[in, out]`` is chosen only when its one-token product takes at most this fraction of ``F.linear``'s."""

_CHOSEN: dict[tuple, bool] = {}


def _median_seconds(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def transposed_is_faster(weight: torch.Tensor) -> bool:
    """Whether a one-token product with ``weight`` (``[out, in]``, any float dtype) is faster stored ``[in, out]``;
    timed once per (shape, dtype) in this process (CPU only; False on other devices)."""
    key = (tuple(weight.shape), weight.dtype, weight.device.type)
    if key not in _CHOSEN:
        _CHOSEN[key] = weight.device.type == "cpu" and _time_layouts(weight)
    return _CHOSEN[key]


def _time_layouts(weight: torch.Tensor) -> bool:
    with torch.no_grad():
        w = weight.detach()
        wt = w.t().contiguous()
        x = torch.randn(1, w.shape[1], dtype=w.dtype)
        linear_s, transposed_s = [], []
        for _ in range(5):  # interleaved rounds: a busy machine slows both alike
            linear_s.append(_median_seconds(lambda: F.linear(x, w), 5))
            transposed_s.append(_median_seconds(lambda: x @ wt, 5))
    return statistics.median(transposed_s) <= _MARGIN * statistics.median(linear_s)


def store(weight: torch.Tensor) -> tuple[torch.nn.Parameter, bool]:
    """``weight`` (``[out, in]``) as a frozen parameter in its faster layout; returns ``(parameter, transposed)``,
    ``transposed`` True when it is stored ``[in, out]`` (a contiguous copy)."""
    transposed = transposed_is_faster(weight)
    with torch.no_grad():
        data = weight.detach().t().contiguous() if transposed else weight.detach()
    return torch.nn.Parameter(data, requires_grad=False), transposed


def project(x: torch.Tensor, weight: torch.Tensor, transposed: bool, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T + bias`` for ``x`` ``[..., in]`` with ``weight`` stored as :func:`store` returned it
    (``[in, out]`` when ``transposed``, else ``[out, in]``); returns ``[..., out]``."""
    y = x @ weight if transposed else F.linear(x, weight)
    return y + bias if bias is not None else y
