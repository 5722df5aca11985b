"""``deepspeed.git_version_info``: DeepSpeed's build record (``version``, ``torch_info``, ...) for the torch zero runs
on (``zero.compat.version_info``)."""

from zero.compat import unsupported_getattr
from zero.compat.version_info import accelerator_name, git_branch, git_hash, torch_info, version

__all__ = ["accelerator_name", "git_branch", "git_hash", "torch_info", "version"]

__getattr__ = unsupported_getattr(
    "deepspeed.git_version_info",
    {"installed_ops": "zero builds no DeepSpeed ops; zero.op_builders reports what zero's kernels provide"},
)
