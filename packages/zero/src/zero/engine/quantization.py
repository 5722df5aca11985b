"""The `quantization` section at ``initialize()``: the selected ``nn.Linear`` layers become zero_kernels'
``SubchannelLinear`` before any runtime is built.

Each new layer holds the old layer's own parameters (same objects), so what was done to them before (a ``zero.Init``
or deferred partition, ties, a user optimizer over ``model.parameters()``) still holds, ``state_dict`` keys are
unchanged, and every ZeRO stage and offload store treats them as before: at stage 3 the unit's pre-forward hook
gathers the weight and the quantized GEMM reads the gathered tensor (in backward, the re-gathered one).
"""

from __future__ import annotations

import fnmatch

import torch

from zero.config import ConfigError
from zero.config.quantization_section import QuantizationSection
from zero_kernels import SubchannelLinear


def _matches(name: str, patterns: list[str]) -> list[str]:
    return [p for p in patterns if fnmatch.fnmatchcase(name, p)]


def select_linears(model: torch.nn.Module, section: QuantizationSection) -> list[str]:
    """Qualified names (``named_modules()``; "" for the root) of the Linear layers the section quantizes: type
    exactly ``torch.nn.Linear`` (a subclass may compute differently) or already a ``SubchannelLinear``, name
    matching a ``module_name_patterns`` entry and no ``exclude_module_name_patterns`` entry.

    Raises:
        ConfigError: naming the key and the pattern that matches no Linear layer of the model (a typo would
            otherwise quantize nothing, or everything, silently), or saying that nothing was selected.
    """
    linears = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear or isinstance(m, SubchannelLinear)]
    for key in ("module_name_patterns", "exclude_module_name_patterns"):
        for pattern in getattr(section, key):
            if not any(fnmatch.fnmatchcase(n, pattern) for n in linears):
                raise ConfigError(f"config key 'quantization.{key}': pattern {pattern!r} matches no torch.nn.Linear "
                                  f"of the model ({len(linears)} Linear layers, e.g. {linears[:3]})")  # fmt: skip
    chosen = [n for n in linears if _matches(n, section.module_name_patterns)
              and not _matches(n, section.exclude_module_name_patterns)]  # fmt: skip
    if not chosen:
        raise ConfigError("config key 'quantization.enabled': true, but the patterns select no torch.nn.Linear "
                          "of the model")  # fmt: skip
    return chosen


def apply_quantization(model: torch.nn.Module, section: QuantizationSection) -> torch.nn.Module:
    """Swap the selected layers (:func:`select_linears`) for ``SubchannelLinear`` sharing one recipe; returns the
    model (the new layer itself when the root is the one Linear). Nothing happens when the section is off."""
    if not section.enabled:
        return model
    recipe = section.recipe()
    for name in select_linears(model, section):
        old = model.get_submodule(name)
        if isinstance(old, SubchannelLinear):  # initialize() ran on this model before
            continue
        new = SubchannelLinear(old, recipe)
        if not name:
            return new
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    return model
