"""``deepspeed.launcher.runner``: the constants Accelerate reads (``zero.commands.launcher_env``)."""

from zero.commands.launcher_env import (
    DEEPSPEED_ENVIRONMENT_NAME,
    DEEPSPEED_ENVIRONMENT_PATHS,
    DLTS_HOSTFILE,
    EXPORT_ENVS,
    PDSH_MAX_FAN_OUT,
)
from zero.process_groups import TORCH_DISTRIBUTED_DEFAULT_PORT

__all__ = [
    "DEEPSPEED_ENVIRONMENT_NAME",
    "DEEPSPEED_ENVIRONMENT_PATHS",
    "DLTS_HOSTFILE",
    "EXPORT_ENVS",
    "PDSH_MAX_FAN_OUT",
    "TORCH_DISTRIBUTED_DEFAULT_PORT",
]
