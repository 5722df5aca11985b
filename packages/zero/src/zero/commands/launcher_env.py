"""The launcher's environment-export constants with DeepSpeed 0.19.8's values (served as
``deepspeed.launcher.runner``).

Accelerate imports ``DEEPSPEED_ENVIRONMENT_NAME`` before it starts the ranks of ``accelerate launch
--use_deepspeed`` (it then launches them with ``torch.distributed.run``; the file names the variables exported to
other nodes of a multi-node launch). The ``deepspeed`` command itself is served by ``zero run``.
"""

from __future__ import annotations

import os

from zero.process_groups import TORCH_DISTRIBUTED_DEFAULT_PORT

DLTS_HOSTFILE = "/job/hostfile"
"""The hostfile read when ``--hostfile`` is not given (DeepSpeed's default path)."""
EXPORT_ENVS = ["MLFLOW", "PYTHON", "MV2", "UCX"]
"""Prefixes of environment variables exported to every node of a multi-node launch."""
DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
"""File of ``NAME=value`` lines exported to every node (``DS_ENV_FILE`` overrides the name)."""
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]
"""Folders searched for :data:`DEEPSPEED_ENVIRONMENT_NAME`, in order."""
PDSH_MAX_FAN_OUT = 1024
"""pdsh's fan-out limit for multi-node launches."""

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "DEEPSPEED_ENVIRONMENT_PATHS", "DLTS_HOSTFILE", "EXPORT_ENVS",
           "PDSH_MAX_FAN_OUT", "TORCH_DISTRIBUTED_DEFAULT_PORT"]  # fmt: skip
