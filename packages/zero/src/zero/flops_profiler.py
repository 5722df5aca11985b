"""DeepSpeed 0.19.8's flops-profiler API over zero_profiler (served as ``deepspeed.profiling.flops_profiler``)."""

from __future__ import annotations

import torch
from torch import nn

import zero_profiler


def number_to_string(num: float, units: str | None = None, precision: int = 2) -> str:
    """``num`` with a metric prefix (T, G, M, K, "", m, u), e.g. ``65.54 K`` (DeepSpeed's format)."""
    scales = [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"), (1.0, ""), (1e-3, "m"), (1e-6, "u")]
    if units is None:
        magnitude, units = next(((m, u) for m, u in scales if abs(num) >= m), (1e-6, "u"))
        if num == 0:
            magnitude, units = 1.0, ""
    else:
        magnitude = dict((u, m) for m, u in scales)[units]
    return f"{round(num / magnitude, precision):g} {units}"


def macs_to_string(macs: float, units: str | None = None, precision: int = 2) -> str:
    """E.g. ``32.77 KMACs``."""
    return f"{number_to_string(macs, units, precision)}MACs"


def flops_to_string(flops: float, units: str | None = None, precision: int = 2) -> str:
    """E.g. ``65.54 KFLOPS``."""
    return f"{number_to_string(flops, units, precision)}FLOPS"


def params_to_string(params: float, units: str | None = None, precision: int = 2) -> str:
    """E.g. ``32.9 K`` (billions as ``B``, DeepSpeed's spelling)."""
    units = units.replace("B", "G") if units else units
    return number_to_string(params, units, precision).replace("G", "B").strip()


def duration_to_string(seconds: float, units: str | None = None, precision: int = 2) -> str:
    """E.g. ``1.5 ms``."""
    return f"{number_to_string(seconds, units, precision)}s"


class FlopsProfiler(zero_profiler.FlopsProfiler):
    """``deepspeed.profiling.flops_profiler.FlopsProfiler(model, ds_engine=None, recompute_fwd_factor=0.0)``.

    DeepSpeed's flow works unchanged: ``start_profile()``, run the model, ``get_total_flops()`` /
    ``get_total_macs()`` / ``get_total_params()`` / ``get_total_duration()`` (each takes ``as_string``),
    ``print_model_profile(...)``, ``end_profile()``. The first getter called while profiling stops the profile
    (later ops are not counted). Counts are exact (zero_profiler's dispatch mode), so an ``nn.Linear`` counts
    its bias addition too. ``ignore_list`` (module types) is accepted as in DeepSpeed, where it leaves totals
    unchanged; here it does not remove those modules from the per-module breakdown either.

    Args:
        model: the module profiled. ds_engine: an Engine (its module is then profiled when ``model`` is None).
        recompute_fwd_factor: must be 0.0 (activation-recompute accounting is not implemented).

    Raises:
        NotSupportedError: ``recompute_fwd_factor`` other than 0.0. RuntimeError: a getter before any profile.
    """

    def __init__(self, model: nn.Module | None = None, ds_engine=None, recompute_fwd_factor: float = 0.0):
        if recompute_fwd_factor:
            from zero.config import NotSupportedError

            raise NotSupportedError("FlopsProfiler(recompute_fwd_factor=...) is not supported; leave it at 0.0")
        if model is None and ds_engine is not None:
            model = ds_engine.module
        super().__init__(model)
        self.ds_engine = ds_engine
        self.ignore_list = None

    def start_profile(self, ignore_list=None) -> None:
        """Start counting (see the class docstring for ``ignore_list``)."""
        self.ignore_list = ignore_list
        super().start_profile()

    def _last(self):
        if self.started:
            self.stop_profile()
        return super()._last()

    def get_total_flops(self, as_string: bool = False):
        """Forward FLOPs of the profiled calls (int, or a string like ``65.66 K`` when ``as_string``)."""
        flops = super().get_total_flops()
        return number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False):
        """Forward MACs (int, or ``32.77 KMACs``)."""
        macs = super().get_total_macs()
        return macs_to_string(macs) if as_string else macs

    def get_total_params(self, as_string: bool = False):
        """Distinct parameters, full element counts (int, or ``32.9 K``)."""
        params = super().get_total_params()
        return params_to_string(params) if as_string else params

    def get_total_duration(self, as_string: bool = False):
        """Seconds in the model's forward calls (float, or ``1.2 ms``)."""
        seconds = super().get_total_duration()
        return duration_to_string(seconds) if as_string else seconds

    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | None = None,
    ) -> str:
        """Print the profile (or write it to ``output_file``); returns the text."""
        self._last()
        return super().print_model_profile(
            profile_step=profile_step,
            module_depth=module_depth,
            top_modules=top_modules,
            detailed=detailed,
            output_file=output_file,
        )


def get_model_profile(
    model: nn.Module,
    input_shape: tuple | None = None,
    args=(),
    kwargs=None,
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | None = None,
    ignore_modules=None,
    mode: str = "forward",
):
    """``(flops, macs, params)`` of one forward of ``model``, as DeepSpeed's ``get_model_profile``.

    Args:
        model: the module (put in eval mode, as DeepSpeed does).
        input_shape: a tuple; the model then gets one uninitialised tensor of that shape, in the dtype and on
            the device of its first parameter. Otherwise ``args``/``kwargs`` are passed.
        print_profile, detailed, module_depth, top_modules, output_file: the printed profile (see
            :meth:`FlopsProfiler.print_model_profile`).
        warm_up: unprofiled forward calls first. as_string: strings (``"65.66 K"``) instead of numbers.
        ignore_modules: module types (see :class:`FlopsProfiler`). mode: "forward" or "generate" (``model.generate``).

    Returns:
        ``(flops, macs, params)``: ints (flops and macs of the forward; params distinct, full element counts),
        or strings when ``as_string``. ``nn.Linear(256, 128)`` on ``(1, 256)``: ``(65664, 32768, 32896)``.

    Raises:
        ValueError: not an ``nn.Module``, ``input_shape`` not a non-empty tuple, neither input given, bad ``mode``.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"get_model_profile: model must be a torch.nn.Module, got {type(model).__name__}")
    if mode not in ("forward", "generate"):
        raise ValueError(f"get_model_profile: mode must be 'forward' or 'generate', got {mode!r}")
    kwargs = dict(kwargs or {})
    model.eval()
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise ValueError(f"get_model_profile: input_shape must be a non-empty tuple, got {input_shape!r}")
        first = next(model.parameters(), None)
        spec = {"dtype": first.dtype, "device": first.device} if first is not None else {}
        args = [torch.empty(input_shape, **spec)]
    if not args and not kwargs:
        raise ValueError("get_model_profile: give input_shape, or args and/or kwargs")
    call = model if mode == "forward" else model.generate
    for _ in range(warm_up):
        call(*args, **kwargs)
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=ignore_modules)
    call(*args, **kwargs)
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    if print_profile:
        prof.print_model_profile(
            profile_step=warm_up,
            module_depth=module_depth,
            top_modules=top_modules,
            detailed=detailed,
            output_file=output_file,
        )
    prof.end_profile()
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
