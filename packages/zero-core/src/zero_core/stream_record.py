"""A CPU stand-in for an accelerator's streams that records the schedule (for tests).

What overlaps what on a GPU is decided on the host: which stream each copy and collective is issued on, where a
stream waits for another, where the host thread waits. :class:`RecordedStreams` implements
``zero_core.comm_context.StreamOps``; handed to ``ZeroRuntime(streams=...)`` on CPU it runs every piece of work
where it is (CPU work is synchronous) and logs each stream call in order, and inside :meth:`RecordedStreams.ops` it
also logs every tensor copy and matrix multiply (the "kernels") with the stream it was issued on. A test then
asserts the order itself, e.g. that unit k+1's host-to-device copy is issued on the gather stream before unit k's
forward multiplies and that no host wait follows it, without a GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Copy", "Entry", "RecordedStreams"]

_aten = torch.ops.aten
_KERNELS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}


@dataclass(frozen=True)
class Copy:
    """A ``Tensor.copy_``: the storages it wrote and read (``untyped_storage().data_ptr()``, so any view of a buffer
    is recognised by its buffer) and whether it was asked not to block the host."""

    dst: int
    src: int
    non_blocking: bool


@dataclass(frozen=True)
class Entry:
    """One logged event, in issue order.

    Attributes:
        kind: "wait_stream", "record", "wait_event", "host_wait", "copy", "kernel" or "mark".
        stream: the stream it was issued on ("compute", "gather", "reduce", "copy"); for the waits, the stream that
            waits; for "host_wait", the stream of the event the host waited for.
        what: "wait_stream": the stream waited for; "record" / "wait_event" / "host_wait": the event's number;
            "copy": a :class:`Copy`; "kernel": the aten op's name; "mark": the test's label.
        main: issued by the thread that made the recorder (False: another thread, e.g. SuperOffload's worker).
    """

    kind: str
    stream: str
    what: Any
    main: bool


class RecordedStream:
    """A stream of the recorder: only its name."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


class RecordedEvent:
    """An event of the recorder: its number (in creation order) and the stream it was recorded on."""

    __slots__ = ("number", "stream")

    def __init__(self, number: int):
        self.number = number
        self.stream = ""  # set by record()


class _Current(threading.local):
    """Per thread (as CUDA's current stream): the stream work is issued on, None for the compute stream."""

    def __init__(self):
        self.stream: RecordedStream | None = None


class RecordedStreams:
    """``zero_core.comm_context.StreamOps`` on CPU: every call runs at once and is logged (see the module
    docstring).

    Attributes:
        log: the entries, in issue order (:class:`Entry`).
        compute: the compute stream (the current stream outside ``issue_on``).
    """

    def __init__(self):
        self.log: list[Entry] = []
        self.compute = RecordedStream("compute")
        self._current = _Current()
        self._events = 0  # events made so far (the next one's number)
        self._main = threading.get_ident()  # the thread whose entries are ``main``

    # ---------------------------------------------------------------- StreamOps
    def new_stream(self, name: str) -> RecordedStream:
        return RecordedStream(name)

    def current(self) -> RecordedStream:
        return self._current.stream or self.compute

    @contextmanager
    def issue_on(self, stream: RecordedStream) -> Iterator[None]:
        saved, self._current.stream = self._current.stream, stream
        try:
            yield
        finally:
            self._current.stream = saved

    def wait_stream(self, waiter: RecordedStream, stream: RecordedStream) -> None:
        self._add("wait_stream", waiter.name, stream.name)

    def new_event(self) -> RecordedEvent:
        self._events += 1
        return RecordedEvent(self._events)

    def record(self, event: RecordedEvent, stream: RecordedStream) -> None:
        event.stream = stream.name
        self._add("record", stream.name, event.number)

    def wait_event(self, waiter: RecordedStream, event: RecordedEvent) -> None:
        self._add("wait_event", waiter.name, event.number)

    def host_wait(self, event: RecordedEvent) -> None:
        self._add("host_wait", event.stream, event.number)

    def done(self, event: RecordedEvent) -> bool:
        """True: the work before any event has run (CPU work is synchronous)."""
        return True

    def keep_for(self, tensor: torch.Tensor, stream: RecordedStream) -> None:
        """Nothing: no caching allocator on CPU."""

    # ---------------------------------------------------------------- what a test adds
    def mark(self, label: Any) -> None:
        """Log ``label`` (e.g. "forward of layer 2", from a module hook) on the current stream."""
        self._add("mark", self.current().name, label)

    @contextmanager
    def ops(self) -> Iterator[None]:
        """Inside it, every ``copy_`` and matrix multiply this thread issues (autograd's backward included) is
        logged too, with its stream."""
        with _OpLog(self):
            yield

    def entries(self, kind: str) -> list[tuple[int, Entry]]:
        """``(position in the log, entry)`` of every entry of ``kind``."""
        return [(i, e) for i, e in enumerate(self.log) if e.kind == kind]

    def joined(self, pos: int) -> tuple[int, int] | None:
        """Where the work logged at ``pos`` (on a side stream) is waited for: ``(position of the next event recorded
        on its stream, position of the first wait for that event: a stream's "wait_event" or a "host_wait")``;
        None when no event is recorded after it or nothing waits for it."""
        log, stream = self.log, self.log[pos].stream
        rec = next((i for i in range(pos + 1, len(log)) if log[i].kind == "record" and log[i].stream == stream), None)
        if rec is None:
            return None
        number = log[rec].what
        wait = next((i for i in range(rec + 1, len(log))
                     if log[i].kind in ("wait_event", "host_wait") and log[i].what == number), None)  # fmt: skip
        return None if wait is None else (rec, wait)

    def _add(self, kind: str, stream: str, what: Any) -> None:
        self.log.append(Entry(kind, stream, what, threading.get_ident() == self._main))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _OpLog(TorchDispatchMode):
    """Logs copies and matrix multiplies into a :class:`RecordedStreams` with its current stream."""

    def __init__(self, streams: RecordedStreams):
        super().__init__()
        self.streams = streams

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten.copy_.default:
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            streams = self.streams
            streams._add("copy", streams.current().name, Copy(_storage(args[0]), _storage(args[1]), not blocking))
        elif func in _KERNELS:
            streams = self.streams
            streams._add("kernel", streams.current().name, func.__name__)
        return func(*args, **kwargs)
