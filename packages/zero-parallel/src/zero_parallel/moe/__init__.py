"""Mixture of experts with expert parallelism: DeepSpeed's ``MoE`` layer (gate, capacity, dispatch over the
expert-parallel group, local experts, combine), its expert and expert-data-parallel groups, and the optimizer-group
helpers for expert parameters; AutoEP (a Hugging Face MoE block made expert-parallel). Imports torch and
zero_comm (the all-to-all)."""

from zero_parallel.moe.autoep import ExpertParallelBlock, LocalExperts, expert_parallel_blocks, replace_moe_blocks
from zero_parallel.moe.autoep_presets import PRESETS as AUTOEP_PRESETS
from zero_parallel.moe.autoep_presets import find_moe_blocks, resolve_preset
from zero_parallel.moe.experts import Experts
from zero_parallel.moe.gate import TopKGate
from zero_parallel.moe.gating import Routing
from zero_parallel.moe.groups import EXPERT_GROUPS, ExpertGroups, group_name
from zero_parallel.moe.layer import MoE, MOELayer
from zero_parallel.moe.params import (
    configure_moe_param_groups,
    is_moe_param,
    is_moe_param_group,
    split_params_grads_into_shared_and_expert_params,
    split_params_into_different_moe_groups_for_optimizer,
    split_params_into_shared_and_expert_params,
)


def has_moe_layers(module) -> tuple[bool, int]:
    """``(True, num_experts of the first MoE layer)`` when ``module`` holds an :class:`MoE`, else ``(False, 0)``
    (DeepSpeed's ``deepspeed.moe.utils.has_moe_layers``)."""
    for m in module.modules():
        if isinstance(m, MoE):
            return True, m.num_experts
    return False, 0


__all__ = [
    "AUTOEP_PRESETS",
    "ExpertParallelBlock",
    "LocalExperts",
    "expert_parallel_blocks",
    "find_moe_blocks",
    "replace_moe_blocks",
    "resolve_preset",
    "EXPERT_GROUPS",
    "ExpertGroups",
    "Experts",
    "MOELayer",
    "MoE",
    "Routing",
    "TopKGate",
    "configure_moe_param_groups",
    "group_name",
    "has_moe_layers",
    "is_moe_param",
    "is_moe_param_group",
    "split_params_grads_into_shared_and_expert_params",
    "split_params_into_different_moe_groups_for_optimizer",
    "split_params_into_shared_and_expert_params",
]
