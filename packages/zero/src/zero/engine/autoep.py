"""AutoEP at ``initialize()``: the ``expert_parallel`` section turning a Hugging Face MoE model (transformers 5's
Mixtral, Qwen3-MoE: fused 3-D experts) into an expert-parallel one before ZeRO wraps it, as DeepSpeed 0.19.8's
engine does (``deepspeed.module_inject.auto_ep``).

Order: refusals (``autoep_size`` not dividing the world size; the folding refusals below), a model built under
``zero.Init`` made whole, the MoE blocks found (:func:`zero_parallel.moe.find_moe_blocks`), the expert groups
created, every expert tensor broadcast from rank 0 (so the slices are of one model), each block replaced by
:class:`zero_parallel.moe.ExpertParallelBlock` holding this rank's experts, and an optimizer or parameter list
given to initialize() remapped from the replaced expert tensors to the local ones. Training then runs through
:mod:`zero.engine.expert_parallel` (ZeRO over the expert-data-parallel group, gradient scaling, the norm) as for
DeepSpeed's MoE layer. Every error is raised on every rank (same config, same model) before any block is replaced.

With AutoTP (``tensor_parallel.autotp_size`` T > 1; the model is split first) AutoEP folds onto the same ranks, as
DeepSpeed 0.19.8's AutoEP + AutoTP folding does: the expert-parallel groups are ``autoep_size`` P consecutive ranks
(a tensor-parallel group is T consecutive ranks), each block keeps its router whole and routes its
tensor-parallel rank's share of the tokens (:mod:`zero_parallel.moe.tp_fold`). Refused (on every rank, naming the
keys): ``autoep_size`` 1 (DeepSpeed: every tensor-parallel rank would run the same tokens through the same experts);
``use_data_before_expert_parallelism`` and ``tensor_parallel.preset_model`` other than ``expert_parallel.preset_model``
(as DeepSpeed); P not a multiple of T (zero: ZeRO runs over one group, the expert-data-parallel one, whose ranks
must hold the same tensor-parallel shards); ZeRO offload (as DeepSpeed: not validated); DeepCompile (as DeepSpeed).
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


def apply_autoep(model: torch.nn.Module, cfg, world: int, optimizer, model_parameters, tp_group=None):
    """Convert ``model`` in place when ``cfg.expert_parallel.enabled``; returns ``(optimizer, model_parameters)``
    with replaced expert tensors swapped for the local ones (unchanged when the section is off). Collective.
    ``tp_group``: AutoTP's tensor-parallel group when the model was split (the blocks fold onto it).

    Raises:
        ConfigError: ``autoep_size`` not dividing the world size; a folding refusal (module docstring).
        NotSupportedError: folding with ZeRO offload or DeepCompile.
        ValueError: no MoE block matching the preset/patterns; ``autoep_size`` not dividing a block's experts.
    """
    sec = cfg.expert_parallel
    if not sec.enabled:
        return optimizer, model_parameters
    check_autoep(cfg, world)
    ep = sec.autoep_size
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
    replaced = replace_moe_blocks(model, specs, ep, ep_rank, tp_group)
    if isinstance(optimizer, torch.optim.Optimizer):
        for group in optimizer.param_groups:
            group["params"] = [replaced.get(p, p) for p in group["params"]]
    if model_parameters is not None:
        model_parameters = [_remap(p, replaced) for p in model_parameters]
    return optimizer, model_parameters


def check_autoep(cfg, world: int) -> None:
    """The ``expert_parallel`` section's sizes against the world and AutoTP (nothing when the section is off), before
    AutoTP splits the model. Raises ConfigError / NotSupportedError as :func:`apply_autoep` lists."""
    sec = cfg.expert_parallel
    if not sec.enabled:
        return
    ep = sec.autoep_size
    if world % ep:
        raise ConfigError(f"config key 'expert_parallel.autoep_size': {ep} does not divide the world size {world} "
                          "(expert parallelism borrows its ranks from data parallelism)")  # fmt: skip
    if cfg.tensor_parallel.size > 1:
        _check_folding(cfg, ep)


def _check_folding(cfg, ep: int) -> None:
    tp, sec = cfg.tensor_parallel.autotp_size, cfg.expert_parallel
    keys = f"'expert_parallel.autoep_size': {ep} and 'tensor_parallel.autotp_size': {tp}"
    if ep == 1:
        raise ConfigError(f"config keys {keys}: AutoEP folded with AutoTP needs autoep_size > 1 (at 1 every "
                          "tensor-parallel rank would run the same tokens through the same experts, counting their "
                          "gradients autotp_size times); set autoep_size to a multiple of autotp_size")  # fmt: skip
    if ep % tp:
        raise ConfigError(f"config keys {keys}: zero folds AutoEP onto AutoTP when autoep_size is a multiple of "
                          "autotp_size (ZeRO runs over the expert-data-parallel group, whose ranks must then hold the "
                          "same tensor-parallel shards); choose such an autoep_size")  # fmt: skip
    if cfg.use_data_before_expert_parallelism:
        raise ConfigError(f"config key 'use_data_before_expert_parallelism': true with {keys} is not supported "
                          "(DeepSpeed refuses it with AutoEP + AutoTP folding too); set it to false")  # fmt: skip
    tp_preset, ep_preset = cfg.tensor_parallel.preset_model, sec.preset_model
    if tp_preset is not None and ep_preset is not None and tp_preset != ep_preset:
        raise ConfigError(f"config keys 'tensor_parallel.preset_model': {tp_preset!r} and 'expert_parallel."
                          f"preset_model': {ep_preset!r} must match when both are set")  # fmt: skip
    z = cfg.zero_optimization
    for key, section in (("offload_optimizer", z.offload_optimizer), ("offload_param", z.offload_param)):
        if section is not None and section.device != "none":
            raise NotSupportedError(f"config key 'zero_optimization.{key}.device': {section.device!r} with {keys} is "
                                    "not supported (DeepSpeed has not validated ZeRO offload with AutoEP + AutoTP "
                                    "folding either); drop the offload or one of the two sizes")  # fmt: skip
    if cfg.compile.deepcompile:
        raise NotSupportedError(f"config key 'compile.deepcompile': true with {keys} is not supported (DeepSpeed "
                                "refuses DeepCompile with AutoEP + AutoTP folding too); set it false")  # fmt: skip


def _set_top_k(router: TopKRouter, top_k: int) -> None:
    router.top_k = top_k


def _remap(item, replaced: dict):
    if isinstance(item, dict):  # a parameter group
        return {**item, "params": [replaced.get(p, p) for p in item["params"]]}
    return replaced.get(item, item)
