"""The local half of the reduce-scatters that zero_comm runs itself (gloo all-to-all, shared memory): combine the
w received parts in rank order 0..w-1, so the same inputs give bitwise the same output on every rank and run."""

from __future__ import annotations

import torch

_LOW = (torch.bfloat16, torch.float16)


def reduce_into(out: torch.Tensor, parts, op: str = "sum") -> None:
    """``out = parts[0] op parts[1] op ... op parts[w-1]``, in that order.

    Args:
        out: the result, same shape and dtype as each part (may alias none of them).
        parts: the w contributions (tensors or views), in rank order.
        op: "sum" (bf16/fp16 accumulate in fp32 and round once, so at least as accurate as gloo's own sum, which
            rounds after every addition), "max", "min" or "product".
    """
    if op == "sum":
        low = out.dtype in _LOW
        acc = parts[0].float() if low else out.copy_(parts[0])
        for p in parts[1:]:
            acc.add_(p)
        if low:
            out.copy_(acc)
        return
    fn = {"max": torch.maximum, "min": torch.minimum, "product": torch.mul}[op]
    out.copy_(parts[0])
    for p in parts[1:]:
        fn(out, p, out=out)
