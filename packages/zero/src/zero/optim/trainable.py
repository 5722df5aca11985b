"""Which parameters an optimizer built from the config's ``optimizer`` section holds.

DeepSpeed's ZeRO and bf16 optimizers keep parameters with ``requires_grad=False`` out of their param groups
(``_get_trainable_parameter_groups``), so a mostly frozen model (LoRA over a frozen base) carries no master copy,
gradient buffer or optimizer state for its frozen weights. zero does the same for the optimizer it builds; an
optimizer the user passes keeps what it was given (a parameter frozen now may then be unfrozen later).
"""

from __future__ import annotations

import torch


def split_trainable(params: list) -> tuple[list, list[torch.Tensor]]:
    """``(kept, left_out)``: ``params`` (tensors, or param-group dicts with a ``"params"`` list) without the
    tensors that do not require grad, and those tensors in order. A group left with no trainable tensor is dropped,
    as DeepSpeed drops it. When nothing in ``params`` is trainable, ``params`` is kept whole (an optimizer cannot
    be empty: a model frozen at ``initialize`` and unfrozen afterwards still trains)."""
    kept, left_out = [], []
    for entry in params:
        if isinstance(entry, dict):
            inside = list(entry["params"])
            trainable = [p for p in inside if p.requires_grad]
            left_out += [p for p in inside if not p.requires_grad]
            if trainable:
                kept.append({**entry, "params": trainable})
        elif entry.requires_grad:
            kept.append(entry)
        else:
            left_out.append(entry)
    if not kept:
        return params, []
    return kept, left_out


def left_out_names(model: torch.nn.Module, left_out: list[torch.Tensor]) -> tuple[tuple[str, torch.Tensor], ...]:
    """``(name, parameter)`` of each left-out parameter of ``model`` (tensors not in it are not named)."""
    ids = {id(p) for p in left_out}
    return tuple((n, p) for n, p in model.named_parameters() if id(p) in ids)


def check_still_frozen(left_out: tuple[tuple[str, torch.Tensor], ...]) -> None:
    """Raises ValueError naming the first parameter of ``left_out`` that requires grad now: the optimizer built
    from the config holds no state for it, so it would never be stepped (DeepSpeed ignores it silently)."""
    for name, p in left_out:
        if p.requires_grad:
            raise ValueError(
                f"parameter {name!r} requires grad now but was frozen when initialize() built the optimizer from the "
                "config's 'optimizer' section, which leaves frozen parameters out (as DeepSpeed's ZeRO does), so it "
                "would never be updated: build the optimizer yourself over every parameter you will unfreeze and "
                "pass it as initialize(optimizer=...), or keep it frozen"
            )
