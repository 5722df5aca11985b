"""``deepspeed.accelerator.get_accelerator()``: the subset of DeepSpeed's accelerator interface scripts call.

CUDA when ``torch.cuda.is_available()``, else the CPU (DeepSpeed's ``DS_ACCELERATOR=cpu``). Methods mirror
DeepSpeed 0.19.8's ``deepspeed/accelerator/abstract_accelerator.py`` for the names listed in :class:`Accelerator`.
"""

from __future__ import annotations

import functools

import torch

from zero.compat import unsupported_getattr


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

    def is_available(self) -> bool:
        """True when this accelerator can be used."""
        return torch.cuda.is_available() if self._cuda else True

    def device_count(self) -> int:
        """Devices of this kind (1 for the CPU)."""
        return torch.cuda.device_count() if self._cuda else 1

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
        """fp16 compute is supported (CUDA only, as DeepSpeed's CPU accelerator says)."""
        return self._cuda

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """Page-locked copy on CUDA machines; the tensor itself on the CPU (pinning needs an accelerator)."""
        return tensor.pin_memory() if self._cuda else tensor


@functools.cache
def get_accelerator() -> Accelerator:
    """The process's accelerator: CUDA when available, else the CPU (decided once, as DeepSpeed)."""
    return Accelerator("cuda" if torch.cuda.is_available() else "cpu")


__all__ = ["Accelerator", "get_accelerator"]

__getattr__ = unsupported_getattr(
    "deepspeed.accelerator",
    {
        "set_accelerator": "zero picks CUDA when available, else the CPU; set CUDA_VISIBLE_DEVICES to choose",
    },
)
