"""AutoEP presets: where a Hugging Face MoE model keeps its MoE blocks, and how to find them.

A preset names the MoE block (``moe_layer_pattern``, a regular expression matched in full against the module's
dotted name), its router child (``router_pattern``) and its experts child (``expert_pattern``). The experts child
holds the experts fused in 3-D tensors, as transformers 5 builds them: ``gate_up_proj`` [E, 2 * ffn, hidden] and
``down_proj`` [E, hidden, ffn] with ``act_fn``; the router holds ``weight`` [E, hidden] and returns
``(logits [S, E], weights [S, k], experts [S, k])``. Presets as DeepSpeed 0.19.8's AutoEP names them
(``deepspeed.module_inject.auto_ep_presets``): ``mixtral`` and ``qwen3_moe`` (which covers Qwen2-MoE's layout too).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Preset:
    """Where a model family keeps its MoE blocks (see the module docstring)."""

    moe_layer_pattern: str
    router_pattern: str
    expert_pattern: str


PRESETS = {
    "mixtral": Preset(r"model\.layers\.\d+\.mlp", "gate", "experts"),
    "qwen3_moe": Preset(r"model\.layers\.\d+\.mlp", "gate", "experts"),
}
"""Preset name -> :class:`Preset` (DeepSpeed's ``preset_model`` values zero knows)."""


class FusedExperts(Protocol):
    """A transformers 5 experts module: every expert's weights in two 3-D tensors."""

    gate_up_proj: torch.nn.Parameter  # [E, 2 * ffn, hidden]: gate rows first, then up rows
    down_proj: torch.nn.Parameter  # [E, hidden, ffn]
    act_fn: torch.nn.Module


@dataclass(frozen=True)
class BlockSpec:
    """One MoE block found in a model: its dotted name, its router and experts children, its expert count."""

    name: str
    router: torch.nn.Module
    experts: FusedExperts
    num_experts: int


def resolve_preset(preset_model: str | None, moe_layer_pattern: str | None, router_pattern: str | None,
                   expert_pattern: str | None) -> Preset:  # fmt: skip
    """The preset named (default "mixtral"'s layout) with the patterns given overriding its own.

    Raises:
        ValueError: an unknown ``preset_model`` (naming the known ones).
    """
    if preset_model is not None and preset_model not in PRESETS:
        raise ValueError(f"expert_parallel.preset_model {preset_model!r} is not known; known: {sorted(PRESETS)}")
    base = PRESETS[preset_model or "mixtral"]
    return Preset(moe_layer_pattern or base.moe_layer_pattern, router_pattern or base.router_pattern,
                  expert_pattern or base.expert_pattern)  # fmt: skip


def find_moe_blocks(model: torch.nn.Module, preset: Preset, source: str) -> list[BlockSpec]:
    """Every module of ``model`` whose name matches the preset's pattern and that has the router child and the
    experts child (holding ``gate_up_proj`` and ``down_proj`` parameters), in module order; E is read from
    ``gate_up_proj``'s first dimension;
    a matching module without them (a dense MLP layer) is skipped. The parameters must be whole (not partitioned
    by ``zero.Init``).

    Raises:
        ValueError: no such module (``source`` names the preset or patterns the user chose).
    """
    pattern = re.compile(preset.moe_layer_pattern)
    found = []
    for name, module in model.named_modules():
        if not pattern.fullmatch(name):
            continue
        children = dict(module.named_children())
        router, experts = children.get(preset.router_pattern), children.get(preset.expert_pattern)
        if router is None or experts is None:
            continue
        params = dict(experts.named_parameters(recurse=False))
        if "gate_up_proj" not in params or "down_proj" not in params:
            continue
        found.append(BlockSpec(name, router, experts, params["gate_up_proj"].shape[0]))
    if not found:
        raise ValueError(
            f"AutoEP: no MoE block in the model matches {source}: expected modules named like "
            f"{preset.moe_layer_pattern!r} with a router child {preset.router_pattern!r} and an experts "
            f"child {preset.expert_pattern!r} holding gate_up_proj/down_proj; choose the preset of the "
            "model family, or set expert_parallel.moe_layer_pattern / router_pattern / expert_pattern"
        )
    return found
