"""Which parameters step Muon: DeepSpeed 0.19.8's rule, read from each parameter's full shape.

A parameter uses Muon when its logical shape has at least 2 dimensions and its name (``model.named_parameters()``,
lower-cased) contains neither ``embed`` nor ``lm_head``; the rest use the auxiliary AdamW. The shape is the
parameter's real one also when it was built under ``zero.Init`` (whose placeholders are 1-D: DeepSpeed's rule
read them and silently put every parameter on AdamW there; it now reads ``ds_shape``, as we read zero_init's
record). Each incoming param group is split into a Muon half and an Adam half; a half's settings are, most
specific last: the config's shared value, ``muon_lr`` / ``adam_lr``, then the incoming group's own keys (Muon:
``lr``, ``momentum``, ``weight_decay``, ``ns_method``; Adam: ``lr``, ``betas``, ``eps``, ``weight_decay``), as
DeepSpeed's engine builds them.
"""

from __future__ import annotations

import torch

from zero.config.optim_params_more import MuonParams
from zero_core.partition_records import logical_shape

MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method")
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")


def uses_muon(name: str, param: torch.Tensor) -> bool:
    """DeepSpeed's rule: >= 2 dimensions in the full shape and not an embedding or output head by name."""
    return len(logical_shape(param)) >= 2 and not any(k in name.lower() for k in ("embed", "lm_head"))


def muon_param_groups(params: list, model: torch.nn.Module, typed: MuonParams) -> list[dict]:
    """Param-group dicts with ``use_muon`` for :class:`zero.optim.muon.Muon` from ``params`` (tensors or
    param-group dicts) of ``model``, settings from the validated config ``typed``.

    Raises:
        ValueError: a parameter that is not one of ``model``'s (its name decides), naming its shape.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [g for g in params if isinstance(g, dict)]
    loose = [p for p in params if not isinstance(p, dict)]
    if loose or not groups:
        groups.append({"params": loose})
    shared = typed.model_dump(exclude_none=True)
    halves = []
    for use_muon, keys, lr_key in ((True, MUON_KEYS, "muon_lr"), (False, ADAM_KEYS, "adam_lr")):
        base = {k: shared[k] for k in keys if k in shared}
        if lr_key in shared:
            base["lr"] = shared[lr_key]
        halves.append((use_muon, keys, base))
    out = []
    for group in groups:
        members = list(group["params"]) if not isinstance(group["params"], torch.Tensor) else [group["params"]]
        for p in members:
            if id(p) not in names:
                raise ValueError(f"Muon: a parameter of shape {tuple(logical_shape(p))} is not one of the model's; "
                                 "its name decides whether it uses Muon, so pass parameters of the model")  # fmt: skip
        for use_muon, keys, base in halves:
            half = [p for p in members if uses_muon(names[id(p)], p) is use_muon]
            if half:
                own = {k: v for k, v in group.items() if k in keys}
                out.append({**base, **own, "params": half, "use_muon": use_muon})
    return out
