"""Per-GPU utilization, memory, power and temperature through NVML (``nvidia-ml-py``, the ``nvml`` extra).

Never raises for a missing GPU: without the package, without the NVML library or driver, or with no device,
:func:`nvml_stats` returns ``NvmlReport(available=False, reason="no NVIDIA GPU: ...")``.
"""

from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class GpuStats:
    """One GPU as NVML reports it. Units: percent, bytes, watts, degrees Celsius; ``None`` if unsupported."""

    index: int
    name: str
    utilization_gpu_pct: int | None
    utilization_memory_pct: int | None
    memory_used: int | None
    memory_total: int | None
    power_w: float | None
    temperature_c: int | None


@dataclass(frozen=True)
class NvmlReport:
    """``available``: NVML answered and saw at least one GPU; else ``reason`` says why not."""

    available: bool
    reason: str = ""
    gpus: tuple[GpuStats, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return asdict(self)

    def format(self) -> str:
        """One line per GPU, or the reason there is none."""
        if not self.available:
            return self.reason
        return "\n".join(
            f"GPU {g.index} {g.name}: util {_opt(g.utilization_gpu_pct, '%')}, "
            f"memory {_opt(g.memory_used and g.memory_used // 2**20, ' MiB')} / "
            f"{_opt(g.memory_total and g.memory_total // 2**20, ' MiB')}, "
            f"power {_opt(g.power_w, ' W')}, temperature {_opt(g.temperature_c, ' C')}"
            for g in self.gpus
        )


def _opt(value, unit: str) -> str:
    return "n/a" if value is None else f"{value}{unit}"


def _query(fn, *args):
    # One unsupported metric (power on some boards, utilization under MIG) must not hide the others.
    try:
        return fn(*args)
    except Exception:
        return None


def nvml_stats() -> NvmlReport:
    """Utilization, memory, power and temperature of every GPU NVML sees (this host, not just this rank's).

    Returns ``NvmlReport(available=False, reason=...)`` when ``nvidia-ml-py`` is not installed
    (``pip install zero-profiler[nvml]``), the NVML library or driver is absent, or no device is found.
    """
    try:
        pynvml = importlib.import_module("pynvml")
    except ImportError:
        return NvmlReport(False, "no NVIDIA GPU: nvidia-ml-py is not installed (pip install 'zero-profiler[nvml]')")
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        return NvmlReport(False, f"no NVIDIA GPU: NVML could not start ({e})")
    gpus = []
    try:
        count = _query(pynvml.nvmlDeviceGetCount) or 0
        for i in range(count):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = _query(pynvml.nvmlDeviceGetName, h)
            util = _query(pynvml.nvmlDeviceGetUtilizationRates, h)
            mem = _query(pynvml.nvmlDeviceGetMemoryInfo, h)
            power_mw = _query(pynvml.nvmlDeviceGetPowerUsage, h)
            temp = _query(pynvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU)
            gpus.append(
                GpuStats(
                    index=i,
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    utilization_gpu_pct=None if util is None else int(util.gpu),
                    utilization_memory_pct=None if util is None else int(util.memory),
                    memory_used=None if mem is None else int(mem.used),
                    memory_total=None if mem is None else int(mem.total),
                    power_w=None if power_mw is None else power_mw / 1000.0,
                    temperature_c=None if temp is None else int(temp),
                )
            )
    finally:
        _query(pynvml.nvmlShutdown)
    if not gpus:
        return NvmlReport(False, "no NVIDIA GPU: NVML found no device")
    return NvmlReport(True, "", tuple(gpus))
