"""Per-rank memory report: model-state bytes by category, peak RSS on CPU, allocated bytes on GPU.

Mirrors what DeepSpeed's ``memory_breakdown`` prints (``see_memory_usage``: allocated/peak on the accelerator,
the process's memory on the host), with the model states split the way ZeRO's paper counts them: parameters,
gradients, fp32 master weights and optimizer state (section 3.1), plus buffers.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

CATEGORIES = ("parameters", "gradients", "master_weights", "optimizer_state", "buffers")


@dataclass(frozen=True)
class MemoryReport:
    """Bytes held by this rank (every field in bytes; ``None`` where the platform has no such figure).

    ``sources`` says, per model-state category, whether the figure was ``"given"`` by the caller or
    ``"introspected"`` from the module and optimizer. ``peak_rss``/``current_rss``: this process's resident set
    (``/proc/self/status`` VmHWM/VmRSS, else ``getrusage``). ``gpu_*``: ``torch.cuda`` counters of the current
    device, ``None`` when CUDA is not initialised.
    """

    parameters: int
    gradients: int
    master_weights: int
    optimizer_state: int
    buffers: int
    peak_rss: int | None
    current_rss: int | None
    gpu_allocated: int | None = None
    gpu_peak_allocated: int | None = None
    gpu_reserved: int | None = None
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def model_states(self) -> int:
        """Sum of the five model-state categories, bytes."""
        return sum(getattr(self, c) for c in CATEGORIES)

    def to_dict(self) -> dict:
        """JSON-ready dict of every field plus ``model_states``."""
        return {**asdict(self), "model_states": self.model_states}

    def format(self) -> str:
        """One readable line, MiB with two decimals."""
        parts = [f"{c.replace('_', ' ')} {_mib(getattr(self, c))}" for c in CATEGORIES]
        parts.append(f"model states {_mib(self.model_states)}")
        parts.append(f"peak RSS {_mib(self.peak_rss)} (now {_mib(self.current_rss)})")
        if self.gpu_allocated is not None:
            parts.append(
                f"GPU allocated {_mib(self.gpu_allocated)} (peak {_mib(self.gpu_peak_allocated)}, "
                f"reserved {_mib(self.gpu_reserved)})"
            )
        return "memory: " + " | ".join(parts)


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.2f} MiB"


def _bytes(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _proc_status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


_peak_seen = 0


def rss_bytes() -> tuple[int | None, int | None]:
    """(peak, current) resident set size of this process in bytes; current is ``None`` without ``/proc``.

    The kernel's high-water mark is updated lazily and was seen to read a little lower after a large free, so the
    peak returned never falls below the highest peak or current value returned before.
    """
    global _peak_seen
    peak_kib, now_kib = _proc_status_kib("VmHWM"), _proc_status_kib("VmRSS")
    if peak_kib is not None:
        peak, now = peak_kib * 1024, None if now_kib is None else now_kib * 1024
    else:
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak, now = (maxrss if sys.platform == "darwin" else maxrss * 1024), None  # macOS: bytes, Linux: KiB
    _peak_seen = max(_peak_seen, peak, now or 0)
    return _peak_seen, now


def _introspect(model: nn.Module | None, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    seen: set[int] = set()
    model_params = list(model.parameters()) if model is not None else []
    model_ids = {id(p) for p in model_params}
    figures = dict.fromkeys(CATEGORIES, 0)
    figures["parameters"] = _bytes(model_params, seen)
    figures["gradients"] = _bytes((p.grad for p in model_params if p.grad is not None), seen)
    if model is not None:
        figures["buffers"] = _bytes(model.buffers(), seen)
    if optimizer is not None:
        opt_params = [p for g in optimizer.param_groups for p in g["params"]]
        # Optimizer parameters that are not the model's are master copies (e.g. fp32 next to bf16 weights).
        masters = [p for p in opt_params if id(p) not in model_ids]
        key = "master_weights" if model is not None else "parameters"
        figures[key] += _bytes(masters, seen)
        figures["gradients"] += _bytes((p.grad for p in masters if p.grad is not None), seen)
        state = (v for per_param in optimizer.state.values() for v in per_param.values())
        figures["optimizer_state"] = _bytes(state, seen)
    return figures


def memory_report(
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    known: Mapping[str, int] | None = None,
    reset_gpu_peak: bool = False,
) -> MemoryReport:
    """This rank's memory: model states by category (bytes), peak and current RSS, GPU allocated/peak/reserved.

    ``known`` gives the categories the caller can count better than introspection (a ZeRO engine passes its
    sharded flat buffers' bytes, e.g. zero_core's ``model_state_bytes``); keys from :data:`CATEGORIES`, values
    non-negative ints in bytes. Every other category is introspected from plain torch objects: parameters,
    gradients and buffers of ``model``; master weights = optimizer parameters that are not ``model``'s; optimizer
    state = every tensor in ``optimizer.state``. A tensor is counted once (by identity) across categories.
    ``reset_gpu_peak`` resets CUDA's peak counter after reading it (per-step peaks, as DeepSpeed does).

    Raises ``ValueError`` for an unknown key or a negative/non-integer value in ``known``.
    """
    known = dict(known or {})
    for key, value in known.items():
        if key not in CATEGORIES:
            raise ValueError(f"memory_report known[{key!r}]: unknown category; expected one of {CATEGORIES}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"memory_report known[{key!r}] = {value!r}: expected a non-negative int (bytes)")
    figures = _introspect(model, optimizer)
    figures.update(known)
    sources = {c: ("given" if c in known else "introspected") for c in CATEGORIES}
    peak, now = rss_bytes()
    gpu: dict[str, int | None] = {"gpu_allocated": None, "gpu_peak_allocated": None, "gpu_reserved": None}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gpu = {
            "gpu_allocated": torch.cuda.memory_allocated(),
            "gpu_peak_allocated": torch.cuda.max_memory_allocated(),
            "gpu_reserved": torch.cuda.memory_reserved(),
        }
        if reset_gpu_peak:
            torch.cuda.reset_peak_memory_stats()
    return MemoryReport(**figures, peak_rss=peak, current_rss=now, **gpu, sources=sources)


__all__ = ["CATEGORIES", "MemoryReport", "memory_report", "rss_bytes"]
