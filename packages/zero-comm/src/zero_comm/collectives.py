"""Typed collective wrappers over torch.distributed that behave the same on gloo and NCCL.

Every function takes its process group explicitly and returns a :class:`CommHandle`; a synchronous call returns an
already completed handle. Semantics are those of ``torch.distributed`` (``all_gather_single`` /
``reduce_scatter_single`` where torch has them, else ``all_gather_into_tensor`` / ``reduce_scatter_tensor``).

Input checks (sizes, dtype, device, contiguity) run before any communication and raise ``ValueError`` naming the
argument, its shape and the expected shape.

**A rank that rejects its input.** The checks depend only on this rank's tensors, so one rank can reject while its
peers, whose inputs are fine, enter the collective. The rejecting rank posts a notice (``"rank r rejected ...: why"``)
to the default process group's store, then raises ``ValueError``. Its peers block in the collective until the
process group's timeout (or ``wait(timeout)``) expires and then raise :class:`CollectiveTimeout` (or
:class:`CollectiveError` when the backend reports a broken connection first) whose message quotes that notice, so
every rank ends within the timeout and names the rank that rejected. (A collective agreement on validity before
every call would cost one extra all-reduce per collective, which the hot path cannot afford.)

**"avg" on gloo** is emulated: a "sum" collective, then an in-place division by the group size once the handle
completes (NCCL uses its native ``ReduceOp.AVG``). "avg" requires a floating-point dtype.

**Bytes on the wire** (``CommRecord.wire_bytes``, bytes this rank sends), for the algorithms the backends use:
ring all-gather ``(n-1)/n * output``; ring all-reduce ``2(n-1)/n * S``; all-to-all ``(n-1)/n * input``;
broadcast ``(n-1)/n * S`` (the ``(n-1) * S`` bytes a chain or tree sends in all, averaged over ranks);
reduce-scatter ``(n-1)/n * input`` on NCCL (ring) but ``2(n-1)/n * input`` on gloo's native call, which
all-reduces the whole input and keeps this rank's chunk. The gloo algorithms of :mod:`zero_comm.algorithms`
("broadcast"/"all_to_all" all-gather, "all_to_all" reduce-scatter) send ``(n-1)/n`` of the full buffer per rank.
Each record names the algorithm that ran (``CommRecord.algorithm``).

**Algorithm choice.** ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` take ``algorithm`` ("auto" default):
on gloo "auto" runs broadcasts for all-gathers from 2 MiB of output and an all-to-all plus a fixed-order local sum
for every reduce-scatter (measured 1.5-2.7x faster than gloo's own calls at 8-64 MiB; the table is in
:mod:`zero_comm.algorithms`); NCCL keeps the native calls.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from zero_comm import algorithms as _alg
from zero_comm import buffers as _buffers
from zero_comm import logger as _logger
from zero_comm.rank_order import reduce_into

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}
_NOTICE_KEY = "zero_comm/rejected/"


class CollectiveError(RuntimeError):
    """A collective failed on this rank (e.g. a peer closed its connection after rejecting its input).

    Attributes: ``collective`` (name), ``group_size``, ``rank`` (global rank of this process), ``sizes`` (a
    description of the tensors' shapes and dtypes), ``notice`` (a peer's rejection notice, or None).
    """

    def __init__(self, collective: str, group_size: int, rank: int, sizes: str, cause: str, notice: str | None):
        self.collective = collective
        self.group_size = group_size
        self.rank = rank
        self.sizes = sizes
        self.notice = notice
        peer = f"; a peer posted: {notice}" if notice else "; no peer posted a rejection notice"
        super().__init__(f"{collective} on rank {rank} (group of {group_size}) with {sizes} failed: {cause}{peer}")


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A collective did not complete within its timeout. Same attributes as :class:`CollectiveError`."""


class FailureDescription(Protocol):
    """What a handle names when its work fails, for calls whose failure says more than a collective's tuple
    (a point-to-point op names its peer; an all-to-all-v its split sizes)."""

    def failure(self, exc: Exception) -> CollectiveError:
        """The error to raise for the backend's ``exc`` (a timeout or a broken connection)."""
        ...


