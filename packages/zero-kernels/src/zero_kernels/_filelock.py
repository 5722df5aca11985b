"""An exclusive inter-process lock that cannot outlive its owner, with a bounded wait.

``fcntl.flock`` locks belong to the open file description, so the kernel drops them when the owning process dies,
however it dies (SIGKILL included). A lock file left on disk by a killed builder is therefore never "held": the next
process takes it at once. This is the fault DeepSpeed and ``torch.utils.cpp_extension`` have: their lock is the mere
existence of a file, so a killed builder leaves later runs waiting forever. The owner's pid is written into the file
only so that a bounded wait can say who holds it.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path


class LockTimeout(TimeoutError):
    """The lock stayed held by a live process for longer than the bound. ``path`` names the lock file."""

    def __init__(self, path: Path, timeout: float, holder: str):
        self.path = path
        super().__init__(
            f"zero_kernels: waited {timeout:.0f} s for the build lock {path} (held by {holder}); "
            f"that process is alive but has not finished. Kill it, or raise ZERO_KERNELS_LOCK_TIMEOUT (seconds)."
        )


class FileLock:
    """``with FileLock(path, timeout):`` holds an exclusive ``flock`` on ``path`` (created if missing).

    Args:
        path: the lock file. Its content is the holder's pid (informational only).
        timeout: seconds to wait for a live holder before raising :class:`LockTimeout`.
        on_wait: called once, with the holder's description, if the lock is busy on the first try.
    """

    def __init__(self, path: Path, timeout: float, on_wait=None):
        self.path = Path(path)
        self.timeout = timeout
        self.on_wait = on_wait
        self._fd: int | None = None

    def _holder(self) -> str:
        try:
            text = self.path.read_text().strip()
        except OSError:
            text = ""
        return f"pid {text}" if text else "an unknown process"

    def __enter__(self) -> FileLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.timeout
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not told and self.on_wait is not None:
                    self.on_wait(self._holder())
                told = True
                if time.monotonic() >= deadline:
                    holder = self._holder()
                    os.close(fd)
                    raise LockTimeout(self.path, self.timeout, holder) from None
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
