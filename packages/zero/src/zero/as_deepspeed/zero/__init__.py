"""``deepspeed.zero``: Init, GatheredParameters, register_external_parameter, unwrap_model_for_generation
(``zero.partitioning``), ZeroParamStatus (what ``param.ds_status`` reads: ``zero_core.partitioned_param``)."""

from zero.compat import unsupported_getattr
from zero.partitioning.gathered import GatheredParameters, register_external_parameter
from zero.partitioning.generation import unwrap_model_for_generation
from zero.partitioning.init import Init
from zero_core.partitioned_param import ZeroParamStatus

__all__ = [
    "GatheredParameters",
    "Init",
    "register_external_parameter",
    "unwrap_model_for_generation",
    "ZeroParamStatus",
]

__getattr__ = unsupported_getattr(
    "deepspeed.zero",
    {
        "TiledLinear": "not implemented; build the layer from smaller nn.Linear modules",
        "TiledLinearReturnBias": "not implemented; build the layer from smaller nn.Linear modules",
        "DeepSpeedZeRoOffload": "DeepSpeed-internal; configure offload in the config's zero_optimization section",
        "ZeroParamType": "partition state is not kept on parameters here; use zero_core.ShardState",
        "DeepSpeedTensorOverride": "not implemented; pass dtype= to zero.zero.Init",
    },
)
