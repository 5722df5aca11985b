"""``defer_init``: a module built on the meta device becomes trainable at stage 3 without ever being whole.

``zero_init`` partitions each module as its ``__init__`` returns, so each rank holds the module being built for a
moment and then its fp32 shard of every parameter until the runtime takes them over. For a model whose shard (or
largest module) exceeds host memory neither is affordable. Here the model is built under ``torch.device("meta")``
(no storage), and each parameter gets a deferred record: its shape, dtype and an ``init`` callable that computes
its full starting value. Stage 3's materialisation (``zero_core.materialize.bucket_values``) calls it one unit at
a time, broadcasts rank 0's value (so ranks agree even if ``init`` were not deterministic), keeps this rank's chunk
and frees the rest, so the peak is one unit's values. This is the role of DeepSpeed's ``zero.Init`` with a
``remote_device``, reached through PyTorch's meta-device construction instead of patched tensor factories.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from zero_core.partition_records import PartitionedParam, record
from zero_core.partitioned_param import adopt


def defer_init(
    module: torch.nn.Module,
    init: Callable[[str, torch.Size, torch.dtype], torch.Tensor],
    group=None,
    device: torch.device | str = "cpu",
) -> int:
    """Replace every meta-device parameter of ``module`` by an empty one with a deferred record (tied parameters
    stay tied; build the optimizer afterwards); returns the elements deferred.

    Args:
        module: built under ``torch.device("meta")``; its buffers must already be real (rebuild the modules that
            own buffers, e.g. rotary tables, on ``device``).
        init: ``init(name, shape, dtype) -> tensor`` of that shape: the parameter's starting value, computed when
            its unit is materialised (call it deterministically: e.g. a generator seeded from the name).
        group: the data-parallel process group (default WORLD).
        device: where the parameter's (empty) storage and, later, its unit live.

    Raises:
        ValueError: a buffer is still on the meta device (named), as the runtime would otherwise compute with
            uninitialised memory.
    """
    for name, buf in module.named_buffers():
        if buf.is_meta:
            raise ValueError(f"defer_init: buffer {name!r} is on the meta device; rebuild its module on {device} "
                             "first (buffers are not parameters: the runtime does not materialise them)")  # fmt: skip
    group = group or dist.group.WORLD
    new: dict[int, torch.nn.Parameter] = {}  # meta parameter -> its replacement (tied ones stay tied)
    names = {id(p): n for n, p in module.named_parameters()}
    total = 0
    for m in module.modules():
        for attr, p in list(m._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in new:
                q = torch.nn.Parameter(torch.empty(0, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
                record(q, PartitionedParam(p.shape, p.shape.numel(), p.dtype, None, group,
                                           init=_value(init, names[id(p)], p.shape, p.dtype, device)))  # fmt: skip
                adopt(q)
                new[id(p)] = q
                total += p.shape.numel()
            setattr(m, attr, new[id(p)])
    return total


def _value(init, name: str, shape: torch.Size, dtype: torch.dtype, device):
    def value() -> torch.Tensor:
        out = init(name, shape, dtype)
        if tuple(out.shape) != tuple(shape):
            raise ValueError(f"defer_init: init({name!r}) gave shape {tuple(out.shape)}, expected {tuple(shape)}")
        return out.to(device=device, dtype=dtype)

    return value
