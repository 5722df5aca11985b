"""``engine.optimizer.parameter_offload`` at stage 3: the part of DeepSpeed's stage-3 optimizer that TRL's
``unwrap_model_for_generation`` reaches for (``remove_hooks`` / ``add_hooks`` in ``trl.models.utils``).

TRL gathers the whole model with ``GatheredParameters(model.parameters())``, then removes DeepSpeed's module
hooks so that generation's many forwards do not re-partition what it gathered, and registers them again after.
zero's stage-3 store already leaves alone every module whose units a ``GatheredParameters`` block holds (no
gather, no release, no order recorded or checked: ``zero_core.stage3``), so removing and re-adding the hooks has
nothing to do here: the handles below honour TRL's calls and change nothing. What TRL reads is served: ``module``
(its parameters and DeepSpeed's ``ds_external_parameters()``, empty: zero keeps external parameters in the store),
``forward_hooks`` / ``backward_hooks`` (lists of handles with ``remove()``), ``_register_deepspeed_module``.

DeepSpeed's engine hands back its own optimizer object, which carries ``parameter_offload``; zero hands back the
user's ``torch.optim.Optimizer``, so :func:`attach_parameter_offload` sets this one attribute on it at stage 3.
"""

from __future__ import annotations

import torch

from zero_core import ZeroRuntime


class _Handle:
    """A hook handle TRL removes before generating: the store's hooks already skip held units (see above)."""

    def remove(self) -> None:
        """Nothing to remove: see the module docstring."""


class _ModuleParams:
    """What TRL iterates over on ``parameter_offload.module``: the model's parameters, no external ones."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """``module.named_parameters`` of the wrapped model."""
        return self.module.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def ds_external_parameters(self) -> list:
        """DeepSpeed lists parameters registered as external on the module here; zero's store keeps them."""
        return []


class ParameterOffloadView:
    """DeepSpeed's ``DeepSpeedZeRoOffload`` surface that TRL uses, over a zero_core stage-3 runtime."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.module = _ModuleParams(runtime.module)
        self.forward_hooks: list[_Handle] = [_Handle()]
        self.backward_hooks: list[_Handle] = []

    def _register_deepspeed_module(self, module) -> None:
        """TRL re-adds the hooks after generation: the store's hooks were never removed (see the module
        docstring), so the handles come back and nothing else changes."""
        self.forward_hooks = [_Handle()]


def attach_parameter_offload(runtime) -> None:
    """Give a stage-3 runtime's optimizer DeepSpeed's ``parameter_offload`` (see the module docstring); a no-op at
    stages 0-2, for a forward-only runtime (no optimizer) and for runtimes that are not zero_core's."""
    if isinstance(runtime, ZeroRuntime) and runtime.optimizer is not None and runtime.stage == 3:
        runtime.optimizer.parameter_offload = ParameterOffloadView(runtime)
