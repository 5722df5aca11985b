"""``deepspeed.accelerator``: the process's device (``zero.device``)."""

from zero.compat import unsupported_getattr
from zero.device import SUPPORTED_ACCELERATORS, Accelerator, get_accelerator, is_current_accelerator_supported

__all__ = ["Accelerator", "get_accelerator", "is_current_accelerator_supported", "SUPPORTED_ACCELERATORS"]

__getattr__ = unsupported_getattr(
    "deepspeed.accelerator",
    {
        "set_accelerator": "zero picks CUDA when available, else the CPU; set CUDA_VISIBLE_DEVICES to choose",
    },
)
