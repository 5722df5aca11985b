"""The hybrid engine's inference copy: the training module's current weights gathered into a fresh model.

At ZeRO stage 3 each rank holds a shard of every parameter; a rollout needs them whole for many forwards. The
parameters are gathered in groups (the decoder layers ``group_layers`` at a time, then the rest), each group cloned
into a model of the same class built on the meta device from the module's transformers config, and released before
the next group is gathered, so the gathered (not cloned) weights held at once are one group's. At stages 0-2 the
parameters are whole already and the gathers do nothing. Buffers (rotary frequencies ...) are cloned as they are.
The copy shares no storage with the training module: generation cannot change what training reads.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from zero.partitioning.gathered import GatheredParameters


@runtime_checkable
class ConfiguredModel(Protocol):
    """A transformers model: built from its ``config``, generating with ``generate``."""

    config: object
    generation_config: object

    def generate(self, *inputs, **kwargs):
        """Token ids ``[batch, prompt + new tokens]``."""


def parameter_groups(module: torch.nn.Module, group_layers: int) -> list[list[torch.nn.Parameter]]:
    """The module's parameters (each once) in gather groups: ``group_layers`` decoder layers of its first
    ``nn.ModuleList`` per group, then every parameter outside the layers in one group."""
    stack = next((m for m in module.modules() if isinstance(m, torch.nn.ModuleList)), None)
    layers = list(stack) if stack is not None else []
    seen: set[int] = set()
    groups = []
    for start in range(0, len(layers), group_layers):
        group = [p for layer in layers[start : start + group_layers] for p in layer.parameters()]
        seen.update(id(p) for p in group)
        groups.append(group)
    groups.append([p for p in module.parameters() if id(p) not in seen])
    return [g for g in groups if g]


def _set(root: torch.nn.Module, name: str, value, slot: str) -> None:
    owner, _, leaf = name.rpartition(".")
    getattr(root.get_submodule(owner), slot)[leaf] = value


def gathered_copy(module: ConfiguredModel, group_layers: int) -> torch.nn.Module:
    """A new model of ``module``'s class holding clones of its current full parameters (``requires_grad`` False,
    tied parameters still tied) and buffers, in eval mode, with the module's ``generation_config``.

    Collective at stage 3: every rank of the module's ZeRO group calls it.

    Raises:
        RuntimeError: a parameter or buffer of the copy was left unfilled (the class builds tensors the module
            does not have).
    """
    with torch.device("meta"):
        copy = type(module)(module.config)
    clones: dict[int, torch.nn.Parameter] = {}
    for group in parameter_groups(module, group_layers):
        with torch.no_grad(), GatheredParameters(group):
            for p in group:
                clones[id(p)] = torch.nn.Parameter(p.detach().clone(), requires_grad=False)
    for name, p in module.named_parameters(remove_duplicate=False):
        _set(copy, name, clones[id(p)], "_parameters")
    for name, b in module.named_buffers(remove_duplicate=False):
        _set(copy, name, b.detach().clone(), "_buffers")
    left = [n for n, t in [*copy.named_parameters(), *copy.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"hybrid engine: the inference copy of {type(module).__name__} has tensors the training "
                           f"module lacks: {left[:5]}")  # fmt: skip
    copy.generation_config = module.generation_config
    return copy.eval()
