"""The device an inference engine runs on and the dtypes it can run (DeepSpeed's ``get_accelerator()`` answers).

* device: ``cuda:<LOCAL_RANK>`` (modulo the visible devices) when CUDA is available, else the CPU.
* dtypes: CUDA: float32, float16, and bfloat16 where ``torch.cuda.is_bf16_supported()``; CPU: float32, bfloat16,
  and float16 where oneDNN has fp16 kernels (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``), as DeepSpeed's
  CPU accelerator. int8 (DeepSpeed's quantized path) is in neither list.
"""

from __future__ import annotations

import os

import torch


def inference_device() -> torch.device:
    """``cuda:<LOCAL_RANK % device_count>`` when CUDA is available, else ``cpu``."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def _cpu_fp16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):  # a torch build without the query: no fp16 kernels claimed
        return False


def supported_dtypes(device: torch.device) -> list[torch.dtype]:
    """The dtypes a model can be converted to and run in on ``device`` (see the module docstring)."""
    if device.type == "cuda":
        return [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_bf16_supported() else [])
    return [torch.float32, torch.bfloat16] + ([torch.float16] if _cpu_fp16() else [])


def check_dtype(dtype: torch.dtype, device: torch.device) -> None:
    """Raises ValueError naming ``dtype``, the device and the dtypes it runs, when ``dtype`` is not among them
    (DeepSpeed: "Data type ... is not supported by ... accelerator")."""
    supported = supported_dtypes(device)
    if dtype not in supported:
        raise ValueError(f"dtype {dtype} is not supported on {device.type}: this device runs {supported}; set the "
                         "inference config's dtype to one of them")  # fmt: skip
