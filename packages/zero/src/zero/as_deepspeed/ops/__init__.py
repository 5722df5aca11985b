"""``deepspeed.ops``: ``adam`` (DeepSpeedCPUAdam, FusedAdam), ``op_builder`` and ``__compatible_ops__`` (DeepSpeed op
name -> served here, a dict of bool: ``zero.op_builders.COMPATIBLE_OPS``)."""

from zero.as_deepspeed.ops import adam, op_builder
from zero.compat import unsupported_getattr
from zero.op_builders import COMPATIBLE_OPS as __compatible_ops__

__all__ = ["adam", "__compatible_ops__", "op_builder"]

__getattr__ = unsupported_getattr(
    "deepspeed.ops",
    {
        "lamb": "FusedLamb is not implemented; use an optimizer from the config's optimizer section",
        "lion": "DeepSpeedCPULion/FusedLion are not implemented; use torch or the config's optimizer section",
        "adagrad": "DeepSpeedCPUAdagrad is not implemented; use torch.optim.Adagrad",
        "transformer": "DeepSpeed's fused transformer kernels are not implemented; use transformers' models",
        "sparse_attention": "not implemented; use torch.nn.functional.scaled_dot_product_attention",
    },
)
