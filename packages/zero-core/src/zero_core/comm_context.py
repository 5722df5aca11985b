"""Side streams on an accelerator: an all-gather stream, a reduce-scatter stream and a copy stream for offloaded
state, joined to the compute stream by events (PyTorch FSDP2's ``FSDPCommContext`` keeps the same pair of collective
streams for the same reason).

On CUDA a stage-3 gather (copy-in and collective) issued on the all-gather stream runs while the compute stream
keeps computing, and the compute stream waits on the gather's event only where the unit is used, so a prefetched
gather overlaps compute without any host synchronisation. The reducer launches its collectives from the
reduce-scatter stream the same way, and the compute stream waits on a reduction's event where its result is used
(:class:`StreamJoin`). An offloaded optimizer's gradients land on the copy stream ordered after their reduction alone
(:meth:`CommContext.after`) and are copied to host memory there; the host thread that steps them waits for that
copy's event only (:meth:`CommContext.wait_host`). On CPU (or any device
without streams) every method is a no-op and the same code runs on the one thread of execution.

Every stream and event call goes through a :class:`StreamOps`: :class:`CudaStreams` on CUDA; a stand-in that runs
on CPU and records the calls (``zero_core.stream_record.RecordedStreams``, handed to ``ZeroRuntime(streams=...)``)
shows a test the schedule: which copy is issued on which stream, before which kernel, and where anything waits.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Protocol

import torch

NO_STREAM = nullcontext()
"""What :meth:`CommContext.on` gives without streams: the body runs where it is, with no event (None)."""


class StreamOps(Protocol):
    """The stream and event calls of one device (``torch.cuda``'s, by :class:`CudaStreams`). Streams and events are
    opaque to the callers: what :meth:`new_stream` / :meth:`current` / :meth:`new_event` return."""

    def new_stream(self, name: str) -> Any:
        """A new side stream (``name``: what it is for: "gather", "reduce", "copy")."""
        ...

    def current(self) -> Any:
        """The stream work is issued on now, by this thread."""
        ...

    def issue_on(self, stream: Any) -> AbstractContextManager:
        """A context inside which this thread issues its work on ``stream``."""
        ...

    def wait_stream(self, waiter: Any, stream: Any) -> None:
        """Work issued on ``waiter`` from now on runs after the work queued on ``stream`` so far."""
        ...

    def new_event(self) -> Any:
        """A new event, not recorded yet."""
        ...

    def record(self, event: Any, stream: Any) -> None:
        """``event`` completes once the work queued on ``stream`` so far has run."""
        ...

    def wait_event(self, waiter: Any, event: Any) -> None:
        """Work issued on ``waiter`` from now on runs after ``event`` (no host synchronisation)."""
        ...

    def host_wait(self, event: Any) -> None:
        """The calling thread blocks until ``event`` has completed."""
        ...

    def done(self, event: Any) -> bool:
        """Whether ``event`` has completed (never blocks)."""
        ...

    def keep_for(self, tensor: torch.Tensor, stream: Any) -> None:
        """``tensor``'s memory is in use by ``stream``: the caching allocator hands it out again only after the
        work queued there so far (``Tensor.record_stream``)."""
        ...


class CudaStreams:
    """:class:`StreamOps` of one CUDA device: ``torch.cuda``'s streams and events.

    Args:
        device: the CUDA device.
    """

    def __init__(self, device: torch.device):
        self.device = device

    def new_stream(self, name: str) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.device)

    def current(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def issue_on(self, stream: torch.cuda.Stream) -> AbstractContextManager:
        return torch.cuda.stream(stream)

    def wait_stream(self, waiter: torch.cuda.Stream, stream: torch.cuda.Stream) -> None:
        waiter.wait_stream(stream)

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def record(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        event.record(stream)

    def wait_event(self, waiter: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        waiter.wait_event(event)

    def host_wait(self, event: torch.cuda.Event) -> None:
        event.synchronize()  # releases the GIL while it waits

    def done(self, event: torch.cuda.Event) -> bool:
        return event.query()

    def keep_for(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        if tensor.device.type == "cuda":
            tensor.record_stream(stream)


class CommContext:
    """The side streams of one runtime.

    Args:
        device: where the parameters live; streams are made for ``cuda`` (one set per context).
        streams: the stream and event calls to use (e.g. ``zero_core.stream_record.RecordedStreams`` on CPU, to
            record the schedule); None: :class:`CudaStreams` on a CUDA device, none elsewhere.

    Attributes:
        active: True when streams are in use; False: every method is a no-op.
        streams: the :class:`StreamOps` in use, or None.
        gather_stream / reduce_stream: the collective streams, or None.
        copy_stream: the stream of host<->device copies of offloaded state (reduced gradients to host memory), or
            None.
    """

    def __init__(self, device: torch.device, streams: StreamOps | None = None):
        if streams is None and device.type == "cuda" and torch.cuda.is_available():
            streams = CudaStreams(device)
        self.streams = streams
        self.active = streams is not None
        self.gather_stream = streams.new_stream("gather") if streams is not None else None
        self.reduce_stream = streams.new_stream("reduce") if streams is not None else None
        self.copy_stream = streams.new_stream("copy") if streams is not None else None

    def on(self, stream):
        """A context that runs its body on ``stream`` (``gather_stream``, ``reduce_stream`` or ``copy_stream``)
        after the work already queued on the current stream (its inputs are written there) and gives the event to
        wait on for the body's results (recorded on exit; None when inactive, where the body runs as it is)."""
        return self._on(stream) if self.active else NO_STREAM

    @contextmanager
    def _on(self, stream):
        ops = self.streams
        ops.wait_stream(stream, ops.current())
        event = ops.new_event()
        with ops.issue_on(stream):
            yield event
            ops.record(event, stream)

    def after(self, join: StreamJoin):
        """A context that runs its body on ``copy_stream`` after ``join``'s collective and its side stream's work
        only (not after the compute stream: backward goes on meanwhile) and gives the event to wait on for the
        body's results (None when inactive, where the body runs as it is)."""
        return self._after(join) if self.active else NO_STREAM

    @contextmanager
    def _after(self, join: StreamJoin):
        ops, stream = self.streams, self.copy_stream
        event = ops.new_event()
        with ops.issue_on(stream):
            join.wait()  # the copy stream (current here) waits for the collective and the side stream's event
            yield event
            ops.record(event, stream)

    def issuing_on(self, stream):
        """A context inside which work is issued on ``stream`` as it comes, with no wait and no event (what is
        issued there is ordered after that stream's earlier work only); NO_STREAM when inactive."""
        return self.streams.issue_on(stream) if self.active else NO_STREAM

    def use(self, event, tensor: torch.Tensor | None = None) -> None:
        """The current stream waits for ``event`` (from :meth:`on`), and ``tensor``'s memory, allocated on the
        side stream, is marked in use by the current stream so the caching allocator cannot hand it to the
        next gather before the compute that reads it has run. No-op when inactive or ``event`` is None."""
        if not self.active or event is None:
            return
        ops = self.streams
        current = ops.current()
        ops.wait_event(current, event)
        if tensor is not None:
            ops.keep_for(tensor, current)

    def wait_host(self, event) -> None:
        """The calling thread blocks until ``event`` (from :meth:`on`) has completed: a host thread about to read
        what a copy to host memory wrote. No-op when inactive or ``event`` is None."""
        if self.active and event is not None:
            self.streams.host_wait(event)

    def done(self, event) -> bool:
        """Whether the work before ``event`` (from :meth:`on`) has run (never blocks); True when inactive or
        ``event`` is None."""
        return not self.active or event is None or self.streams.done(event)


class StreamJoin:
    """A collective's handle (``wait()``, ``ready()``) whose work was issued on a side stream (``on()`` gave
    ``event``): :meth:`wait` also makes the current stream wait for that stream's part (a group of one copies
    there instead of launching a collective, and its handle is complete at once), and :meth:`ready` also asks the
    event, so a send buffer goes back to a pool only once the side stream has read it.

    Args:
        handle: the collective's handle (``zero_comm.CommHandle``).
        event: the event ``CommContext.on`` gave for the side stream's work.
        comm: the context that made it.
    """

    __slots__ = ("handle", "event", "comm")

    def __init__(self, handle, event, comm: CommContext) -> None:
        self.handle, self.event, self.comm = handle, event, comm

    def wait(self) -> None:
        """Wait for the collective (as the handle does), then join the side stream's work to the current stream."""
        self.handle.wait()
        self.comm.use(self.event)

    def ready(self) -> bool:
        """The collective and the side stream's work have both completed (never blocks)."""
        return self.handle.ready() and self.comm.done(self.event)
