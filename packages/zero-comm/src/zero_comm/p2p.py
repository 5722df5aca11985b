"""Point-to-point send/recv and batched isend/irecv over torch.distributed, for pipeline-parallel runtimes.

Every call returns a :class:`P2PHandle` whose ``wait(timeout)`` raises :class:`P2PTimeout` naming this rank, the
peer (its rank in the group and its global rank), the op (send/recv), the tag and the tensor's shape and dtype.

**Peers are group ranks.** ``dst`` / ``src`` / ``P2POp.peer`` are ranks *in* ``group`` (torch's ``group_dst`` /
``group_src``), translated with ``torch.distributed.get_global_rank``; with ``group=None`` (the default group)
they equal global ranks. In a pipeline group whose ranks are the stages, the peer is the stage index.

**Matching.** Ops between one pair of ranks in one direction match in issue order (and by ``tag`` on gloo; NCCL
ignores tags). Nothing checks that the two sides agree on shape and dtype (that costs a message per op); what a
mismatch does is the backend's: on gloo, a recv buffer *smaller* than what is sent aborts the receiving process
(gloo's "Received data size doesn't match expected size", not a Python exception), a *larger* one receives the
bytes sent and keeps its tail unchanged; on NCCL a size mismatch hangs or corrupts; a different dtype of the same
byte size is received as raw bytes. A runtime whose shapes change exchanges them first (DeepSpeed's pipeline
engine sends its activations' shapes once, then only the tensors).

**A timeout breaks the connection.** gloo closes the pair of a recv or send that timed out ("Application timeout
caused pair closure"), so after a :class:`P2PTimeout` the group cannot be used between those two ranks any more;
the peer's later ops with this rank fail as :class:`P2PError`. Treat it as fatal, as a collective's timeout is.

Local checks (tensor, contiguity, peer in range and not this rank, op) raise ``ValueError`` before anything is
sent; the rejecting rank leaves the notice of :mod:`zero_comm.collectives` that its peer's timeout quotes.
Comm logging (:class:`~zero_comm.logger.CommsLogger`) records one ``send`` / ``recv`` per op with ``peer`` set
(bytes per peer: ``CommsLogger.peer_totals``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from zero_comm import logger as _logger
from zero_comm.collectives import (
    CollectiveError,
    CollectiveTimeout,
    _check_group,
    _read_notice,
    _reject,
    _shape,
)

_OPS = ("send", "recv")


class P2PError(CollectiveError):
    """A send or recv failed on this rank (e.g. the peer closed its connection).

    Attributes (besides :class:`~zero_comm.collectives.CollectiveError`'s): ``op`` ("send"/"recv"), ``peer`` (the
    peer's rank in the group), ``peer_global_rank``, ``tag``, ``cause`` (the backend's message).
    """

    def __init__(self, op: str, peer: int, peer_global_rank: int, tag: int, group_size: int, rank: int, sizes: str,
                 cause: str, notice: str | None):  # fmt: skip
        self.op = op
        self.peer = peer
        self.peer_global_rank = peer_global_rank
        self.tag = tag
        self.cause = cause
        way = "to" if op == "send" else "from"
        label = f"{op} {way} group rank {peer} (global rank {peer_global_rank}, tag {tag})"
        super().__init__(label, group_size, rank, sizes, cause, notice)

    def __reduce__(self):  # rebuilt from the constructor's arguments when pickled (harnesses, pools)
        args = (self.op, self.peer, self.peer_global_rank, self.tag, self.group_size, self.rank, self.sizes, self.cause,
                self.notice)  # fmt: skip
        return type(self), args


class P2PTimeout(P2PError, CollectiveTimeout):
    """A send or recv did not complete within its timeout (also a ``TimeoutError``). Attributes as
    :class:`P2PError`."""


@dataclass(frozen=True)
class P2POp:
    """One op of :func:`batch_send_recv` (torch's ``P2POp`` with the op named).

    Attributes:
        op: "send" or "recv".
        tensor: contiguous; sent, or received into in place.
        peer: the other rank, as a rank in ``group``.
        group: the process group; None: the default group. Every op of a batch uses the same group.
        tag: matches sends to recvs on gloo (ignored by NCCL).
    """

    op: str
    tensor: torch.Tensor
    peer: int
    group: object = None
    tag: int = 0


class _OpFailure:
    """Names one op (or every op of a coalesced batch) when its work fails; a ``FailureDescription``."""

    __slots__ = ("ops", "group", "globals")

    def __init__(self, ops: list[P2POp], group, globals_: list[int]) -> None:
        self.ops = ops
        self.group = group
        self.globals = globals_

    def failure(self, exc: Exception) -> P2PError:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        low = str(exc).lower()
        kind = P2PTimeout if ("timeout" in low or "timed out" in low) else P2PError
        first = self.ops[0]
        sizes = f"tensor {_shape(first.tensor)}"
        if len(self.ops) > 1:  # a coalesced batch (NCCL): its one work stands for every op
            others = "; ".join(f"{o.op} {_shape(o.tensor)} with group rank {o.peer}" for o in self.ops[1:])
            sizes += f", in one batch with: {others}"
        notice = _read_notice(self.group)
        return kind(first.op, first.peer, self.globals[0], first.tag, self.group.size(), dist.get_rank(), sizes,
                    text, notice)  # fmt: skip


class P2PHandle:
    """The sends and recvs of one call. ``wait(timeout)`` blocks until all have completed; a no-op afterwards.

    A received tensor is valid only after ``wait`` returns.
    """

    __slots__ = ("_pending", "_finish")

    def __init__(self, pending: list, finish) -> None:
        self._pending = pending  # (torch Work, _OpFailure) pairs not yet waited
        self._finish = finish

    def is_completed(self) -> bool:
        """True when ``wait`` would return at once without further work."""
        return not self._pending and self._finish is None

    def ready(self) -> bool:
        """True when every op has completed on this rank (a poll, never blocks; ``Work.is_completed``)."""
        return all(work.is_completed() for work, _ in self._pending)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every op, in issue order.

        Args:
            timeout: seconds for the whole wait (not per op); None: the process group's timeout.

        Raises:
            P2PTimeout: an op did not complete in time; names this rank, the peer (group and global rank), the
                op, the tag, the tensor's shape and dtype, and any rejection notice the peer left.
            P2PError: the backend reported another failure (e.g. the peer closed its connection).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._pending:
            work, describe = self._pending[0]
            try:
                if deadline is None:
                    work.wait()
                else:
                    work.wait(timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
            except RuntimeError as exc:
                raise describe.failure(exc) from exc
            self._pending.pop(0)
        finish = self._finish
        if finish is not None:
            self._finish = None
            finish()


def send(tensor: torch.Tensor, dst: int, group=None, *, tag: int = 0, async_op: bool = False) -> P2PHandle:
    """Send ``tensor`` to rank ``dst`` of ``group``.

    Args:
        tensor: contiguous, any shape and dtype; the receiver's buffer must have the same number of bytes.
        dst: the receiver's rank in ``group`` (global rank when ``group`` is None), not this rank.
        group: the process group; None: the default group.
        tag: matches this send to a recv with the same tag (gloo; NCCL ignores it).
        async_op: return at once; ``tensor`` must not be changed until ``wait`` returns.

    Raises:
        ValueError: not a contiguous tensor, ``dst`` out of range or this rank (before sending).
    Mirrors ``torch.distributed.send`` / ``isend`` with ``group_dst``.
    """
    return _issue("send", [P2POp("send", tensor, dst, group, tag)], async_op, ("tensor", "dst", "tag"))


def recv(tensor: torch.Tensor, src: int, group=None, *, tag: int = 0, async_op: bool = False) -> P2PHandle:
    """Receive into ``tensor`` (in place) from rank ``src`` of ``group``.

    Args:
        tensor: contiguous, the shape and dtype the sender sends (see the module notes on mismatches).
        src: the sender's rank in ``group`` (global rank when ``group`` is None), not this rank.
        group: the process group; None: the default group.
        tag: matches a send with the same tag (gloo; NCCL ignores it).
        async_op: return at once; ``tensor`` is valid after ``wait``.

    Raises:
        ValueError: not a contiguous tensor, ``src`` out of range or this rank (before receiving).
    Mirrors ``torch.distributed.recv`` / ``irecv`` with ``group_src``.
    """
    return _issue("recv", [P2POp("recv", tensor, src, group, tag)], async_op, ("tensor", "src", "tag"))


def _check_op(name: str, labels: tuple[str, str, str], op: P2POp, group, me: int) -> None:
    """Check one op; ``labels`` name its tensor, peer and tag in the caller's terms (``ops[i].peer`` or ``dst``)."""
    tensor, peer, tag = labels
    if op.op not in _OPS:
        raise _reject(name, group, f"{tensor.rsplit('.', 1)[0]}.op must be one of {_OPS}, got {op.op!r}")
    t = op.tensor
    if not isinstance(t, torch.Tensor):
        raise _reject(name, group, f"{tensor} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise _reject(name, group, f"{tensor} must be contiguous, got {_shape(t)} with strides {t.stride()}")
    size = group.size()
    if not isinstance(op.peer, int) or not 0 <= op.peer < size or op.peer == me:
        raise _reject(
            name, group, f"{peer} must be a rank of the group other than this one (0..{size - 1}, not {me}), "
            f"got {op.peer!r}",
        )  # fmt: skip
    if not isinstance(op.tag, int):
        raise _reject(name, group, f"{tag} must be an int, got {op.tag!r}")


def batch_send_recv(ops: list[P2POp], *, async_op: bool = False) -> P2PHandle:
    """Issue every send and recv of ``ops`` at once (the order of sends against recvs cannot deadlock).

    Ops between one pair of ranks in one direction match in list order, so a pipeline stage posts
    ``[P2POp("send", act, next), P2POp("recv", grad, next)]`` and its neighbour the mirror image.

    Args:
        ops: a non-empty list of :class:`P2POp`, all with the same group.
        async_op: return at once; received tensors are valid after ``wait``.

    Raises:
        ValueError: an empty list, mixed groups, or an op that fails the checks of :func:`send` / :func:`recv`
            (naming its index), before anything is sent.
    Mirrors ``torch.distributed.batch_isend_irecv`` (whose NCCL form runs the batch as one coalesced work; then a
    failure names every op of the batch).
    """
    name = "batch_send_recv"
    if not isinstance(ops, list | tuple) or not ops:
        raise ValueError(f"{name}: ops must be a non-empty list of zero_comm.P2POp, got {ops!r}")
    for i, op in enumerate(ops):
        if not isinstance(op, P2POp):
            group = _check_group(name, None)
            raise _reject(name, group, f"ops[{i}] must be a zero_comm.P2POp, got {type(op).__name__}")
    return _issue(name, ops, async_op, None)


def _issue(name: str, ops, async_op: bool, labels: tuple[str, str, str] | None) -> P2PHandle:
    """Check ``ops`` (``labels``: the names of a lone op's arguments; None: ``ops[i]...``) and start them."""
    group = _check_group(name, ops[0].group)
    me = dist.get_rank(group)
    for i, op in enumerate(ops):
        if i and _check_group(name, op.group) is not group:
            raise _reject(name, group, f"ops[{i}].group differs from ops[0].group: a batch uses one group")
        _check_op(name, labels or (f"ops[{i}].tensor", f"ops[{i}].peer", f"ops[{i}].tag"), op, group, me)
    ops = list(ops)
    globals_ = [dist.get_global_rank(group, op.peer) for op in ops]
    start = time.perf_counter()
    if len(ops) == 1:
        op = ops[0]
        fn = dist.isend if op.op == "send" else dist.irecv
        works = [fn(op.tensor, globals_[0], group=group, tag=op.tag)]
    else:
        works = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend if o.op == "send" else dist.irecv, o.tensor, g, group, o.tag)
             for o, g in zip(ops, globals_, strict=True)]
        )  # fmt: skip
    if len(works) == len(ops):
        pending = [(w, _OpFailure([o], group, [g])) for w, o, g in zip(works, ops, globals_, strict=True)]
    else:  # coalesced: fewer works than ops, each stands for the whole batch
        pending = [(w, _OpFailure(ops, group, globals_)) for w in works]
    finish = _log_finish(ops, globals_, group, start, async_op) if _logger._ACTIVE else None
    handle = P2PHandle(pending, finish)
    if not async_op:
        handle.wait()
    return handle


def _log_finish(ops: list[P2POp], globals_: list[int], group, start: float, async_op: bool):
    """The logging run when the batch completes: one record per op, by the loggers active now."""
    loggers = tuple(_logger._ACTIVE)

    def finish() -> None:
        latency = time.perf_counter() - start
        for op, peer in zip(ops, globals_, strict=True):
            nbytes = op.tensor.numel() * op.tensor.element_size()
            rec = _logger.CommRecord(
                name=op.op, group_size=group.size(), dtype=str(op.tensor.dtype), logical_bytes=nbytes,
                wire_bytes=nbytes if op.op == "send" else 0, latency_s=latency, async_op=async_op,
                busbw_factor=1.0, peer=peer,
            )  # fmt: skip
            for log in loggers:
                log.record(rec)

    return finish
