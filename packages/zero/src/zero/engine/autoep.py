"""AutoEP at ``initialize()``: the ``expert_parallel`` section turning a Hugging Face MoE model (transformers 5's
Mixtral, Qwen3-MoE: fused 3-D experts) into an expert-parallel one before ZeRO wraps it, as DeepSpeed 0.19.8's
engine does (``deepspeed.module_inject.auto_ep``).

Order: refusals (AutoTP with ``autoep_size`` > 1; ``autoep_size`` not dividing the world size), a model built
under ``zero.Init`` made whole, the MoE blocks found (:func:`zero_parallel.moe.find_moe_blocks`), the expert groups
created, every expert tensor broadcast from rank 0 (so the slices are of one model), each block replaced by
:class:`zero_parallel.moe.ExpertParallelBlock` holding this rank's experts, and an optimizer or parameter list
given to initialize() remapped from the replaced expert tensors to the local ones. Training then runs through
:mod:`zero.engine.expert_parallel` (ZeRO over the expert-data-parallel group, gradient scaling, the norm) as for
DeepSpeed's MoE layer. Every error is raised on every rank (same config, same model) before any block is replaced.
"""

from __future__ import annotations

from typing import Protocol

import torch

from zero.config import ConfigError, NotSupportedError
from zero_comm import broadcast
from zero_core.zero_init import unpartition
from zero_parallel.moe import EXPERT_GROUPS, find_moe_blocks, group_name, replace_moe_blocks, resolve_preset


class TopKRouter(Protocol):
    """The router of a transformers MoE block: ``top_k`` routes per token (the one attribute AutoEP sets)."""

    top_k: int


def apply_autoep(model: torch.nn.Module, cfg, world: int, optimizer, model_parameters):
    """Convert ``model`` in place when ``cfg.expert_parallel.enabled``; returns ``(optimizer, model_parameters)``
    with replaced expert tensors swapped for the local ones (unchanged when the section is off). Collective.

    Raises:
        NotSupportedError: ``tensor_parallel.autotp_size`` > 1 with ``expert_parallel.autoep_size`` > 1.
        ConfigError: ``autoep_size`` not dividing the world size.
        ValueError: no MoE block matching the preset/patterns; ``autoep_size`` not dividing a block's experts.
    """
    sec = cfg.expert_parallel
    if not sec.enabled:
        return optimizer, model_parameters
    ep = sec.autoep_size
    if ep > 1 and cfg.tensor_parallel.size > 1:
        raise NotSupportedError(f"config keys 'expert_parallel.autoep_size': {ep} and 'tensor_parallel.autotp_size': "
                                f"{cfg.tensor_parallel.autotp_size} together are not supported yet by zero (AutoEP's "
                                "blocks are not split by AutoTP); use one of them")  # fmt: skip
    if world % ep:
        raise ConfigError(f"config key 'expert_parallel.autoep_size': {ep} does not divide the world size {world} "
                          "(expert parallelism borrows its ranks from data parallelism)")  # fmt: skip
    for p in model.parameters():  # built under zero.Init: whole again
        unpartition(p)
    source = f"preset_model={sec.preset_model!r}" if sec.preset_model is not None else "Mixtral's layout"
    if sec.moe_layer_pattern or sec.router_pattern or sec.expert_pattern:
        source += " with the expert_parallel patterns given"
    preset = resolve_preset(sec.preset_model, sec.moe_layer_pattern, sec.router_pattern, sec.expert_pattern)
    specs = find_moe_blocks(model, preset, source)
    for spec in specs:
        if spec.num_experts % ep:
            raise ValueError(f"expert_parallel.autoep_size={ep} does not divide num_experts={spec.num_experts} of MoE "
                             f"block {spec.name!r}: each rank holds num_experts / autoep_size experts")  # fmt: skip
    EXPERT_GROUPS.create(ep, cfg.use_data_before_expert_parallelism)
    ep_rank = EXPERT_GROUPS.expert_parallel_group(group_name(ep)).rank()
    with torch.no_grad():
        for spec in specs:
            broadcast(spec.experts.gate_up_proj.data, 0)
            broadcast(spec.experts.down_proj.data, 0)
    if sec.top_k != "auto":
        for spec in specs:
            _set_top_k(spec.router, sec.top_k)
    replaced = replace_moe_blocks(model, specs, ep, ep_rank)
    if isinstance(optimizer, torch.optim.Optimizer):
        for group in optimizer.param_groups:
            group["params"] = [replaced.get(p, p) for p in group["params"]]
    if model_parameters is not None:
        model_parameters = [_remap(p, replaced) for p in model_parameters]
    return optimizer, model_parameters


def _set_top_k(router: TopKRouter, top_k: int) -> None:
    router.top_k = top_k


def _remap(item, replaced: dict):
    if isinstance(item, dict):  # a parameter group
        return {**item, "params": [replaced.get(p, p) for p in item["params"]]}
    return replaced.get(item, item)
