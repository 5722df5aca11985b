"""Scratch buffers reused across steps: receive buffers of gloo reduce-scatters, transient gradient buffers.

Why: on CPU a freed block of several MiB goes back to the OS (glibc ``munmap``, or a heap trim), and the next
allocation of the same size faults every page in again (measured: about 2 us per 4 KiB page on this CPU, 10-50 ms
per training step of the 20m Llama). A training step asks for the same sizes every step, so a small pool keyed by
exact size gives the same storage back instead. GPU tensors are never pooled: the caching allocator already
reuses them, and a host-side ``give`` cannot know when a stream has finished with the buffer.
"""

from __future__ import annotations

import torch

# Idle bytes a pool keeps at most (the rest is freed): what a step of the benchmarks' models needs (20m Llama,
# stage 1: one receive buffer per 25 MiB reduction piece), small beside the activations of a step.
DEFAULT_MAX_IDLE_BYTES = 256 * 2**20
DEFAULT_PER_KEY = 4


class BufferPool:
    """Flat CPU buffers handed out by exact (element count, dtype) and taken back when the caller is done.

    Args:
        max_idle_bytes: most bytes held while not handed out; a buffer given back past it is dropped.
        per_key: most idle buffers kept for one (element count, dtype).

    Attributes:
        allocated / reused: buffers newly allocated / handed out again by ``take`` (tests read them).
    """

    def __init__(self, max_idle_bytes: int = DEFAULT_MAX_IDLE_BYTES, per_key: int = DEFAULT_PER_KEY):
        if max_idle_bytes < 0 or per_key < 0:
            raise ValueError(f"BufferPool: max_idle_bytes ({max_idle_bytes}) and per_key ({per_key}) must be >= 0")
        self.max_idle_bytes, self.per_key = max_idle_bytes, per_key
        self._idle: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self.idle_bytes = 0
        self.allocated = self.reused = 0

    def take(self, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """A contiguous 1-D tensor of ``numel`` elements of ``dtype`` on ``device`` with undefined values (as
        ``torch.empty``); on CPU an idle buffer of that exact size when there is one."""
        device = torch.device(device)
        if device.type == "cpu":
            idle = self._idle.get((numel, dtype))
            if idle:
                buf = idle.pop()
                self.idle_bytes -= buf.numel() * buf.element_size()
                self.reused += 1
                return buf
            self.allocated += 1
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, buf: torch.Tensor) -> None:
        """Take back ``buf`` (from ``take``; the caller and every collective are done with it). Non-CPU tensors and
        buffers past the limits are simply dropped."""
        if buf.device.type != "cpu" or buf.dim() != 1 or not buf.is_contiguous() or buf.storage_offset():
            return
        nbytes = buf.numel() * buf.element_size()
        idle = self._idle.setdefault((buf.numel(), buf.dtype), [])
        if len(idle) >= self.per_key or self.idle_bytes + nbytes > self.max_idle_bytes:
            return
        for b in idle:
            if b is buf:
                return  # given back twice: keep one entry, so it is never handed out to two callers
        idle.append(buf)
        self.idle_bytes += nbytes

    def clear(self) -> None:
        """Drop every idle buffer."""
        self._idle.clear()
        self.idle_bytes = 0


# The process's pool: zero_comm's reduce-scatters and zero_core's gradient reduction take their scratch from it.
scratch = BufferPool()
