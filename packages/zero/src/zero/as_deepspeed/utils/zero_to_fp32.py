"""``deepspeed.utils.zero_to_fp32``: consolidation of a sharded checkpoint (``zero.checkpoint_tools.to_fp32``)."""

from zero.checkpoint_tools.to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
]