class CommHandle:
    """The result of a collective. ``wait(timeout)`` blocks until it completes; a no-op once complete.

    Async "avg" emulation and comm logging finish inside ``wait``, so the output is only valid after it returns.
    """

    __slots__ = ("_work", "_finish", "_describe")

    def __init__(self, work=None, finish=None, describe=None):
        self._work = work
        self._finish = finish
        self._describe = describe

    def is_completed(self) -> bool:
        """True when ``wait`` would return without blocking and without further work."""
        return self._work is None and self._finish is None

    def ready(self) -> bool:
        """True when the collective has completed on this rank, so ``wait`` will not block (it may still run the
        handle's finishing work, e.g. the sum of an all-to-all reduce-scatter). Never blocks: a poll, as
        ``torch.distributed.Work.is_completed``. A collective that failed is ready too; ``wait`` raises."""
        work = self._work
        return work is None or work.is_completed()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the collective completes, at most ``timeout`` seconds (None: the process group's timeout).

        Raises:
            CollectiveTimeout: the collective did not complete in time; names the collective, the group size, this
                rank, the tensor sizes and any peer's rejection notice.
            CollectiveError: the backend reported another failure (e.g. a peer closed its connection).
        """
        work = self._work
        if work is not None:
            try:
                if timeout is None:
                    work.wait()
                else:
                    work.wait(timedelta(seconds=timeout))
            except RuntimeError as exc:
                raise _failure(self._describe, exc) from exc
            self._work = None
        finish = self._finish
        if finish is not None:
            self._finish = None
            finish()


_DONE = CommHandle()


def _failure(describe, exc: Exception) -> CollectiveError:
    if not isinstance(describe, tuple):  # a FailureDescription
        return describe.failure(exc)
    name, group, tensors = describe  # formatted only here: formatting on every call costs ~10 us
    sizes = ", ".join(f"{arg} {_shape(t)}" for arg, t in tensors)
    notice = _read_notice(group)
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    kind = CollectiveTimeout if ("timeout" in str(exc).lower() or "timed out" in str(exc).lower()) else CollectiveError
    return kind(name, group.size(), dist.get_rank(), sizes, text, notice)


def _group_key(group) -> str:
    return _NOTICE_KEY + ",".join(map(str, dist.get_process_group_ranks(group)))


def _read_notice(group) -> str | None:
    try:
        store = dist.distributed_c10d._get_default_store()
        key = _group_key(group)
        if store.check([key]):
            return store.get(key).decode()
    except Exception:  # noqa: BLE001 - the notice is best effort; the timeout error stands without it
        return None
    return None


def _reject(name: str, group, message: str) -> ValueError:
    """Post a rejection notice for the peers of this rank, then return the ValueError to raise."""
    rank = dist.get_rank()
    text = f"rank {rank} rejected its input to {name}: {message}"
    try:
        dist.distributed_c10d._get_default_store().set(_group_key(group), text)
    except Exception:  # noqa: BLE001 - without a store the peers still fail at their timeout
        pass
    return ValueError(text)


def _shape(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)} ({t.numel()} elements, {t.dtype}, {t.device})"


def _check_group(name: str, group):
    """``group`` itself, or the default process group (``dist.group.WORLD``) for None, as torch means by None.

    Raises:
        ValueError: ``group`` is neither None nor a ``ProcessGroup``, or None before ``init_process_group``.
    """
    if group is None:
        world = dist.group.WORLD
        if world is None:
            raise ValueError(f"{name}: group None means the default process group, which does not exist yet; call "
                             "torch.distributed.init_process_group first")  # fmt: skip
        return world
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(
            f"{name}: group must be a torch.distributed.ProcessGroup or None (the default group), got {group!r}"
        )
    return group


def _check_tensor(name: str, group, arg: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise _reject(name, group, f"{arg} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise _reject(name, group, f"{arg} must be contiguous, got {_shape(t)} with strides {t.stride()}")


def _check_pair(name: str, group, output, input) -> None:
    _check_tensor(name, group, "output", output)
    _check_tensor(name, group, "input", input)
    if output.dtype != input.dtype:
        raise _reject(name, group, f"output dtype {output.dtype} differs from input dtype {input.dtype}")
    if output.device != input.device:
        raise _reject(name, group, f"output device {output.device} differs from input device {input.device}")


# torch's ReduceOp members zero_comm knows by name ("avg" etc.); the rest are named in the error only
_TORCH_OPS = (("sum", "SUM"), ("avg", "AVG"), ("max", "MAX"), ("min", "MIN"), ("product", "PRODUCT"),
              (None, "BAND"), (None, "BOR"), (None, "BXOR"), (None, "PREMUL_SUM"))  # fmt: skip


def op_name(op) -> str | None:
    """The zero_comm name (``"sum"``, ``"avg"``, ``"max"``, ``"min"``, ``"product"``) of ``op``: that string itself,
    or a ``torch.distributed.ReduceOp`` (``ReduceOp.SUM`` or ``ReduceOp(ReduceOp.SUM)``); None for an op with no
    zero_comm name (``BAND``, ``BOR``, ``BXOR``, ``PREMUL_SUM``) or anything else."""
    if isinstance(op, str):
        return op
    for name, member in _TORCH_OPS:
        try:
            if op == getattr(dist.ReduceOp, member):
                return name
        except (TypeError, RuntimeError):  # a ReduceOp compared with a foreign object
            return None
    return None


def _describe_op(op) -> str:
    if isinstance(op, str):
        return repr(op)
    for _, member in _TORCH_OPS:
        try:
            if op == getattr(dist.ReduceOp, member):
                return f"ReduceOp.{member}"
        except (TypeError, RuntimeError):
            break
    return repr(op)


def _check_op(name: str, group, op, allowed: tuple[str, ...], t: torch.Tensor) -> str:
    """``op`` as a zero_comm name (a string or torch's ``ReduceOp``), checked against ``allowed`` and the dtype."""
    named = op_name(op)
    if named not in allowed:
        torch_names = ", ".join(f"ReduceOp.{m}" for n, m in _TORCH_OPS if n in allowed)
        raise _reject(name, group, f"op must be one of {allowed} (or {torch_names}), got {_describe_op(op)}")
    if named == "avg" and not (t.is_floating_point() or t.is_complex()):
        raise _reject(name, group, f"op 'avg' needs a floating-point tensor, got {t.dtype}")
    return named


def _is_nccl(group) -> bool:
    return dist.get_backend(group) == "nccl"


def _wire_bytes(name: str, group, logical: int, algorithm: str = "native") -> int:
    n = group.size()
    if n <= 1:
        return 0
    if name == "all_reduce":
        return round(2 * (n - 1) / n * logical)
    if name == "reduce_scatter_tensor" and algorithm == "native" and not _is_nccl(group):
        return round(2 * (n - 1) / n * logical)  # gloo: all-reduce of the whole input
    return round((n - 1) / n * logical)


def _issue(
    name, group, work, async_op, logical_tensor, describe, post=None, kind=None, algorithm="native", wire_bytes=None
):
    """Wrap ``work``; attach ``post`` (avg division, unpacking) and logging; wait now unless ``async_op``.

    ``name`` is what the logger records; ``kind`` the underlying torch collective (default ``name``), which fixes
    the wire-bytes formula and the busbw factor; ``algorithm`` the one that ran (its wire bytes); ``wire_bytes``
    the bytes this rank sends where the caller knows them exactly (uneven splits). -> CommHandle.
    """
    if _logger._ACTIVE:
        # The loggers active when the collective is issued own its record, even if an async op completes after
        # they exit (a post-step all-gather waited in the next forward belongs to the step that issued it).
        loggers = tuple(_logger._ACTIVE)
        start = time.perf_counter()
        inner = post

        def post() -> None:
            if inner is not None:
                inner()
            latency = time.perf_counter() - start
            logical = logical_tensor.numel() * logical_tensor.element_size()
            rec = _logger.CommRecord(
                name=name, group_size=group.size(), dtype=str(logical_tensor.dtype), logical_bytes=logical,
                wire_bytes=_wire_bytes(kind or name, group, logical, algorithm) if wire_bytes is None else wire_bytes,
                latency_s=latency,
                async_op=async_op, busbw_factor=_logger.bus_factor(kind or name, group.size()), algorithm=algorithm,
            )  # fmt: skip
            for log in loggers:
                log.record(rec)

    handle = CommHandle(work, post, describe)
    if not async_op:
        handle.wait()
        return _DONE
    return handle


def _avg_post(tensor: torch.Tensor, world: int):
    return lambda: tensor.div_(world)


def _chain(first, then):
    """Run ``first`` then ``then`` (either may be None)."""
    if first is None or then is None:
        return first or then

    def both() -> None:
        first()
        then()

    return both


def _started(describe, start, *args):
    """``start(*args)``; a backend failure while starting (the first "shm" call sets the group's channel up,
    collectively) raises the :class:`CollectiveError` / :class:`CollectiveTimeout` that ``wait`` would."""
    try:
        return start(*args)
    except RuntimeError as exc:
        raise _failure(describe, exc) from exc


def all_gather_into_tensor(
    output: torch.Tensor, input: torch.Tensor, group=None, *, async_op: bool = False, algorithm: str = "auto"
) -> CommHandle:
    """Gather every rank's ``input`` into ``output`` in rank order (``output[r*k:(r+1)*k]`` is rank r's input).

    Args:
        output: contiguous, ``world * input.numel()`` elements, same dtype and device as ``input``.
        input: contiguous, any shape; ``k = input.numel()`` elements.
        group: the process group; None: the default group (``dist.group.WORLD``).
        async_op: return at once; call ``wait`` on the handle before reading ``output`` (with "broadcast", the ``w``
            broadcasts are all in flight and ``wait`` completes them all).
        algorithm: "auto" (gloo: "broadcast" from 2 MiB of output, else "native"; other backends: "native"),
            "native" (the backend's call), "broadcast" (each rank broadcasts its slot) or "all_to_all" (the shard
            repeated w times through all_to_all_single). Every algorithm gives bitwise the same output; the
            measured choice is in :mod:`zero_comm.algorithms`.

    Raises:
        ValueError: wrong sizes, dtype/device mismatch, non-contiguous tensors or unknown algorithm (before
            communicating).
    Mirrors ``torch.distributed.all_gather_into_tensor``.
    """
    return _all_gather(output, input, group, async_op, "all_gather_into_tensor", algorithm=algorithm)


def _check_algorithm(name: str, group, algorithm: str, allowed: tuple[str, ...]) -> None:
    if algorithm not in allowed:
        raise _reject(name, group, f"algorithm must be one of {allowed}, got {algorithm!r}")


def _check_all_gather(name, group, output, input, algorithm) -> None:
    """Every check of an all-gather, each raising ValueError naming the argument (the slow path of the quick test
    in :func:`_all_gather`)."""
    _check_pair(name, group, output, input)
    world = group.size()
    if output.numel() != world * input.numel():
        raise _reject(
            name, group, f"output has {_shape(output)} but expected {world * input.numel()} elements "
            f"(world size {world} x input {_shape(input)})",
        )  # fmt: skip
    _check_algorithm(name, group, algorithm, _alg.ALL_GATHER_ALGORITHMS)


def _all_gather(output, input, group, async_op, name, post=None, algorithm="auto") -> CommHandle:
    if group.__class__ is not dist.ProcessGroup:
        group = _check_group(name, group)
    try:  # one test on the hot path; the precise check (and its message) only when it fails
        fine = (output.is_contiguous() and input.is_contiguous() and output.dtype == input.dtype
                and output.device == input.device and output.numel() == group.size() * input.numel()
                and algorithm in _alg.ALL_GATHER_ALGORITHMS)  # fmt: skip
    except AttributeError:  # not a tensor
        fine = False
    if not fine:
        _check_all_gather(name, group, output, input, algorithm)
    describe = (name, group, (("output", output), ("input", input)))
    try:  # the first "shm" call sets the group's channel up (collectively): a failure is the collective's
        work, algorithm = _alg.start_all_gather(algorithm, output, input, group)
    except RuntimeError as exc:
        raise _failure(describe, exc) from exc
    if _logger._ACTIVE:
        return _issue(name, group, work, async_op, output, describe, post, "all_gather_into_tensor", algorithm)
    handle = CommHandle(work, post, describe)
    if async_op:
        return handle
    handle.wait()
    return _DONE


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    group=None,
    *,
    op: str = "sum",
    async_op: bool = False,
    algorithm: str = "auto",
) -> CommHandle:
    """Reduce ``input`` over ranks and leave chunk r (``input[r*k:(r+1)*k]`` reduced) in rank r's ``output``.

    Args:
        output: contiguous, ``k`` elements, same dtype and device as ``input``.
        input: contiguous, ``world * k`` elements.
        group: the process group; None: the default group.
        op: "sum" or "avg", or torch's ``ReduceOp.SUM`` / ``ReduceOp.AVG`` ("avg" on gloo: sum then divide by the
            group size; floating dtypes only).
        async_op: return at once; ``output`` is valid after ``wait`` (which also does the "all_to_all" chunk sum).
        algorithm: "auto" (gloo: "all_to_all"; other backends: "native"), "native" (the backend's call; gloo's
            moves the bytes of an all-reduce) or "all_to_all" (exchange chunks with all_to_all_single, then sum the
            w received chunks in rank order: deterministic; bf16/fp16 summed in fp32 and rounded once). At 2 ranks
            fp32 results equal the native ones bitwise; at more ranks within rounding of a different sum order.

    Raises:
        ValueError: wrong sizes, dtype/device mismatch, non-contiguous tensors, an op other than sum/avg (naming
            it and the accepted ones) or an unknown algorithm (before communicating).
    Mirrors ``torch.distributed.reduce_scatter_tensor``.
    """
    return _reduce_scatter(output, input, group, op, async_op, "reduce_scatter_tensor", algorithm=algorithm)


def _check_reduce_scatter(name, group, output, input, op, algorithm) -> str:
    """Every check of a reduce-scatter (ValueError naming the argument); returns ``op``'s name."""
    _check_pair(name, group, output, input)
    op = _check_op(name, group, op, ("sum", "avg"), input)
    world = group.size()
    if input.numel() != world * output.numel():
        raise _reject(
            name, group, f"input has {_shape(input)} but expected {world * output.numel()} elements "
            f"(world size {world} x output {_shape(output)})",
        )  # fmt: skip
    _check_algorithm(name, group, algorithm, _alg.REDUCE_SCATTER_ALGORITHMS)
    return op


def _reduce_scatter(output, input, group, op, async_op, name, post=None, algorithm="auto", describe=None):
    """:func:`reduce_scatter_tensor` logged as ``name``, then ``post`` when it completes; ``describe``: what a
    failure names (default: ``name``, output and input). -> CommHandle"""
    if group.__class__ is not dist.ProcessGroup:
        group = _check_group(name, group)
    try:  # one test on the hot path; the precise check (and its message) only when it fails
        fine = (output.is_contiguous() and input.is_contiguous() and output.dtype == input.dtype
                and output.device == input.device and input.numel() == group.size() * output.numel()
                and algorithm in _alg.REDUCE_SCATTER_ALGORITHMS
                and (op == "sum" or (op == "avg" and input.is_floating_point())))  # fmt: skip
    except AttributeError:  # not a tensor
        fine = False
    if not fine:  # also a torch ReduceOp, or "avg" of a complex tensor: named here
        op = _check_reduce_scatter(name, group, output, input, op, algorithm)
    if describe is None:
        describe = (name, group, (("output", output), ("input", input)))
    try:
        work, finish, algorithm = _alg.start_reduce_scatter(algorithm, output, input, group, op == "avg")
    except RuntimeError as exc:
        raise _failure(describe, exc) from exc
    if post is not None:  # the chunk sum and the avg division first, then the caller's unpacking
        finish = _chain(finish, post)
    if _logger._ACTIVE:
        return _issue(name, group, work, async_op, input, describe, finish, "reduce_scatter_tensor", algorithm)
    handle = CommHandle(work, finish, describe)
    if async_op:
        return handle
    handle.wait()
    return _DONE


def reduce_scatter_uneven(
    output: torch.Tensor,
    input: torch.Tensor,
    split_sizes: list[int],
    group=None,
    *,
    op: str = "sum",
    async_op: bool = False,
    algorithm: str = "auto",
) -> CommHandle:
    """Reduce-scatter with a count per rank (MPI's ``MPI_Reduce_scatter`` with ``recvcounts``): ``input`` is cut
    into consecutive parts of ``split_sizes[r]`` elements and rank r's ``output`` gets part r reduced over ranks.

    Used to reduce one slice of a range-sharded buffer as soon as its gradients are ready (a DDP-sized bucket
    that covers the ends of some ranks' chunks, or lies inside one rank's chunk: then the other parts are empty).
    Runs as one ``all_to_all_single`` with uneven splits (rank r receives every rank's part r) and a sum of the
    received parts in rank order 0..w-1 when the handle is waited (deterministic; bf16/fp16 summed in fp32 and
    rounded once). Each rank sends ``input.numel() - split_sizes[rank]`` elements; the record's ``wire_bytes``
    is the mean over ranks, ``(w-1)/w`` of ``input``, so a whole buffer reduced in such slices costs what one
    reduce-scatter of it costs.

    Args:
        output: contiguous, ``split_sizes[rank]`` elements (may be 0), same dtype and device as ``input``.
        input: contiguous, ``sum(split_sizes)`` elements.
        split_sizes: one non-negative count per rank of ``group``, the same list on every rank.
        group: the process group; None: the default group.
        op: "sum" or "avg" (floating dtypes only), or torch's ``ReduceOp.SUM`` / ``ReduceOp.AVG``.
        async_op: return at once; ``output`` is valid after ``wait``.
        algorithm: "auto" / "all_to_all" (as above) or "shm" (through shared memory, see
            :mod:`zero_comm.shm`; the same sum order).

    Raises:
        ValueError: wrong number of counts, negative counts, sizes that do not add up, dtype/device mismatch,
            non-contiguous tensors, an unknown op or algorithm (before communicating).
    """
    name = "reduce_scatter_uneven"
    group = _check_group(name, group)
    _check_pair(name, group, output, input)
    op = _check_op(name, group, op, ("sum", "avg"), input)
    world, rank = group.size(), dist.get_rank(group)
    splits = [int(n) for n in split_sizes]
    if len(splits) != world or any(n < 0 for n in splits):
        raise _reject(name, group, f"split_sizes must hold {world} non-negative counts, got {split_sizes}")
    if sum(splits) != input.numel():
        raise _reject(name, group, f"input has {_shape(input)} but split_sizes {splits} add up to {sum(splits)}")
    if output.numel() != splits[rank]:
        raise _reject(name, group, f"output has {_shape(output)} but split_sizes[{rank}] is {splits[rank]}")
    describe = (name, group, (("output", output), ("input", input)))
    mine = splits[rank]
    _check_algorithm(name, group, algorithm, ("auto", "all_to_all", "shm"))
    if world == 1:  # output = input: no receive buffer, no backend call
        return _issue(name, group, _alg.local_copy(output, input), async_op, input, describe)
    if algorithm == "shm":
        ch = _started(describe, _alg.shm_channel, group)
        work = ch.submit(ch.reduce_scatter, output, input, splits)
        post = _avg_post(output, world) if op == "avg" else None
        return _issue(name, group, work, async_op, input, describe, post, algorithm="shm")
    recv = _buffers.scratch.take(world * mine, input.dtype, input.device)  # the same storage every step (CPU)
    work = dist.all_to_all_single(recv, input.reshape(-1), [mine] * world, splits, group=group, async_op=True)
    out = output.view(-1)

    def sum_parts() -> None:
        reduce_into(out, recv.view(world, mine))
        if op == "avg":
            out.div_(world)
        _buffers.scratch.give(recv)

    return _issue(name, group, work, async_op, input, describe, sum_parts)


def all_reduce(
    tensor: torch.Tensor, group=None, *, op: str = "sum", async_op: bool = False, algorithm: str = "auto"
) -> CommHandle:
    """Reduce ``tensor`` over ranks in place.

    Args:
        tensor: contiguous, any shape and dtype.
        group: the process group; None: the default group.
        op: "sum", "avg", "max", "min" or "product", or the torch ``ReduceOp`` of the same name ("avg" on gloo:
            sum then divide; floating dtypes only). Bitwise ops (``BAND``, ``BOR``, ``BXOR``) and ``PREMUL_SUM``
            are refused.
        async_op: return at once; ``tensor`` is valid after ``wait``.
        algorithm: "auto" / "native" (the backend's call) or "shm" (through shared memory, :mod:`zero_comm.shm`:
            a reduce-scatter then an all-gather per piece, bitwise the same result on every rank).

    Raises:
        ValueError: non-contiguous tensor, unknown op or algorithm, or "shm" for a group without a channel
            (before communicating).
    Mirrors ``torch.distributed.all_reduce``.
    """
    return _all_reduce(tensor, group, op, async_op, algorithm, "all_reduce")


def _all_reduce(tensor, group, op, async_op, algorithm, name, post=None, describe=None) -> CommHandle:
    """:func:`all_reduce` logged as ``name``, then ``post`` when it completes; ``describe``: what a failure
    names (default: ``name`` and the tensor)."""
    if group.__class__ is not dist.ProcessGroup:
        group = _check_group(name, group)
    try:  # one test on the hot path; the precise check (and its message) only when it fails
        fine = tensor.is_contiguous() and algorithm in _ALL_REDUCE_ALGORITHMS and (
            op == "sum" or (op == "avg" and tensor.is_floating_point()))  # fmt: skip
    except AttributeError:  # not a tensor
        fine = False
    if not fine:
        _check_tensor(name, group, "tensor", tensor)
        op = _check_op(name, group, op, ("sum", "avg", "max", "min", "product"), tensor)
        _check_algorithm(name, group, algorithm, _ALL_REDUCE_ALGORITHMS)
    if describe is None:
        describe = (name, group, (("tensor", tensor),))
    if op == "avg":
        if _is_nccl(group) and algorithm != "shm":
            rop = dist.ReduceOp.AVG
        else:
            rop = dist.ReduceOp.SUM
            post = _chain(_avg_post(tensor, group.size()), post)
    else:
        rop = _OPS[op]
    if algorithm == "shm" and tensor.numel() and group.size() > 1:
        ch = _started(describe, _alg.shm_channel, group)
        work = ch.submit(ch.all_reduce, tensor, "sum" if op == "avg" else op)
    else:
        work, algorithm = dist.all_reduce(tensor, op=rop, group=group, async_op=True), "native"
    if _logger._ACTIVE:
        return _issue(name, group, work, async_op, tensor, describe, post, "all_reduce", algorithm)
    handle = CommHandle(work, post, describe)
    if async_op:
        return handle
    handle.wait()
    return _DONE


_ALL_REDUCE_ALGORITHMS = ("auto", "native", "shm")


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, group=None, *, async_op: bool = False) -> CommHandle:
    """Equal-split all-to-all: chunk j of rank i's ``input`` lands as chunk i of rank j's ``output``.

    Args:
        output, input: contiguous, the same number of elements, divisible by the group size; same dtype/device.
        group: the process group; None: the default group.
        async_op: return at once; ``output`` is valid after ``wait``.

    Raises:
        ValueError: sizes differ or are not divisible by the group size, dtype/device mismatch, non-contiguous.
    Mirrors ``torch.distributed.all_to_all_single`` with ``output_split_sizes=input_split_sizes=None``.
    """
    return _all_to_all(output, input, group, async_op, "all_to_all_single")


