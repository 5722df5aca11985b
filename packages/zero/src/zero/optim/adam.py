"""DeepSpeedCPUAdam and FusedAdam with DeepSpeed 0.19.8's constructor arguments (served as ``deepspeed.ops.adam``).

Both step with zero_kernels (the C++ CPU Adam op, or its pure-torch reference where it cannot be built;
the CUDA fused Adam, or torch's fused AdamW where that op is unavailable). Differences from zero_kernels'
own classes: ``weight_decay`` defaults to 0 as in DeepSpeed (zero_kernels defaults to torch's 0.01 for AdamW).

The optimizer ``initialize`` builds for an ``optimizer`` section of type Adam/AdamW answers ``isinstance`` for the
class DeepSpeed 0.19.8's engine builds there (:func:`deepspeed_pick`, recorded by :func:`record_pick`), whichever
class steps it in zero (zero picks its fastest Adam for the device), so scripts' checks against
``deepspeed.ops.adam.FusedAdam`` / ``DeepSpeedCPUAdam`` hold.
"""

from __future__ import annotations

import weakref

import torch

from zero.config import NotSupportedError
from zero_kernels import CPUAdam as _CPUAdam
from zero_kernels import FusedAdam as _FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam", "deepspeed_pick", "record_pick"]

# optimizer built from a config section -> the class DeepSpeed would have built (weak: dies with the optimizer)
_PICKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _PickedCheck(type):
    """Metaclass: an instance of the class, or an optimizer :func:`record_pick` recorded with the class."""

    def __instancecheck__(cls, obj) -> bool:
        if type.__instancecheck__(cls, obj):
            return True
        try:
            return _PICKED.get(obj) is cls
        except TypeError:  # not weak-referenceable: never recorded
            return False


def deepspeed_pick(cfg) -> type | None:
    """The class DeepSpeed 0.19.8's engine builds for the config ``cfg``'s ``optimizer`` section (its
    ``_configure_basic_optimizer``): for type Adam/AdamW (any case) without ``torch_adam``, :class:`DeepSpeedCPUAdam`
    when ``zero_optimization.offload_optimizer.device`` is ``cpu`` or ``nvme``, else :class:`FusedAdam`; None without
    a section, for other types and for ``torch_adam: true`` (torch's Adam/AdamW, as built)."""
    if cfg.optimizer is None or cfg.optimizer.type.lower() not in ("adam", "adamw"):
        return None
    if cfg.optimizer.typed_params().torch_adam:
        return None
    offload = cfg.zero_optimization.offload_optimizer
    return DeepSpeedCPUAdam if offload is not None and offload.device in ("cpu", "nvme") else FusedAdam


def record_pick(optimizer: torch.optim.Optimizer, cls: type | None) -> None:
    """Make ``isinstance(optimizer, cls)`` hold (``cls``: :func:`deepspeed_pick`'s answer; None records nothing)."""
    if cls is not None:
        _PICKED[optimizer] = cls


class DeepSpeedCPUAdam(_CPUAdam, metaclass=_PickedCheck):
    """Adam/AdamW on CPU parameters (fp32), as ``deepspeed.ops.adam.DeepSpeedCPUAdam``.

    Args:
        model_params: parameters or param-group dicts. lr, betas, eps: as torch AdamW.
        bias_correction: False drops both bias corrections. weight_decay: default 0 (DeepSpeed's default).
        amsgrad: must be False. adamw_mode: True decoupled decay (AdamW), False L2 (Adam).
        fp32_optimizer_states: must be True (state is always fp32).

    State per parameter: ``step``, ``exp_avg``, ``exp_avg_sq`` (fp32), interchangeable with torch's AdamW.

    Raises:
        NotSupportedError: ``amsgrad=True`` or ``fp32_optimizer_states=False``.
        ValueError: bad hyper-parameters (zero_kernels.CPUAdam's checks).
    """

    def __init__(
        self,
        model_params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0,
        amsgrad=False,
        adamw_mode=True,
        fp32_optimizer_states=True,
    ):
        if amsgrad:
            raise NotSupportedError(
                "DeepSpeedCPUAdam(amsgrad=True) is not supported; use torch.optim.AdamW(amsgrad=True)"
            )
        if not fp32_optimizer_states:
            raise NotSupportedError("DeepSpeedCPUAdam(fp32_optimizer_states=False) is not supported: state is fp32")
        super().__init__(
            model_params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            bias_correction=bias_correction,
        )


class FusedAdam(_FusedAdam, metaclass=_PickedCheck):
    """Adam/AdamW, multi-tensor on CUDA (torch path on CPU), as ``deepspeed.ops.adam.FusedAdam``.

    Args:
        params: parameters or param-group dicts. lr, betas, eps: as torch AdamW.
        bias_correction: False drops both bias corrections. adam_w_mode: True AdamW, False Adam (L2).
        weight_decay: default 0. amsgrad: must be False (DeepSpeed refuses it too).
        set_grad_none: ``zero_grad()`` sets gradients to None (True, DeepSpeed's default) or zeroes them.

    Raises:
        RuntimeError: ``amsgrad=True`` (DeepSpeed's error type). ValueError: bad hyper-parameters.
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        adam_w_mode=True,
        weight_decay=0.0,
        amsgrad=False,
        set_grad_none=True,
    ):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant (DeepSpeed's behaviour)")
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adam_w_mode,
            bias_correction=bias_correction,
        )
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear gradients: to None when ``set_to_none`` (default: the constructor's ``set_grad_none``)."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)
