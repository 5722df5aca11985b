"""``deepspeed.module_inject``: ``layers.GatherReplacedLayerParams`` for AutoTP's split layers
(``zero.engine.gather_replaced``); kernel injection is ``init_inference``'s (zero_inference.fused_block)."""

from zero.as_deepspeed.module_inject import layers
from zero.compat import unsupported_getattr

__all__ = ["layers"]

_INJECTION = (
    "DeepSpeed's injection functions are not served; deepspeed.init_inference(model, "
    "replace_with_kernel_inject=True) injects zero's fused decoder blocks"
)
_LAYERS = "zero's AutoTP layers are zero_parallel.tp_layers.ColumnParallelLinear / RowParallelLinear"
_CONFIG = "AutoTP is set by the config's tensor_parallel section (zero_parallel.autotp)"

__getattr__ = unsupported_getattr(
    "deepspeed.module_inject",
    {
        "replace_transformer_layer": _INJECTION,
        "revert_transformer_layer": _INJECTION,
        "ReplaceWithTensorSlicing": _INJECTION,
        "GroupQuantizer": _INJECTION,
        "generic_injection": _INJECTION,
        "quantize_transformer_layer": _INJECTION,
        "HFBertLayerPolicy": _INJECTION,
        "DSPolicy": _INJECTION,
        "LinearAllreduce": _LAYERS,
        "LinearLayer": _LAYERS,
        "EmbeddingLayer": _LAYERS,
        "Normalize": _LAYERS,
        "SubParamLinearLayer": _LAYERS,
        "SubParamLinearAllreduce": _LAYERS,
        "set_autotp_mode": _CONFIG,
        "TPLayerSpec": _CONFIG,
        "AutoTPConfig": _CONFIG,
        "PartitionType": _CONFIG,
        "AutoTPPresets": _CONFIG,
        "merge_autotp_configs": _CONFIG,
    },
)
