"""Streams for collectives on an accelerator: an all-gather stream and a reduce-scatter stream, joined to the
compute stream by events (PyTorch FSDP2's ``FSDPCommContext`` keeps the same pair for the same reason).

On CUDA a stage-3 gather (copy-in and collective) issued on the all-gather stream runs while the compute stream
keeps computing, and the compute stream waits on the gather's event only where the unit is used, so a prefetched
gather overlaps compute without any host synchronisation. The reducer launches its collectives from the
reduce-scatter stream the same way. On CPU (or any device without streams) every method is a no-op and the same
code runs on the one thread of execution.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

NO_STREAM = nullcontext()
"""What :meth:`CommContext.on` gives without streams: the body runs where it is, with no event (None)."""


class CommContext:
    """The collective streams of one runtime.

    Args:
        device: where the parameters live; streams are made only for ``cuda`` (one pair per context).

    Attributes:
        active: True when streams are in use (CUDA); False: every method is a no-op.
        gather_stream / reduce_stream: the CUDA streams, or None.
    """

    def __init__(self, device: torch.device):
        self.active = device.type == "cuda" and torch.cuda.is_available()
        self.gather_stream = torch.cuda.Stream(device=device) if self.active else None
        self.reduce_stream = torch.cuda.Stream(device=device) if self.active else None

    def on(self, stream):
        """A context that runs its body on ``stream`` (``gather_stream`` or ``reduce_stream``) after the work
        already queued on the current stream (its inputs are written there) and gives the event to wait on for the
        body's results (recorded on exit; None when inactive, where the body runs as it is)."""
        return self._on(stream) if self.active else NO_STREAM

    @contextmanager
    def _on(self, stream):
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        event = torch.cuda.Event()
        with torch.cuda.stream(stream):
            yield event
            event.record(stream)

    def use(self, event, tensor: torch.Tensor | None = None) -> None:
        """The current stream waits for ``event`` (from :meth:`on`), and ``tensor``'s memory, allocated on the
        collective stream, is marked in use by the current stream so the caching allocator cannot hand it to the
        next gather before the compute that reads it has run. No-op when inactive or ``event`` is None."""
        if not self.active or event is None:
            return
        current = torch.cuda.current_stream(tensor.device if tensor is not None else None)
        current.wait_event(event)
        if tensor is not None and tensor.device.type == "cuda":
            tensor.record_stream(current)
