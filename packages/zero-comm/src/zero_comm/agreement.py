"""Agree across a process group on whether a step succeeded, so that an error on one rank is an error on all.

A collective operation (a checkpoint save or load, building an engine, partitioning a model) often starts with work
that only one rank does or that can fail on one rank only: encode the user's state, create a directory, read a
file. If that rank raises while its peers go on into the next collective, the peers block until the process
group's timeout (Lightning #6430, DeepSpeed #636). :func:`agree` closes that gap with one small collective: every
rank contributes "ok" or its error (type and message, at most :data:`MESSAGE_BYTES` bytes of UTF-8), all ranks learn
every outcome, and if any rank failed every rank raises the same :class:`GroupOperationError` naming the first
failing rank and its error. :func:`same_outcome` wraps a block of local work in it.

Rules for callers: the wrapped work must not itself issue collectives on the group (a rank that fails before such a
collective would leave its peers in it); every rank of the group must reach the agreement (it is a collective).

The raised error is an instance of :class:`GroupOperationError` and, when the failing rank's exception class can be
imported on this rank and built from a message, also of that class (``except CheckpointError`` keeps working on
every rank). Without an initialised process group, or in a group of one, the local error is raised unchanged.
"""

from __future__ import annotations

import importlib
import time
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

MESSAGE_BYTES = 1024
"""Bytes per rank in the agreement buffer (status byte included); longer messages are cut."""

_ARRIVED_KEY = "zero_comm/agree/"
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch renamed it
_sequence: dict[str, int] = {}
_classes: dict[type, type] = {}


class GroupOperationError(RuntimeError):
    """An operation failed on at least one rank; every rank of the group raises this with the same message.

    Attributes: ``operation`` (its name), ``failures`` (``{rank: "module.Type: message"}``, group ranks, every
    failing rank), ``rank`` (the first failing rank), ``error_type`` (its exception's ``module.qualname``).
    """

    def __init__(self, operation: str, failures: dict[int, str]):
        first = min(failures)
        self.operation = operation
        self.failures = dict(failures)
        self.rank = first
        self.error_type = failures[first].split(":", 1)[0]
        others = sorted(r for r in failures if r != first)
        also = f" (also failed on ranks {others})" if others else ""
        super().__init__(f"{operation} failed on rank {first}: {failures[first]}{also}; every rank raised this error")

    def __reduce__(self):
        # the class that is also the failing error's is built at run time: pickle rebuilds it from the failures
        # (multiprocessing pools and launchers pickle the error to report it)
        return _rebuild, (self.operation, self.failures, type(self) is not GroupOperationError)


class AgreementTimeout(GroupOperationError, TimeoutError):
    """Some ranks did not reach the agreement in time; ``missing`` lists them (group ranks) when the store knows."""

    def __init__(self, operation: str, timeout: float, missing: list[int] | None):
        self.missing = missing
        self.timeout = timeout
        who = f"ranks {missing} did not arrive" if missing else "not every rank arrived"
        super().__init__(operation, {-1: f"TimeoutError: agreement not reached within {timeout:.1f} s: {who}"})
        self.rank = missing[0] if missing else -1

    def __reduce__(self):
        return AgreementTimeout, (self.operation, self.timeout, self.missing)


def _describe(error: BaseException) -> str:
    cls = type(error)
    text = str(error).strip().replace("\n", " ")
    return f"{cls.__module__}.{cls.__qualname__}: {text}"


