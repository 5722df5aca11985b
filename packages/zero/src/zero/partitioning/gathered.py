"""``GatheredParameters`` / ``register_external_parameter`` with DeepSpeed's signatures over zero_core's (served as
``deepspeed.zero.GatheredParameters`` / ``register_external_parameter``)."""

from __future__ import annotations

import torch

from zero_core import GatheredParameters as _CoreGathered
from zero_core import register_external_parameter as _core_register


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """``parameter`` is read in ``module``'s forward although another module owns it: stage 3 gathers it for
    ``module``'s forward and backward. Mirrors ``deepspeed.zero.register_external_parameter(module, parameter)``.

    Raises:
        TypeError: ``module`` is not an ``nn.Module`` or ``parameter`` not an ``nn.Parameter``.
    """
    _core_register(module, parameter)


class GatheredParameters(_CoreGathered):
    """Context manager: the full values of ``params`` are readable (and with ``modifier_rank`` writable) inside.

    Mirrors ``deepspeed.zero.GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True)``.

    Args:
        params: a parameter, an iterable of parameters, or None (nothing to gather). Parameters that are not
            partitioned are left alone.
        modifier_rank: on exit this rank's values become every rank's (None: read-only; an in-place edit then
            raises ``RuntimeError`` on exit, on every rank, and is undone).
        fwd_module: when given, ``params`` are also registered as external parameters of this module (as
            DeepSpeed does), so its forward gathers them.
        enabled: False: no-op.

    Collective over the parameters' group: every rank must enter with the same parameters.
    """

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True):
        if params is None:
            params = []
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        super().__init__(params, modifier_rank=modifier_rank, enabled=enabled)
        self.fwd_module = fwd_module

    def __enter__(self):
        if self.enabled and self.fwd_module is not None:
            for p in self.params:
                register_external_parameter(self.fwd_module, p)
        return super().__enter__()
