"""The engine's observers, driven by DeepSpeed's config keys: ``wall_clock_breakdown`` (zero_profiler.Timers),
``flops_profiler`` (zero_profiler.FlopsProfiler at ``profile_step``) and ``memory_breakdown`` (memory_report).
Nothing is installed when the keys are off, so the hot path carries no profiler code."""

from __future__ import annotations

import contextlib
import pathlib

from zero.config import EngineConfig


class Observer:
    """Owns the timers and the FLOPs profiler of one engine; prints on rank 0 every ``steps_per_print`` steps."""

    def __init__(self, cfg: EngineConfig, runtime, rank: int):
        from zero_profiler import Timers

        self.cfg, self.runtime, self.rank = cfg, runtime, rank
        device = next(runtime.module.parameters()).device
        self.timers = Timers(device) if cfg.wall_clock_breakdown else None
        self.flops = None
        self._flops_done = False

    @classmethod
    def maybe(cls, cfg: EngineConfig, runtime, rank: int) -> Observer | None:
        """An Observer when any observing key is on, else None."""
        on = cfg.wall_clock_breakdown or cfg.memory_breakdown or cfg.flops_profiler.enabled
        return cls(cfg, runtime, rank) if on else None

    def _print(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)

    def phase(self, name: str):
        """A context timing ``name`` (forward/backward/step) when wall_clock_breakdown is on."""
        return self.timers(name) if self.timers is not None else contextlib.nullcontext()

    def before_forward(self, next_step: int) -> None:
        """Start the FLOPs profiler on the first forward of optimizer step ``profile_step``."""
        fp = self.cfg.flops_profiler
        if fp.enabled and not self._flops_done and self.flops is None and next_step == fp.profile_step:
            from zero_profiler import FlopsProfiler

            numel = getattr(self.runtime, "full_numel", None)  # stage 3: count full parameters, not shards
            self.flops = FlopsProfiler(self.runtime.module, param_count_fn=numel)
            self.flops.start_profile()

    def after_boundary(self, step: int) -> None:
        """At the end of optimizer step ``step``: close the timers' step, stop the profiler, print reports."""
        every = self.cfg.steps_per_print or 0
        if self.timers is not None:
            self.timers.end_step()
            if every:
                self.timers.maybe_report(step, every, printer=self._print)
        if self.flops is not None:
            profile = self.flops.stop_profile()
            self.flops, self._flops_done = None, True
            fp = self.cfg.flops_profiler
            text = profile.format(module_depth=fp.module_depth, top_modules=fp.top_modules, detailed=fp.detailed,
                                  step=step)  # fmt: skip
            if fp.output_file and self.rank == 0:
                pathlib.Path(fp.output_file).write_text(text)
            self._print(text)
        if self.cfg.memory_breakdown and every and step % every == 0:
            from zero_profiler import memory_report

            core = self.runtime.model_state_bytes()  # zero_core's names -> zero_profiler's categories
            known = {"parameters": core["params"], "gradients": core["grads"], "master_weights": core["master"],
                     "optimizer_state": core["optimizer"]}  # fmt: skip
            report = memory_report(self.runtime.module, self.runtime.optimizer, known=known)
            print(f"rank {self.rank} step {step}: {report.format()}", flush=True)
