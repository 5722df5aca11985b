"""Squared L2 norms of gradient shards, the pieces of the global gradient norm (``ZeroRuntime`` and the
model-parallel split).

One fp32 reduction over a whole shard (hundreds of thousands of elements and more) accumulates rounding error far
above fp32's resolution on the CPU, enough for a clipped run to leave the single-process one. The references sum
per tensor: ``torch.nn.utils.get_total_norm`` norms each gradient in its own dtype and combines the norms; DeepSpeed
(ZeRO 1-3) norms each gradient piece in fp64 and sums the squares. Here a shard is normed in rows of ``NORM_ROW``
elements (fp32, one kernel), the row norms squared and summed in fp64: no fp64 copy of the shard, and a result as
close to the exact norm as an fp64 sum.
"""

from __future__ import annotations

import torch

NORM_ROW = 1024
"""Elements per fp32 row norm: rows short enough that their fp32 sums keep fp32's resolution."""


def sq_norm(t: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm of ``t`` (any shape, any floating dtype) as a 0-d float64 tensor on ``t``'s device.

    Computed as fp32 norms of rows of ``NORM_ROW`` consecutive elements, squared and summed in fp64 (see the module
    docstring); an empty ``t`` gives 0. Non-finite elements give inf or nan, as ``clip_grad_norm_`` reports them.
    """
    flat = t.reshape(-1)
    whole = flat.numel() // NORM_ROW * NORM_ROW
    rows = torch.linalg.vector_norm(flat[:whole].view(-1, NORM_ROW), dim=1, dtype=torch.float32)
    tail = torch.linalg.vector_norm(flat[whole:], dtype=torch.float32).reshape(1)
    return torch.cat([rows, tail]).double().square().sum()
