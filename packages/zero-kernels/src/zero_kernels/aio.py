"""Asynchronous reads and writes of tensors to files at offsets: the I/O engine of NVMe offload.

DeepSpeed's DeepNVMe (``aio`` config section; ZeRO-Infinity, Rajbhandari et al. 2021, arXiv 2104.07857, sec. 6.3)
submits libaio requests. Here the C++ op ``aio`` does the same through the kernel's AIO system calls
(``io_submit``/``io_getevents``; no libaio or liburing library or header needed, only the kernel's ``aio_abi.h``):
``thread_count`` submitter threads each keep ``queue_depth`` requests of ``block_size`` bytes in flight, with
``O_DIRECT`` where the filesystem accepts it. Where the kernel refuses AIO contexts (seccomp, ``fs.aio-max-nr``
exhausted) or ``engine="threads"`` is asked for, ``queue_depth x thread_count`` threads issue synchronous
``pread``/``pwrite`` instead (the ``nvme`` section of docs/benchmarks.md compares both with fio). Where the op cannot
be built, a Python thread pool of ``os.pwrite``/``os.preadv`` with the same contract is used.

O_DIRECT needs 4096-byte aligned addresses, offsets and sizes: ``aligned_empty`` gives such buffers, and a chunk
that is not aligned goes through the page cache. Buffers of :data:`HUGE_PAGE_MIN_BYTES` or more are asked for
transparent huge pages (``madvise(MADV_HUGEPAGE)``): each O_DIRECT request pins its buffer's pages, and with 2 MiB
pages that is 512 times fewer pages per request (a 1 GiB write from a 64 MiB buffer: 2.6 -> 4.1 GB/s here). On a
filesystem that refuses O_DIRECT (tmpfs such as /dev/shm) one warning names the folder and all I/O goes through the
page cache.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from zero_kernels import loader

ALIGNMENT = 4096
HUGE_PAGE = 2 << 20  # x86-64 / arm64 transparent huge page size
HUGE_PAGE_MIN_BYTES = 4 << 20  # from here a buffer is mapped on its own and asked for huge pages
_warned_dirs: set[str] = set()


class AioError(OSError):
    """A read or write failed (ENOSPC, EIO, a short read...). The message names file, offset and size."""


@dataclass(frozen=True)
class AioSettings:
    """DeepSpeed's ``aio`` section (same keys and defaults).

    Attributes:
        block_size: bytes per request chunk (a multiple of 4096).
        queue_depth: requests in flight per thread (here: worker threads per ``thread_count``).
        thread_count: parallel threads splitting one request (``intra_op_parallelism`` is the same key).
        single_submit: kernel AIO submits one request per ``io_submit`` call instead of a batch (DeepSpeed's
            meaning); no effect on the thread pool.
        overlap_events: kernel AIO refills the queue as each request completes; False waits for the whole batch
            first (DeepSpeed's meaning); no effect on the thread pool.
        use_direct: open files with O_DIRECT where supported (zero's own key; DeepSpeed always does).
        engine: ``"kernel_aio"`` (the op's default; the thread pool where the kernel refuses AIO contexts) or
            ``"threads"`` (synchronous ``pread``/``pwrite`` from ``queue_depth x thread_count`` threads); zero's own
            key.
    """

    block_size: int = 1_048_576
    queue_depth: int = 8
    thread_count: int = 1
    single_submit: bool = False
    overlap_events: bool = True
    use_direct: bool = True
    engine: str = "kernel_aio"


def _op():
    return loader.resolved("aio")


def _bytes_at(ptr: int, nbytes: int) -> memoryview:
    """A writable byte view of ``nbytes`` of host memory at address ``ptr`` (no numpy: torch does not require it);
    whatever owns the memory must outlive the view."""
    return memoryview((ctypes.c_char * nbytes).from_address(ptr) if nbytes else bytearray()).cast("B")


def aligned_empty(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A 1-D CPU tensor of ``numel`` elements whose address is 4096-byte aligned and whose storage is padded to a
    multiple of 4096 bytes (so whole-buffer O_DIRECT transfers are aligned). Contents uninitialised (zero when
    mapped on its own).

    From :data:`HUGE_PAGE_MIN_BYTES` the buffer is an anonymous mapping of its own, aligned to 2 MiB, its whole
    2 MiB pages advised ``MADV_HUGEPAGE`` (where the kernel offers transparent huge pages: ``always`` or
    ``madvise`` in /sys/kernel/mm/transparent_hugepage/enabled; elsewhere it is an ordinary mapping; a partial
    last page stays in 4 KiB pages, so no more than the buffer becomes resident), unmapped when the tensor is
    freed. Fewer, larger pages make the page pinning of every O_DIRECT request cheaper (module docstring).

    Raises:
        ValueError: ``numel`` < 0.
    """
    if numel < 0:
        raise ValueError(f"aligned_empty: numel must be >= 0, got {numel}")
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    padded = -(-nbytes // ALIGNMENT) * ALIGNMENT
    area = None
    if padded >= HUGE_PAGE_MIN_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        area = mmap.mmap(-1, padded + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        raw = torch.frombuffer(area, dtype=torch.uint8)  # the tensor keeps the mapping alive
        align = HUGE_PAGE
    else:
        raw = torch.empty(padded + ALIGNMENT, dtype=torch.uint8)
        align = ALIGNMENT
    skip = (-raw.data_ptr()) % align
    if area is not None:
        # Advised before any page is touched, so faults take huge pages; only the whole huge pages inside the
        # buffer, so a partial last one stays in 4 KiB pages and nothing past the buffer becomes resident.
        area.madvise(mmap.MADV_HUGEPAGE, skip, padded // HUGE_PAGE * HUGE_PAGE)
    return raw[skip : skip + padded].view(dtype)[:numel]


def supports_direct(folder: str) -> bool:
    """True if files in ``folder`` can be written with O_DIRECT (probed with a temporary file that is removed;
    builds nothing)."""
    path = os.path.join(folder, f".zero_odirect_probe_{os.getpid()}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError:
        return False
    try:
        probe = aligned_empty(ALIGNMENT, torch.uint8)  # held by this name while os.write reads it
        os.write(fd, _bytes_at(probe.data_ptr(), probe.numel()))
        return hasattr(os, "O_DIRECT")
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(path)


class AsyncIO:
    """Submit reads and writes of tensors to files at byte offsets; wait on them.

    Args:
        settings: the ``aio`` section.
        folder: where the files will live; O_DIRECT is probed there once (a refusal warns once, naming it).
        use_op: True = require the C++ op, False = the Python thread pool, None = op if it builds.

    Attributes:
        backend: ``"op"`` (the C++ op) or ``"python"`` (its thread-pool fallback).
        engine: ``"kernel_aio"`` or ``"threads"``: what runs the I/O (the op falls back to threads where the kernel
            refuses AIO contexts; ``fallback_reason`` then says why, else it is empty).
        reads, writes, bytes_read, bytes_written: requests and bytes submitted so far.

    Buffers passed to ``read``/``write`` must stay alive and untouched until ``wait`` returns. Reads and writes of
    one file may overlap; the caller orders conflicting ones (wait for a write before reading the same range back).

    Raises:
        ValueError: bad settings (named by their ``aio.`` key).
        zero_kernels.BuildError: ``use_op=True`` and the op cannot be built.
    """

    def __init__(self, settings: AioSettings | None = None, folder: str | None = None, use_op: bool | None = None):
        s = settings or AioSettings()
        for key in ("block_size", "queue_depth", "thread_count"):
            if getattr(s, key) < 1:
                raise ValueError(f"aio.{key} must be >= 1, got {getattr(s, key)}")
        if s.engine not in ("kernel_aio", "threads"):
            raise ValueError(f"aio.engine must be 'kernel_aio' or 'threads', got {s.engine!r}")
        if s.block_size % ALIGNMENT:
            raise ValueError(f"aio.block_size must be a multiple of {ALIGNMENT} bytes, got {s.block_size}")
        self.settings = s
        direct = s.use_direct
        if direct and folder is not None and not supports_direct(folder):
            direct = False
            if folder not in _warned_dirs:
                _warned_dirs.add(folder)
                msg = (f"aio: {folder!r} does not support O_DIRECT (tmpfs?); file I/O goes through the page cache "
                       "there (slower, and it uses host memory)")  # fmt: skip
                warnings.warn(msg, RuntimeWarning, stacklevel=2)
        self.direct = direct
        op = None if use_op is False else _op()
        if op is None and use_op:
            loader.load("aio")  # raises the BuildError
        self.backend = "op" if op is not None else "python"
        if op is not None:
            self._engine = op.Engine(s.block_size, s.queue_depth, s.thread_count, direct, s.engine == "kernel_aio",
                                     s.single_submit, s.overlap_events)  # fmt: skip
            # "kernel_aio", or "threads" (asked for, or the kernel refused AIO contexts: fallback_reason says why)
            self.engine, self.fallback_reason = self._engine.kind(), self._engine.fallback_reason()
        else:
            self._engine = _PyEngine(s.block_size, s.queue_depth * s.thread_count, direct)
            self.engine, self.fallback_reason = "threads", ""
        self._keep: dict[int, torch.Tensor] = {}
        self.bytes_read = self.bytes_written = 0
        self.reads = self.writes = 0

    def _submit(self, write: bool, tensor: torch.Tensor, path: str, offset: int) -> int:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"aio: buffer for {path!r} must be a contiguous CPU tensor, got {tensor.device}, "
                             f"contiguous={tensor.is_contiguous()}")  # fmt: skip
        if offset < 0:
            raise ValueError(f"aio: offset into {path!r} must be >= 0, got {offset}")
        nbytes = tensor.numel() * tensor.element_size()
        handle = self._engine.submit(write, str(path), tensor.data_ptr(), nbytes, int(offset))
        self._keep[handle] = tensor
        if write:
            self.writes, self.bytes_written = self.writes + 1, self.bytes_written + nbytes
        else:
            self.reads, self.bytes_read = self.reads + 1, self.bytes_read + nbytes
        return handle

    def write(self, tensor: torch.Tensor, path: str, offset: int = 0) -> int:
        """Start writing ``tensor``'s bytes to ``path`` at byte ``offset`` (file created if missing). Returns a
        handle for ``wait``. Raises AioError now if the file cannot be opened."""
        try:
            return self._submit(True, tensor, path, offset)
        except RuntimeError as e:
            raise AioError(str(e)) from None

    def read(self, tensor: torch.Tensor, path: str, offset: int = 0) -> int:
        """Start reading ``tensor.numel()`` elements' bytes from ``path`` at byte ``offset`` into ``tensor``."""
        try:
            return self._submit(False, tensor, path, offset)
        except RuntimeError as e:
            raise AioError(str(e)) from None

    def wait(self, handle: int) -> None:
        """Block until the request finishes. Raises AioError naming file, offset and size on failure (ENOSPC, EIO,
        a short read), never leaving zeros behind silently."""
        try:
            self._engine.wait(handle)
        except RuntimeError as e:
            raise AioError(str(e)) from None
        finally:
            self._keep.pop(handle, None)

    def wait_all(self) -> None:
        """Wait for every outstanding request; raises the first failure after all have finished."""
        first = None
        for h in list(self._keep):
            try:
                self.wait(h)
            except AioError as e:
                first = first or e
        if first is not None:
            raise first

    def inject_error(self, write: bool, err: int = errno.ENOSPC, count: int = 1) -> None:
        """Fault hook for tests: the next ``count`` chunks of writes (or reads) fail with ``err``."""
        self._engine.inject_error(write, err, count)

    def inject_delay(self, write: bool, seconds: float, count: int = 1) -> None:
        """Fault hook for tests: the next ``count`` chunks of writes (or reads) sleep ``seconds`` before their I/O, as
        a slow disk would; shows that callers wait for a request before they use its buffer or file range."""
        self._engine.inject_delay(write, float(seconds), count)

    def close(self) -> None:
        """Wait for outstanding requests (errors included) and stop the workers."""
        try:
            self.wait_all()
        finally:
            self._engine = None


class _PyEngine:
    """The op's contract in Python (os.pwrite/os.preadv in a thread pool): used when the op cannot be built."""

    def __init__(self, block_size: int, workers: int, direct: bool):
        self.block, self.direct = block_size, direct and hasattr(os, "O_DIRECT")
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="zero-aio")
        self.jobs: dict[int, list] = {}
        self.next = 1
        self.faults = {True: [0, 0], False: [0, 0]}
        self.delays = {True: [0.0, 0], False: [0.0, 0]}
        self.lock = threading.Lock()

    def submit(self, write, path, ptr, nbytes, offset):

        flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
        try:
            fds = [os.open(path, flags, 0o644)]
        except OSError as e:
            raise RuntimeError(f"aio: open of '{path}' failed: {e.strerror} (errno {e.errno})") from None
        view = _bytes_at(ptr, nbytes)
        futs = [self.pool.submit(self._chunk, write, fds[0], path, view, s, min(self.block, nbytes - s), offset)
                for s in range(0, nbytes, self.block)]  # fmt: skip
        h, self.next = self.next, self.next + 1
        self.jobs[h] = [futs, fds]
        return h

    def _chunk(self, write, fd, path, view, start, length, offset):
        with self.lock:
            f, d = self.faults[write], self.delays[write]
            fail, delay = f[1] > 0, d[0] if d[1] > 0 else 0.0
            f[1], d[1] = max(0, f[1] - 1), max(0, d[1] - (not fail))
        if fail:
            raise RuntimeError(f"aio: {'write' if write else 'read'} of '{path}' at offset {offset + start}, "
                               f"{length} bytes failed: {os.strerror(f[0])} (errno {f[0]}, injected)")  # fmt: skip
        if delay:
            time.sleep(delay)
        done = 0
        while done < length:
            part = view[start + done : start + length]
            try:
                n = (
                    os.pwrite(fd, part, offset + start + done)
                    if write
                    else os.preadv(fd, [part], offset + start + done)
                )
            except OSError as e:
                raise RuntimeError(f"aio: {'write' if write else 'read'} of '{path}' at offset {offset + start}, "
                                   f"{length} bytes failed: {e.strerror} (errno {e.errno})") from None  # fmt: skip
            if n == 0:
                raise RuntimeError(f"aio: read of '{path}' at offset {offset + start}, {length} bytes failed: short "
                                   f"read: end of file after {done} bytes")  # fmt: skip
            done += n

    def wait(self, h):
        futs, fds = self.jobs.pop(h)
        try:
            # every chunk must finish before the fd is closed and the buffer released: a chunk still running after
            # a sibling's failure would otherwise write through a recycled fd number into another file
            errors = [f.exception() for f in futs]
        finally:
            for fd in fds:
                os.close(fd)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def inject_error(self, write, err, count):
        with self.lock:
            self.faults[write] = [err, count]

    def inject_delay(self, write, seconds, count):
        with self.lock:
            self.delays[write] = [seconds, count]
