"""What DeepSpeed's ``deepspeed.git_version_info`` records at build time, for the torch zero runs on (served as that
module): ``version``, ``git_hash``, ``git_branch``, ``accelerator_name`` and ``torch_info``, the dict DeepSpeed's
setup writes (``version``, ``bf16_support``, ``cuda_version``, ``nccl_version``, ``hip_version``: "major.minor"
strings, "0.0" where the runtime has none)."""

from __future__ import annotations

import torch

from zero.compat.alias import VERSION_SEEN


def _major_minor(version) -> str:
    if not version:
        return "0.0"
    parts = version if isinstance(version, tuple) else str(version).split(".")
    return ".".join(str(p) for p in parts[:2])


def _torch_info() -> dict:
    cuda = torch.cuda.is_available() and torch.version.cuda is not None
    nccl = torch.cuda.nccl.version() if cuda and torch.distributed.is_nccl_available() else None
    return {
        "version": _major_minor(torch.__version__.split("+")[0]),
        "bf16_support": bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()),
        "cuda_version": _major_minor(torch.version.cuda),
        "nccl_version": _major_minor(nccl),
        "hip_version": _major_minor(torch.version.hip),
    }


version = VERSION_SEEN
"""DeepSpeed's version string as zero reports it (``0.19.8+zero.<zero version>``)."""
git_hash = "unknown"
"""No DeepSpeed checkout was built: ``"unknown"``, as a pip-installed DeepSpeed says."""
git_branch = "unknown"
"""As ``git_hash``."""
accelerator_name = "cuda" if torch.cuda.is_available() else "cpu"
"""The accelerator zero runs on (``deepspeed.accelerator.get_accelerator()``'s name)."""
torch_info = _torch_info()
"""The torch this process runs: see the module docstring."""
