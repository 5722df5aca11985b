"""Stage 3's unit plan: which parameters form each unit (one all-gather, one reduce-scatter), which module's forward
gathers it, and which small parameters stay gathered (persistent)."""

from __future__ import annotations

import torch

from zero_core.layout import split_by_size
from zero_core.leaf import is_leaf
from zero_core.partition_records import partitioned_record


def plan_units(module: torch.nn.Module, key: dict, config, keys: list) -> tuple[dict, dict]:
    """Per flat-group key: (buckets in flat order, persistent flags), and ``owner``: id(param) -> the module whose
    forward gathers its unit. Parameters with at most ``stage3_param_persistence_threshold`` elements are bucketed
    by ``reduce_bucket_size`` and kept gathered. The rest: with ``stage3_unit_numel`` 0 one unit per (module, key)
    of the parameters a module owns directly (DeepSpeed/FSDP1 granularity); otherwise one unit per (module, key)
    for each largest subtree holding at most ``stage3_unit_numel`` such elements (FSDP2's one unit per decoder
    layer, found by size), a module whose subtree is larger keeping its own direct parameters as a unit. A leaf
    module (``zero_core.leaf``) keeps its whole subtree as one unit, gathered in its own forward."""
    names = {id(p): n for n, p in module.named_parameters()}
    order = {id(p): i for i, (_, p) in enumerate(module.named_parameters())}
    units: dict = {k: [] for k in keys}
    small: dict = {k: [] for k in keys}
    owner: dict = {}
    seen: set = set()
    limit = config.stage3_unit_numel

    def take(m: torch.nn.Module, params) -> None:
        mine: dict = {}
        for p in params:
            if id(p) in seen or id(p) not in key:  # tied: owned by the first holder; non-float: not managed
                continue
            seen.add(id(p))
            numel = _logical_numel(p)
            target = small if numel <= config.stage3_param_persistence_threshold else mine
            target.setdefault(key[id(p)], []).append((names[id(p)], p))
            if target is mine:
                owner[id(p)] = m
        for k, items in mine.items():
            units[k].append(items)

    def sharded_numel(m: torch.nn.Module) -> int:
        ps = {id(p): p for p in m.parameters() if id(p) in key and id(p) not in seen}.values()
        return sum(n for n in map(_logical_numel, ps) if n > config.stage3_param_persistence_threshold)

    def visit(m: torch.nn.Module) -> None:
        if is_leaf(m) or (limit and sharded_numel(m) <= limit):
            take(m, m.parameters())  # the whole subtree is one unit, gathered in m's forward
            return
        take(m, m.parameters(recurse=False))
        for child in m.children():
            visit(child)

    if limit or any(is_leaf(m) for m in module.modules()):
        visit(module)
    else:
        for _, m in module.named_modules():
            take(m, m.parameters(recurse=False))
    plans = {}
    for k in keys:
        persistent = split_by_size(sorted(small.get(k, []), key=lambda it: order[id(it[1])]), config.reduce_bucket_size)
        plans[k] = (units[k] + persistent, [False] * len(units[k]) + [True] * len(persistent))
    return plans, owner


def _logical_numel(p: torch.Tensor) -> int:
    rec = partitioned_record(p)
    return rec.numel if rec is not None else p.numel()


def module_needs(module: torch.nn.Module, flat_groups: list, unit_owner: dict) -> dict[torch.nn.Module, list]:
    """Which units each module's forward gathers (module -> its non-persistent buckets, in first-need order): each
    unit in the forward of the module owning it (``unit_owner``: ``id(param)`` -> module), and of every other
    module holding one of its parameters (tied), unless that module runs inside the owner's forward (a coarse unit
    is already gathered there)."""
    needs: dict = {}

    def add(m: torch.nn.Module, b) -> None:
        units = needs.setdefault(m, [])
        if b not in units:
            units.append(b)

    owner = {id(s.param): b for g in flat_groups for b in g.buckets for s in b.slots}
    for g in flat_groups:
        for b in g.buckets:
            if not b.persistent:
                add(unit_owner[id(b.slots[0].param)], b)
    inside: dict = {}
    for m in module.modules():
        for d in m.modules():
            inside.setdefault(d, set()).add(m)
    for m in module.modules():
        for p in m.parameters(recurse=False):
            b = owner.get(id(p))
            if b is not None and not b.persistent and unit_owner[id(b.slots[0].param)] not in inside[m]:
                add(m, b)
    return needs
