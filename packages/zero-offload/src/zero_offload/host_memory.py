"""Host buffers for offloaded state: page-locked where the accelerator allows it, pageable otherwise.

``pin_memory: true`` is in most DeepSpeed users' offload configs, but ``Tensor.pin_memory()`` raises on CPU-only
torch ("Cannot access accelerator device when none is available") and fails under a tight locked-memory limit
(``ulimit -l``). So pinning is a wish. Without an accelerator there are no host<->device copies for pinning to
speed up: buffers are pageable and nothing is said (DeepSpeed's CPU accelerator pins nothing either). With one,
when pinning fails, one warning names the config key and the buffers fall back to pageable memory.
"""

from __future__ import annotations

import warnings

import torch

from zero_kernels import empty_hugepage

_warned: set[str] = set()


def can_pin() -> bool:
    """True when page-locked host memory is available: an accelerator is present (CUDA here)."""
    return torch.cuda.is_available()


def host_empty(numel: int, dtype: torch.dtype, *, pin_memory: bool, key: str) -> torch.Tensor:
    """A new uninitialised 1-D host tensor of ``numel`` elements of ``dtype``.

    Args:
        numel: elements (>= 0).
        dtype: element type.
        pin_memory: ask for page-locked memory (faster, asynchronous host<->device copies).
        key: the config key that asked for pinning (e.g. ``zero_optimization.offload_optimizer.pin_memory``),
            named in the warning when pinning fails on a machine with an accelerator.

    Returns:
        A pinned tensor when ``pin_memory`` and pinning works; else a pageable tensor advised for huge pages (the
        optimizer walks these buffers end to end: see ``zero_kernels.memory``).

    Raises:
        ValueError: ``numel`` < 0.
    """
    if numel < 0:
        raise ValueError(f"host_empty: numel must be >= 0, got {numel}")
    if pin_memory and can_pin():
        try:
            return torch.empty(numel, dtype=dtype, pin_memory=True)
        except RuntimeError as e:  # locked-memory limit, driver refusal
            reason = str(e).splitlines()[0]
        warn_once(key, f"{key}=true: cannot pin host memory ({reason}); using pageable memory instead")
    return empty_hugepage(numel, dtype)


def warn_once(key: str, message: str) -> None:
    """Warn ``message`` the first time ``key`` is seen in this process (re-created engines warn once, not N times)."""
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


MMAP_THRESHOLD = 128 << 10  # bytes: glibc's own starting value, pinned (see ``return_freed_memory``)


def return_freed_memory(threshold: int = MMAP_THRESHOLD) -> bool:
    """Make glibc serve allocations of ``threshold`` bytes and more with their own mappings, returned to the OS
    when freed (``mallopt(M_MMAP_THRESHOLD)``, the same as ``MALLOC_MMAP_THRESHOLD_``). glibc's default starts at
    128 KiB but raises this threshold each time such a block is freed (up to 32 MiB), so stage 3's unit buffers and
    gradients (megabytes, freed every unit) end up in the heap and the process keeps the memory of every unit it
    ever held. Activations are smaller (a 127-token micro-batch: 0.3-0.8 MiB per tensor) and, served from the
    heap, fragment it: measured on Llama 60m with NVMe offload (benchmarks/bench_nvme_rss.py), a 1 MiB threshold
    left 114-165 MiB free but resident in the heap after each step and the peak grew step by step; 128 KiB keeps
    the heap's free part at ~3 MiB and the resident memory flat between steps. Cost: one mmap/munmap and fresh
    page faults per large tensor (milliseconds per step here). Returns False where glibc is absent.

    Args:
        threshold: bytes (> 0).
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return bool(libc is not None and libc.mallopt(-3, int(threshold)))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def keep_no_idle_scratch() -> None:
    """Let ``zero_comm.buffers.scratch`` keep no idle buffer: under NVMe offload the peak resident memory must
    follow the swap buffers and one unit (the NVMe memory formula), and buffers parked in the pool for reuse (gradient
    pieces, receive buffers: a unit's size each) would add to it. Every buffer is still taken from and given back to
    the pool; one given back is freed at once (glibc returns it, ``return_freed_memory``). Process-wide, as mallopt."""
    from zero_comm.buffers import scratch

    scratch.max_idle_bytes = 0
    scratch.clear()
