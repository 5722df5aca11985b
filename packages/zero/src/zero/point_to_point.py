"""DeepSpeed 0.19.8's point-to-point calls (``deepspeed.comm.send`` / ``recv`` / ``isend`` / ``irecv``) over
zero_comm's checked, logged, time-bounded send/recv.

As in DeepSpeed (and ``torch.distributed.send``), ``dst`` / ``src`` are *global* ranks, also when ``group`` is given;
zero_comm's calls take group ranks, so they are translated here. A wait that runs past the group's timeout raises
``zero_comm.P2PTimeout`` naming both ranks, the op, the tag and the tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import zero_comm


def _group_rank(name: str, arg: str, group, rank: int) -> int:
    """``rank`` (global) as a rank of ``group``; ValueError naming ``arg`` when it is not a member."""
    if group is None or group is dist.group.WORLD:
        return rank
    try:
        return dist.get_group_rank(group, rank)
    except (ValueError, RuntimeError) as exc:
        raise ValueError(f"deepspeed.comm.{name}: {arg}={rank} (a global rank) is not in the given group") from exc


def _sender(name: str, src) -> int:
    if src is None:  # torch would take any sender; zero_comm pairs each recv with one peer so a wait can name it
        raise ValueError(f"deepspeed.comm.{name}: src=None (receive from any rank) is not supported; give the "
                         "sender's global rank")  # fmt: skip
    return src


def send(tensor: torch.Tensor, dst: int, group=None, tag: int = 0, prof: bool = False, log_name: str = "send",
         debug=None) -> None:  # fmt: skip
    """Send ``tensor`` (contiguous) to global rank ``dst``; blocks until it is sent.

    Raises: ValueError for a non-contiguous tensor or a ``dst`` that is this rank or not in ``group``;
    zero_comm.P2PTimeout past the group's timeout."""
    zero_comm.send(tensor, _group_rank("send", "dst", group, dst), group, tag=tag).wait()


def recv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0, prof: bool = False,
         log_name: str = "recv", debug=None) -> int:  # fmt: skip
    """Receive into ``tensor`` (in place) from global rank ``src``; returns ``src`` (torch returns the sender).

    Raises: ValueError for ``src=None`` (any sender: not supported), a non-contiguous tensor, or a ``src`` that is
    this rank or not in ``group``; zero_comm.P2PTimeout past the group's timeout."""
    src = _sender("recv", src)
    zero_comm.recv(tensor, _group_rank("recv", "src", group, src), group, tag=tag).wait()
    return src


def isend(tensor: torch.Tensor, dst: int, group=None, tag: int = 0, prof: bool = False, log_name: str = "isend",
          debug=None) -> zero_comm.P2PHandle:  # fmt: skip
    """As :func:`send` but returns at once a handle whose ``wait()`` completes it (``tensor`` unchanged until then)."""
    return zero_comm.send(tensor, _group_rank("isend", "dst", group, dst), group, tag=tag, async_op=True)


def irecv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0, prof: bool = False,
          log_name: str = "irecv", debug=None) -> zero_comm.P2PHandle:  # fmt: skip
    """As :func:`recv` but returns at once a handle; ``tensor`` is valid after its ``wait()``."""
    src = _sender("irecv", src)
    return zero_comm.recv(tensor, _group_rank("irecv", "src", group, src), group, tag=tag, async_op=True)
