"""``get_model_profile``: profile one forward (and optionally backward) of a model in one call."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from zero_profiler.flops_profiler import FlopsProfiler, ParamCountFn
from zero_profiler.profile import Profile


def get_model_profile(
    model: nn.Module,
    input_shape: Sequence[int] | None = None,
    args: Sequence[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    warm_up: int = 1,
    print_profile: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    detailed: bool = True,
    output_file: str | None = None,
    tokens: int | None = None,
    param_count_fn: ParamCountFn | None = None,
) -> Profile:
    """Run ``model`` ``warm_up`` times unprofiled, then once profiled, and return the :class:`Profile`.

    Mirrors DeepSpeed's ``get_model_profile`` (which returns ``(flops, macs, params)``; ours returns the whole
    profile, whose ``forward.flops``, ``forward.macs`` and ``total_params`` are those three).

    Inputs: either ``input_shape`` (one fp32 tensor of that shape, ``torch.randn`` on the device of the model's
    first parameter) or ``args``/``kwargs`` passed to ``model(*args, **kwargs)``; not both.
    ``loss_fn(output) -> scalar tensor``: when given, the profiled call also runs ``loss_fn(output).backward()``
    (the loss counts as ``outside``, the backward as ``backward``); without it the model runs under
    ``torch.no_grad()``. Printing options are those of :meth:`FlopsProfiler.print_model_profile`.

    Raises ``ValueError`` when both or neither of ``input_shape`` and ``args``/``kwargs`` are given, or for a
    negative ``warm_up``.
    """
    if (input_shape is None) == (args is None and kwargs is None):
        raise ValueError("get_model_profile needs exactly one of input_shape or args/kwargs")
    if warm_up < 0:
        raise ValueError(f"warm_up must be >= 0, got {warm_up}")
    if input_shape is not None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
        args, kwargs = (torch.randn(*input_shape, device=device),), {}
    args, kwargs = tuple(args or ()), dict(kwargs or {})

    def run() -> None:
        if loss_fn is None:
            with torch.no_grad():
                model(*args, **kwargs)
        else:
            loss_fn(model(*args, **kwargs)).backward()

    for _ in range(warm_up):
        run()
    prof = FlopsProfiler(model, param_count_fn=param_count_fn)
    with prof:
        run()
    if loss_fn is not None:
        model.zero_grad(set_to_none=True)
    if print_profile or output_file is not None:
        text = prof.print_model_profile(
            module_depth=module_depth,
            top_modules=top_modules,
            detailed=detailed,
            output_file=output_file,
            tokens=tokens,
        )
        if print_profile and output_file is not None:
            print(text)
    return prof.profile
