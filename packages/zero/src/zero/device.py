"""The process's device (DeepSpeed's accelerator interface, the subset scripts call; served as
``deepspeed.accelerator.get_accelerator()``).

CUDA when ``torch.cuda.is_available()``, else the CPU (DeepSpeed's ``DS_ACCELERATOR=cpu``). Methods mirror
DeepSpeed 0.19.8's ``deepspeed/accelerator/abstract_accelerator.py`` for the names listed in :class:`Accelerator`.
"""

from __future__ import annotations

import functools
import glob
import os

import torch


class Accelerator:
    """One device kind (``"cuda"`` or ``"cpu"``). Memory figures are bytes; 0 on the CPU (DeepSpeed's CPU
    accelerator reports process memory there; use ``zero_profiler.memory_report`` for host memory)."""

    def __init__(self, name: str):
        self._name = name
        self._cuda = name == "cuda"

    def device_name(self, device_index: int | None = None) -> str:
        """``"cuda"`` / ``"cuda:N"``, or ``"cpu"`` (the CPU ignores the index)."""
        if device_index is None or not self._cuda:
            return self._name
        return f"{self._name}:{device_index}"

    def current_device(self) -> int:
        """Index of the current device (0 on the CPU)."""
        return torch.cuda.current_device() if self._cuda else 0

    def current_device_name(self) -> str:
        """``"cuda:N"`` for the current CUDA device, ``"cpu"`` otherwise."""
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device(self, device_index: int | None = None) -> torch.device:
        """A ``torch.device`` of this kind."""
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index: int) -> None:
        """Make ``device_index`` current (no-op on the CPU)."""
        if self._cuda:
            torch.cuda.set_device(device_index)

    def is_synchronized_device(self) -> bool:
        """True on the CPU (work is done when a call returns), False on CUDA (kernels are queued on streams)."""
        return not self._cuda

    def use_host_timers(self) -> bool:
        """Time with the host clock (a synchronized device); CUDA uses events."""
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        """Data dependencies need no stream waits (a synchronized device)."""
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        """The device never runs ahead of its memory (a synchronized device)."""
        return self.is_synchronized_device()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """True when ``tensor`` lives on this accelerator: ``cpu`` tensors for the CPU, ``cuda:N`` ones for CUDA."""
        return str(tensor.device).startswith("cuda:" if self._cuda else "cpu")

    def total_memory(self, device_index: int | None = None) -> int:
        """Device memory in bytes; on the CPU the machine's physical memory (``MemTotal``, as psutil reports)."""
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return _meminfo_bytes("MemTotal")

    def available_memory(self, device_index: int | None = None) -> int:
        """Free device memory in bytes; on the CPU memory available without swapping (``MemAvailable``)."""
        if self._cuda:
            return torch.cuda.mem_get_info(device_index)[0]
        return _meminfo_bytes("MemAvailable")

    def supported_dtypes(self) -> list[torch.dtype]:
        """Floating-point dtypes this device computes in: the CPU gives ``[float32, bfloat16]`` plus ``float16``
        where oneDNN supports it; CUDA ``[float32]`` plus ``float16`` and ``bfloat16`` where supported."""
        if not self._cuda:
            return [torch.float, torch.bfloat16] + ([torch.float16] if self.is_fp16_supported() else [])
        return [torch.float, torch.float16] + ([torch.bfloat16] if self.is_bf16_supported() else [])

    def is_triton_supported(self) -> bool:
        """Triton kernels can run here (CUDA with triton importable; never on the CPU)."""
        if not self._cuda:
            return False
        import importlib.util

        return importlib.util.find_spec("triton") is not None

    def get_op_builder(self, class_name: str):
        """The op-builder class ``class_name`` (``"CPUAdamBuilder"``) of ``deepspeed.ops.op_builder``; an op zero
        does not serve gives its ``NotImplementedBuilder``, as DeepSpeed does."""
        from zero.op_builders import builder_class

        return builder_class(class_name)

    def create_op_builder(self, class_name: str):
        """An instance of :meth:`get_op_builder`'s class."""
        return self.get_op_builder(class_name)()

    def op_builder_dir(self) -> str:
        """The module holding the op builders."""
        return "deepspeed.ops.op_builder"

    def visible_devices_envs(self) -> list[str]:
        """Environment variables that choose the visible devices (``CUDA_VISIBLE_DEVICES``, also for the CPU)."""
        return ["CUDA_VISIBLE_DEVICES"]

    def is_available(self) -> bool:
        """True when this accelerator can be used."""
        return torch.cuda.is_available() if self._cuda else True

    def device_count(self) -> int:
        """Devices of this kind. The CPU, as DeepSpeed's: ``LOCAL_SIZE`` when set (> 0), else one per NUMA node
        that has cores (nodes with the same cores counted once), at least 1."""
        if self._cuda:
            return torch.cuda.device_count()
        local_size = int(os.environ.get("LOCAL_SIZE", "0") or 0)
        return local_size if local_size > 0 else _numa_nodes_with_cores()

    def synchronize(self, device_index: int | None = None) -> None:
        """Wait for queued device work (no-op on the CPU)."""
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def manual_seed(self, seed: int) -> None:
        """Seed this device's generator (the CPU's: ``torch.manual_seed``)."""
        if self._cuda:
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        """Seed every device of this kind."""
        if self._cuda:
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def communication_backend_name(self) -> str:
        """``"nccl"`` on CUDA, ``"gloo"`` on the CPU (DeepSpeed's CPU accelerator says "ccl"; zero uses gloo)."""
        return "nccl" if self._cuda else "gloo"

    def empty_cache(self) -> None:
        """Release cached device memory (no-op on the CPU)."""
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        """Bytes of tensors allocated on the device (0 on the CPU)."""
        return torch.cuda.memory_allocated(device_index) if self._cuda else 0

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """Peak bytes allocated on the device (0 on the CPU)."""
        return torch.cuda.max_memory_allocated(device_index) if self._cuda else 0

    def is_bf16_supported(self) -> bool:
        """bf16 tensors work (always on the CPU)."""
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        """fp16 compute is supported: on CUDA always, on the CPU where oneDNN has fp16 kernels (DeepSpeed's test)."""
        if self._cuda:
            return True
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except (AttributeError, RuntimeError):
            return False

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """Page-locked copy on CUDA machines; the tensor itself on the CPU (pinning needs an accelerator)."""
        return tensor.pin_memory() if self._cuda else tensor


