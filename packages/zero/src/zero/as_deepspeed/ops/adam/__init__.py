"""``deepspeed.ops.adam``: DeepSpeedCPUAdam and FusedAdam (``zero.optim.adam``)."""

from zero.compat import unsupported_getattr
from zero.optim.adam import DeepSpeedCPUAdam, FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]

_ZENFLOW = "ZenFlow runs inside the engine: set zero_optimization.zenflow (with offload_optimizer cpu)"

__getattr__ = unsupported_getattr(
    "deepspeed.ops.adam",
    {
        "ZenFlowCPUAdam": _ZENFLOW,
        "ZenFlowSelectiveAdamW": _ZENFLOW,
    },
)
