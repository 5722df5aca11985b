"""``deepspeed.module_inject.layers``: ``GatherReplacedLayerParams`` (``zero.engine.gather_replaced``); AutoTP's
layer classes are zero_parallel's."""

from zero.compat import unsupported_getattr
from zero.engine.gather_replaced import GatherReplacedLayerParams

__all__ = ["GatherReplacedLayerParams"]

_LAYERS = "zero's AutoTP layers are zero_parallel.tp_layers.ColumnParallelLinear / RowParallelLinear"

__getattr__ = unsupported_getattr(
    "deepspeed.module_inject.layers",
    {
        "LinearLayer": _LAYERS,
        "LinearAllreduce": _LAYERS,
        "LmHeadLinearAllreduce": _LAYERS,
        "TensorParallel_Layer": _LAYERS,
        "set_autotp_mode": "AutoTP is set by the config's tensor_parallel section (zero_parallel.autotp)",
    },
)