def _encode(error: BaseException | None) -> torch.Tensor:
    buf = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
    if error is not None:
        data = _describe(error).encode("utf-8")[: MESSAGE_BYTES - 1]
        buf[0] = 1
        buf[1 : 1 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf


def _decode(row: torch.Tensor) -> str | None:
    if int(row[0]) == 0:
        return None
    data = bytes(row[1:].tolist()).rstrip(b"\0")
    return data.decode("utf-8", errors="replace")


def _typed(operation: str, failures: dict[int, str]) -> GroupOperationError:
    """The group error, also an instance of the first failure's class when that class can be rebuilt here."""
    plain = GroupOperationError(operation, failures)
    module, _, qualname = plain.error_type.rpartition(".")
    try:
        cls = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
    except (ImportError, AttributeError, ValueError):
        return plain
    if not (isinstance(cls, type) and issubclass(cls, Exception)) or issubclass(cls, GroupOperationError):
        return plain
    try:
        typed = _classes.get(cls)
        if typed is None:
            # __reduce__ named here: a failing class of its own defining one would come first in the MRO
            typed = type(cls.__name__, (cls, GroupOperationError),
                         {"__module__": __name__, "__reduce__": GroupOperationError.__reduce__})  # fmt: skip
            _classes[cls] = typed
        err = typed.__new__(typed, str(plain))
        GroupOperationError.__init__(err, operation, failures)
        return err
    except TypeError:  # a layout conflict between the two bases: the plain error still says everything
        return plain


def _rebuild(operation: str, failures: dict[int, str], typed: bool) -> GroupOperationError:
    """Unpickle a :class:`GroupOperationError` (also of the failing error's class when it was)."""
    return _typed(operation, failures) if typed else GroupOperationError(operation, failures)


def _group_info(group):
    group = group if group is not None else dist.group.WORLD
    return group, dist.get_world_size(group), dist.get_rank(group)


def agree(operation: str, error: BaseException | None = None, group=None, timeout: float | None = None) -> None:
    """Collective: return if no rank of ``group`` failed; else raise the same error on every rank.

    Args:
        operation: a name for messages and for the store keys, e.g. ``"save_checkpoint"``.
        error: this rank's exception, or None when its part succeeded.
        group: the process group (None: the default group).
        timeout: seconds to wait for the other ranks (None: the process group's timeout).

    Raises:
        GroupOperationError: some rank passed an error (also an instance of its class when possible); on the
            failing rank its ``__cause__`` is the original exception.
        AgreementTimeout: not every rank arrived in time; names the missing ranks.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if error is not None:
            raise error
        return
    group, world, rank = _group_info(group)
    if world == 1:
        if error is not None:
            raise error
        return
    ranks = dist.get_process_group_ranks(group)
    seq_key = f"{operation}/{','.join(map(str, ranks))}"
    seq = _sequence.get(seq_key, 0)
    _sequence[seq_key] = seq + 1
    arrived = f"{_ARRIVED_KEY}{seq_key}/{seq}/"
    store = _store()
    if store is not None:
        store.set(arrived + str(rank), "1")
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    mine = _encode(error).to(device)
    out = torch.empty(world * MESSAGE_BYTES, dtype=torch.uint8, device=device)
    work = _ALL_GATHER(out, mine, group=group, async_op=True)
    start = time.monotonic()
    try:
        work.wait() if timeout is None else work.wait(timedelta(seconds=timeout))
    except RuntimeError as exc:
        waited = time.monotonic() - start
        missing = None
        if store is not None:
            try:
                missing = [r for r in range(world) if not store.check([arrived + str(r)])]
            except Exception:  # noqa: BLE001 - the timeout stands without the names
                missing = None
        raise AgreementTimeout(operation, timeout if timeout is not None else waited, missing) from exc
    if store is not None:
        try:
            store.delete_key(arrived + str(rank))  # every rank arrived: the key is no longer needed
        except Exception:  # noqa: BLE001 - a leftover key is harmless
            pass
    rows = out.cpu().view(world, MESSAGE_BYTES)
    failures = {r: msg for r in range(world) if (msg := _decode(rows[r])) is not None}
    if failures:
        raise _typed(operation, failures) from error
    if error is not None:  # cannot happen: this rank's own error is in the buffer
        raise error


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - without a store a timeout cannot name the missing ranks
        return None


@contextmanager
def same_outcome(operation: str, group=None, timeout: float | None = None):
    """Context manager: run a block of local work, then :func:`agree` on its outcome (collective on exit).

    An exception in the block is caught and handed to the agreement, so every rank raises the same error; without
    one, every rank learns whether a peer failed. The block must not issue collectives on ``group``.

    Example::

        with same_outcome("save_checkpoint", group):
            encoded = encode(client_state)   # may fail on one rank only
        dist.broadcast(...)                  # reached by every rank, or by none
    """
    error = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - handed to every rank by agree()
        error = e
    agree(operation, error, group, timeout)