def _all_to_all(output, input, group, async_op, name, post=None) -> CommHandle:
    group = _check_group(name, group)
    _check_pair(name, group, output, input)
    world = group.size()
    if output.numel() != input.numel():
        raise _reject(name, group, f"output has {_shape(output)} but expected {input.numel()} elements like input")
    if input.numel() % world:
        raise _reject(name, group, f"input has {_shape(input)}, not divisible into {world} equal splits")
    describe = (name, group, (("output", output), ("input", input)))
    work = dist.all_to_all_single(output, input, group=group, async_op=True)
    return _issue(name, group, work, async_op, input, describe, post, "all_to_all_single")


def broadcast(tensor: torch.Tensor, src: int, group=None, *, async_op: bool = False) -> CommHandle:
    """Copy ``tensor`` from global rank ``src`` to every rank of ``group`` (in place).

    Args:
        tensor: contiguous; same shape and dtype on every rank.
        src: the source's global rank; must belong to ``group``.
        group: the process group; None: the default group.
        async_op: return at once; ``tensor`` is valid after ``wait``.

    Raises:
        ValueError: non-contiguous tensor or ``src`` not in the group (before communicating).
    Mirrors ``torch.distributed.broadcast``.
    """
    name = "broadcast"
    group = _check_group(name, group)
    _check_tensor(name, group, "tensor", tensor)
    ranks = dist.get_process_group_ranks(group)
    if src not in ranks:
        raise _reject(name, group, f"src must be a global rank in the group {ranks}, got {src}")
    describe = (name, group, (("tensor", tensor),))
    work = dist.broadcast(tensor, src=src, group=group, async_op=True)
    return _issue(name, group, work, async_op, tensor, describe)
