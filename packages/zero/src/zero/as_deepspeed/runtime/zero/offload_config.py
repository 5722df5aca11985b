"""``deepspeed.runtime.zero.offload_config``: the enums ``engine.offload_states()`` takes
(``zero.engine.offload_states``; OpenRLHF, ROLL and SkyRL import them at load time)."""

from zero.compat import unsupported_getattr
from zero.engine.offload_states import OffloadDeviceEnum, OffloadStateTypeEnum

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]

_SECTIONS = "zero's offload sections are validated from the config dict (zero_optimization.offload_*); pass a dict"

__getattr__ = unsupported_getattr(
    "deepspeed.runtime.zero.offload_config",
    {"DeepSpeedZeroOffloadParamConfig": _SECTIONS, "DeepSpeedZeroOffloadOptimizerConfig": _SECTIONS},
)
