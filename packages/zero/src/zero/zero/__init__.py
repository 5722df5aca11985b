"""``deepspeed.zero`` for ``import zero as deepspeed``: Init, GatheredParameters, register_external_parameter,
ZeroParamStatus (what ``param.ds_status`` reads: ``zero_core.partitioned_param``).

Thin DeepSpeed-signature layers over zero_core's ``zero_init`` / ``GatheredParameters`` /
``register_external_parameter`` (DeepSpeed 0.19.8, ``deepspeed/runtime/zero/partition_parameters.py``).
"""

from __future__ import annotations

from zero.compat import unsupported_getattr
from zero.zero.gathered import GatheredParameters, register_external_parameter
from zero.zero.init import Init
from zero_core.partitioned_param import ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter"]

__getattr__ = unsupported_getattr(
    "deepspeed.zero",
    {
        "TiledLinear": "not implemented; build the layer from smaller nn.Linear modules",
        "TiledLinearReturnBias": "not implemented; build the layer from smaller nn.Linear modules",
        "DeepSpeedZeRoOffload": "DeepSpeed-internal; configure offload in the config's zero_optimization section",
        "ZeroParamType": "partition state is not kept on parameters here; use zero_core.ShardState",
        "DeepSpeedTensorOverride": "not implemented; pass dtype= to zero.zero.Init",
        "unwrap_model_for_generation": "not implemented; use zero.zero.GatheredParameters(engine.module.parameters())",
    },
)
