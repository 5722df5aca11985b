"""``deepspeed.ops`` for ``import zero as deepspeed``: ``ops.adam.DeepSpeedCPUAdam`` and ``ops.adam.FusedAdam``,
``ops.op_builder`` and ``__compatible_ops__`` (DeepSpeed op name -> served here, a dict of bool; one dict, so edits
to it persist, as DeepSpeed's)."""

from zero.compat import unsupported_getattr
from zero.ops import adam, op_builder

__compatible_ops__ = dict(op_builder.ALL_OPS)

__all__ = ["__compatible_ops__", "adam", "op_builder"]

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