def _meminfo_bytes(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # the file counts kB
    raise RuntimeError(f"/proc/meminfo has no {field} line")


def _numa_nodes_with_cores() -> int:
    lists = []
    for path in sorted(glob.glob("/sys/devices/system/node/node[0-9]*/cpulist")):
        with open(path) as f:
            cores = f.read().strip()
        if cores and (not lists or cores != lists[-1]):
            lists.append(cores)
    return max(1, len(lists))


SUPPORTED_ACCELERATORS = ("cuda", "cpu", "xpu", "npu", "mps", "hpu", "mlu", "sdaa", "supa", "klxpu")
"""DeepSpeed 0.19.8's accelerator names (``SUPPORTED_ACCELERATOR_LIST``)."""


def is_current_accelerator_supported() -> bool:
    """True when the process's accelerator is one DeepSpeed supports (always, for zero's CUDA and CPU)."""
    return get_accelerator().device_name() in SUPPORTED_ACCELERATORS


@functools.cache
def get_accelerator() -> Accelerator:
    """The process's accelerator: CUDA when available, else the CPU (decided once, as DeepSpeed)."""
    return Accelerator("cuda" if torch.cuda.is_available() else "cpu")


__all__ = ["SUPPORTED_ACCELERATORS", "Accelerator", "get_accelerator", "is_current_accelerator_supported"]
