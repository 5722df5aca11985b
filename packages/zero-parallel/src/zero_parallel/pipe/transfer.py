"""Moving a stage's activations and gradients to its neighbours over zero_comm's point-to-point ops, with the
tensors' shapes and dtypes sent once per batch ahead of them (DeepSpeed's pipeline engine sends its activations'
metadata likewise), so the receiver can allocate its buffers.

Peers are stage indices: the group is the pipeline group, whose rank of each process is its stage. Tags tell
messages of one pair apart (the executor gives each (chunk, micro-batch, kind) its own), so a schedule whose
sends and receives between two stages come in different orders still matches them (gloo; NCCL ignores tags and
matches in order, which DeepSpeed's schedules keep).
"""

from __future__ import annotations

import torch

from zero_comm.p2p import P2PHandle, recv, send

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)  # fmt: skip


def as_tensors(value, what: str, stage: int) -> tuple[torch.Tensor, ...]:
    """``value`` (a tensor or a tuple/list of tensors) as a tuple of tensors.

    Raises:
        TypeError: anything else, naming ``what`` (e.g. "the outputs") and the stage.
    """
    items = value if isinstance(value, tuple | list) else (value,)
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"pipeline stage {stage}: {what} must be a tensor or a tuple of tensors to pass between "
                            f"stages; item {i} is {type(t).__name__}")  # fmt: skip
    return tuple(items)


def send_meta(tensors: tuple[torch.Tensor, ...], peer: int, group, stage: int, tag: int = 0,
              device: torch.device | str = "cpu") -> list[P2PHandle]:  # fmt: skip
    """Send the count, dtypes and shapes of ``tensors`` to stage ``peer`` (async; wait the handles), as int64
    tensors on ``device`` (the backend's: CUDA for NCCL).

    Raises:
        TypeError: a dtype that cannot be sent (naming the stage and the tensor's index).
    """
    words = [len(tensors)]
    for i, t in enumerate(tensors):
        if t.dtype not in _DTYPES:
            raise TypeError(f"pipeline stage {stage}: output {i} has dtype {t.dtype}, which cannot be sent between "
                            f"stages (one of {[str(d) for d in _DTYPES]})")  # fmt: skip
        words += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    body = torch.tensor(words, dtype=torch.int64, device=device)
    size = torch.tensor([body.numel()], dtype=torch.int64, device=device)
    return [send(size, peer, group, tag=tag, async_op=True), send(body, peer, group, tag=tag, async_op=True)]


def recv_meta(peer: int, group, tag: int = 0,
              device: torch.device | str = "cpu") -> list[tuple[torch.dtype, tuple[int, ...]]]:  # fmt: skip
    """Receive what :func:`send_meta` sent from stage ``peer`` with ``tag``: (dtype, shape) per tensor."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    recv(size, peer, group, tag=tag)
    body = torch.zeros(int(size.item()), dtype=torch.int64, device=device)
    recv(body, peer, group, tag=tag)
    words = body.tolist()
    out, pos = [], 1
    for _ in range(words[0]):
        dtype, ndim = _DTYPES[words[pos]], words[pos + 1]
        out.append((dtype, tuple(words[pos + 2 : pos + 2 + ndim])))
        pos += 2 + ndim
    return out


def send_tensors(tensors: tuple[torch.Tensor, ...], peer: int, group, tag: int = 0) -> list[P2PHandle]:
    """Send each tensor (made contiguous and detached) to stage ``peer`` with ``tag``, async; the tensors must not
    change until the handles are waited."""
    return [send(t.detach().contiguous(), peer, group, tag=tag, async_op=True) for t in tensors]


def recv_tensors(meta: list[tuple[torch.dtype, tuple[int, ...]]], peer: int, group, device: torch.device,
                 tag: int = 0) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Receive one tensor per ``meta`` entry from stage ``peer`` with ``tag`` (blocking), allocated on ``device``."""
    out = []
    for dtype, shape in meta:
        t = torch.empty(shape, dtype=dtype, device=device)
        recv(t, peer, group, tag=tag)
        out.append(t)
    return tuple(out)
