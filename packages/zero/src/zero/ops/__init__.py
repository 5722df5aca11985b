"""``deepspeed.ops`` for ``import zero as deepspeed``: ``ops.adam.DeepSpeedCPUAdam`` and ``ops.adam.FusedAdam``."""

from zero.compat import unsupported_getattr
from zero.ops import adam

__all__ = ["adam"]

__getattr__ = unsupported_getattr(
    "deepspeed.ops",
    {
        "lamb": "FusedLamb is not implemented; use an optimizer from the config's optimizer section",
        "lion": "DeepSpeedCPULion/FusedLion are not implemented; use torch or the config's optimizer section",
        "adagrad": "DeepSpeedCPUAdagrad is not implemented; use torch.optim.Adagrad",
        "transformer": "DeepSpeed's fused transformer kernels are not implemented; use transformers' models",
        "sparse_attention": "not implemented; use torch.nn.functional.scaled_dot_product_attention",
        "op_builder": "DeepSpeed's op builders are not served; use zero_kernels.load(name) (prebuilt or just in time)",
    },
)
