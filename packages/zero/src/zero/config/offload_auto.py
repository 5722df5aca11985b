"""``"auto"`` in the offload sections (``zero_optimization.offload_optimizer`` / ``offload_param``).

DeepSpeed 0.19.8 accepts ``"auto"`` for every key of these sections: its config models (non-strict
``DeepSpeedConfigModel``) drop a key whose value is ``"auto"``, so the key takes its default
(``deepspeed/runtime/config_utils.py``, ``deepspeed/runtime/zero/offload_config.py``). zero resolves them the same
way, to the defaults of ``zero_core.config.OffloadConfig`` / ``OffloadParamConfig`` (DeepSpeed's), with one
exception: ``pin_memory: "auto"`` becomes whether this machine can pin (an accelerator is present), since pinning
is impossible on CPU-only torch (DeepSpeed's default true would fall back with a warning there). The resolved values
are kept on the config and printed by the engine at initialize (``describe_offload``).
"""

from __future__ import annotations

import copy

import torch

from zero_core.config import OffloadConfig, OffloadParamConfig

SECTIONS = {"offload_optimizer": OffloadConfig, "offload_param": OffloadParamConfig}


def resolve_offload_auto(raw: dict) -> tuple[dict, dict[str, object]]:
    """``raw`` (a config dict) with every ``"auto"`` inside the offload sections replaced, and the dotted keys
    resolved -> their values. Keys unknown to the section are left alone (validation names them)."""
    zo = raw.get("zero_optimization")
    if not isinstance(zo, dict) or not any(isinstance(zo.get(s), dict) for s in SECTIONS):
        return raw, {}
    raw = copy.deepcopy(raw)
    resolved: dict[str, object] = {}
    for name, model in SECTIONS.items():
        section = raw["zero_optimization"].get(name)
        if not isinstance(section, dict):
            continue
        for key, value in list(section.items()):
            if value != "auto" or key not in model.model_fields:
                continue
            if key == "pin_memory":
                section[key] = torch.cuda.is_available()
            else:
                section[key] = model.model_fields[key].default
            resolved[f"zero_optimization.{name}.{key}"] = section[key]
    return raw, resolved


def describe_offload(cfg) -> str | None:
    """One line with the offload sections as the engine uses them (``"auto"`` keys marked), or None without
    offload."""
    parts = []
    for name in SECTIONS:
        section = getattr(cfg.zero_optimization, name, None)
        if section is None or section.device == "none":
            continue
        auto = {k.rsplit(".", 1)[1] for k in cfg._auto_resolved if k.startswith(f"zero_optimization.{name}.")}
        items = ", ".join(f"{k}={v!r}{' (auto)' if k in auto else ''}" for k, v in section.model_dump().items())
        parts.append(f"{name}: {items}")
    return "zero: " + "; ".join(parts) if parts else None
