"""Expert parameters in optimizer groups: DeepSpeed's ``deepspeed.moe.utils`` helpers (``is_moe_param``,
``split_params_into_different_moe_groups_for_optimizer``, ...), so an optimizer can be built with the groups
ZeRO then reduces over the expert-data-parallel group."""

from __future__ import annotations

import torch

DEFAULT_MAX_GROUP_SIZE = 178956971
"""DeepSpeed's default cap on the elements of one expert optimizer group."""


def is_moe_param(param: torch.Tensor) -> bool:
    """True when ``param`` is an expert parameter (marked ``allreduce = False`` by the MoE layer, DeepSpeed's
    convention; an unmarked tensor has no such attribute)."""
    return getattr(param, "allreduce", True) is False  # DeepSpeed's marker is a plain attribute on the tensor


def split_params_into_shared_and_expert_params(params):
    """``(shared, expert)`` lists of ``params``, in order."""
    shared = [p for p in params if not is_moe_param(p)]
    return shared, [p for p in params if is_moe_param(p)]


def split_params_grads_into_shared_and_expert_params(group):
    """``(shared_grads, expert_grads)`` of the parameters in ``group`` that have a gradient, each cast to its
    parameter's dtype."""
    shared = [p.grad.to(p.dtype) for p in group if p.grad is not None and not is_moe_param(p)]
    return shared, [p.grad.to(p.dtype) for p in group if p.grad is not None and is_moe_param(p)]


def _chunks(params, max_group_size):
    if max_group_size is None:
        return [params]
    out, current, size = [], [], 0
    for p in params:
        if current and size + p.numel() > max_group_size:
            out.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel()
    return out + [current] if current else out


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=DEFAULT_MAX_GROUP_SIZE):
    """Move the expert parameters of each group into groups of their own, one per (source group, expert group
    name), each a copy of the source group's options with ``name`` = the expert group's name and ``moe=True``,
    cut into groups of at most ``max_group_size`` elements (None: uncut). The source groups keep the shared
    parameters (in place); the expert groups are appended. Mirrors DeepSpeed 0.19.8 (source groups need a
    ``name`` key).

    Args:
        param_groups: a dict, a tuple or a list of dicts with ``params``.
    Returns:
        the list of groups.
    Raises:
        ValueError: ``param_groups`` is not a dict, tuple or list; KeyError: a group without ``name`` when
            there are expert parameters.
    """
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif not isinstance(param_groups, list):
        raise ValueError(f"param_groups must be a dict, a tuple or a list of dicts, got {type(param_groups).__name__}")
    names = []
    for g in param_groups:
        for p in g["params"]:
            if is_moe_param(p) and p.group_name not in names:
                names.append(p.group_name)
    added = []
    for g in list(param_groups):
        if not names:
            break
        if "name" not in g:
            raise KeyError("split_params_into_different_moe_groups_for_optimizer: every parameter group needs a "
                           f"'name' key (DeepSpeed's), got a group with keys {sorted(g)}")  # fmt: skip
        params = list(g["params"])
        for name in names:
            experts = [p for p in params if is_moe_param(p) and p.group_name == name]
            for chunk in _chunks(experts, max_group_size):
                added.append({**g, "name": name, "moe": True, "params": chunk})
        g["params"] = [p for p in params if not is_moe_param(p)]
    param_groups.extend(added)
    return param_groups


def is_moe_param_group(param_group: dict) -> bool:
    """True for a group made by :func:`split_params_into_different_moe_groups_for_optimizer`."""
    return bool(param_group.get("moe", False))


def configure_moe_param_groups(model_parameters: list):
    """Optimizer groups with the expert parameters apart: a list of parameters becomes one group named
    ``dense-params`` split by :func:`split_params_into_different_moe_groups_for_optimizer`; a list of groups is
    split unless some already say ``moe``.

    Raises:
        TypeError: an element is neither a tensor nor a dict.
    """
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError(f"optimizer parameters must be tensors or dicts, got {type(p).__name__}")
    if model_parameters and isinstance(model_parameters[0], torch.Tensor):
        dense = {"params": model_parameters, "name": "dense-params"}
        return split_params_into_different_moe_groups_for_optimizer(dense)
    if any("moe" in g for g in model_parameters):
        return model_parameters
    return split_params_into_different_moe_groups_for_optimizer(model_parameters)
