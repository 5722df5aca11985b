"""Parameters read outside the module that owns them (stage 3).

``register_external_parameter(module, param)`` mirrors DeepSpeed's ``deepspeed.zero.register_external_parameter``:
``param`` is then gathered (and kept gathered) for the whole forward of ``module`` and re-gathered for its backward.
An unregistered read of a released parameter is caught on the first forward (the pass that records the module
order) by a ``TorchFunctionMode`` that is active only during that pass, so later steps pay nothing; it raises
:class:`ExternalParameterError` naming the parameter instead of a shape error deep inside autograd.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from zero_core import registry


class ExternalParameterError(RuntimeError):
    """A stage-3 parameter was read while released (outside the forward of the module that owns it)."""


def register_external_parameter(module: torch.nn.Module, param: torch.nn.Parameter) -> None:
    """Declare that ``module``'s forward reads ``param`` although another module owns it (DeepSpeed's API).

    Stage 3: ``param``'s unit is gathered before ``module`` runs, pinned until it returns and gathered again for its
    backward. Stages 0-2 (parameters are current whenever ``step()`` has returned), or a parameter always
    gathered (persistent): no-op.

    Raises:
        TypeError: ``module`` is not an ``nn.Module`` or ``param`` not an ``nn.Parameter``.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"register_external_parameter: module must be an nn.Module, got {type(module).__name__}")
    if not isinstance(param, torch.nn.Parameter):
        raise TypeError(f"register_external_parameter: param must be an nn.Parameter, got {type(param).__name__}")
    found = registry.stage3_unit(param)  # the stage-3 store and unit holding it, if any
    if found is not None:
        st, b = found
        if not b.persistent:
            st.add_external(module, b)


class ReleasedReadCheck(TorchFunctionMode):
    """Raises ExternalParameterError when a torch function receives a released stage-3 parameter."""

    def __init__(self, names: dict[int, str]):
        super().__init__()
        self.names = names  # id(param) -> name, for every sharded (non-persistent) parameter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("__get__", "__set__"):  # attribute access (our own .data swaps)
            return func(*args, **(kwargs or {}))
        for t in tree_leaves((args, kwargs or {})):
            if isinstance(t, torch.nn.Parameter) and t.numel() == 0 and id(t) in self.names:
                raise ExternalParameterError(
                    f"stage 3: parameter {self.names[id(t)]!r} is released (0 elements) but was passed to "
                    f"{getattr(func, '__name__', func)}: it is read outside the forward of the module that owns it. "
                    "Declare it with zero_core.register_external_parameter(module_that_reads_it, param)."
                )
        return func(*args, **(kwargs or {}))
