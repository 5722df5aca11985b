"""The engine's observers, driven by DeepSpeed's config keys: ``wall_clock_breakdown`` (zero_profiler.Timers),
``flops_profiler`` (zero_profiler.FlopsProfiler at ``profile_step``), ``memory_breakdown`` (memory_report) and
``comms_logger`` (zero_comm.CommsLogger). Nothing is installed when the keys are off, so the hot path carries no
profiler code (the engine holds ``observer = None``)."""

from __future__ import annotations

import contextlib
import sys
import weakref
from dataclasses import dataclass

import torch

from zero.config import EngineConfig
from zero_comm import CommsLogger

# What zero_comm's collectives record as CommRecord.name. A `comms_logger.prof_ops` entry selects every record
# whose name contains it, so DeepSpeed's names ("all_gather", "reduce_scatter", ...) select our variants too.
COLLECTIVE_NAMES = (
    "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast",
    "all_gather_coalesced", "reduce_scatter_coalesced", "qwz_all_gather", "qgz_reduce_scatter",
    "qgz_all_to_all_intra", "qgz_all_to_all_inter", "hpz_all_gather", "hpz_secondary_all_gather",
)  # fmt: skip


class EngineCommsLogger(CommsLogger):
    """zero_comm's ``CommsLogger`` configured by DeepSpeed's ``comms_logger`` section.

    * ``prof_all`` true: every collective is recorded; false: only those whose name contains an entry of
      ``prof_ops`` (DeepSpeed: "profile only these ops when prof_all is false").
    * ``debug``: also records, per call, the function outside zero_comm that issued it (``callers``, parallel to
      ``records``; DeepSpeed's debug mode appends the caller's name). Costs a stack walk per call; off by default.
    * ``verbose``: the engine prints each step's calls at the accumulation boundary (not here: collectives may
      run inside autograd hooks, where printing per call would interleave ranks mid-step).

    Raises:
        ValueError: ``prof_all`` is false and ``prof_ops`` is empty (nothing would be recorded), or an entry of
            ``prof_ops`` names no zero_comm collective (the message lists the known names).
    """

    def __init__(self, prof_all: bool = True, prof_ops: list[str] | tuple[str, ...] = (), debug: bool = False):
        super().__init__()
        if not prof_all and not prof_ops:
            raise ValueError("comms_logger: prof_all is false and prof_ops is empty, so nothing would be "
                             "recorded; set prof_all true or list ops, e.g. ['all_gather']")  # fmt: skip
        for op in prof_ops:
            if not any(op in name for name in COLLECTIVE_NAMES):
                raise ValueError(f"comms_logger.prof_ops: {op!r} names no collective; expected a part of one of "
                                 f"{', '.join(COLLECTIVE_NAMES)}")  # fmt: skip
        self.prof_ops = None if prof_all else tuple(prof_ops)
        self.debug = debug
        self.callers: list[str] = []

    def record(self, rec) -> None:
        """Keep ``rec`` when it is selected by ``prof_ops`` (all when ``prof_all``); with ``debug``, its caller."""
        if self.prof_ops is not None and not any(op in rec.name for op in self.prof_ops):
            return
        super().record(rec)
        if self.debug:
            self.callers.append(_caller())

    def caller_counts(self, start: int = 0) -> dict[str, int]:
        """``"collective <- module.function"`` -> calls, over ``records[start:]`` (``debug`` only, else empty)."""
        out: dict[str, int] = {}
        for rec, caller in zip(self.records[start:], self.callers[start:]):
            key = f"{rec.name} <- {caller}"
            out[key] = out.get(key, 0) + 1
        return out


def _caller() -> str:
    """``module.function`` of the innermost frame outside zero_comm and this file: who issued the collective."""
    frame = sys._getframe(2)
    while frame is not None:
        mod = frame.f_globals.get("__name__", "")
        if not mod.startswith("zero_comm") and mod != __name__:
            return f"{mod}.{frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def full_numel_fn(runtime):
    """A ``param -> full element count`` function from the runtime's flat-group layout (``ParamSlot.numel``).

    At stage 3 a rank stores only its chunk of each bucket, so the FLOPs profiler must not read sizes off the
    storage; the layout keeps every parameter's logical numel. Parameters outside the layout fall back to numel().
    """
    sizes = {id(s.param): s.numel for g in runtime.flat_groups for s in g.slots}
    return lambda p: sizes.get(id(p), p.numel())


def _tokens(args, kwargs) -> int | None:
    """Token count of one forward: ``input_ids`` or the first integer tensor argument (token ids), else None."""
    ids = kwargs.get("input_ids")
    if ids is None:
        ids = next((a for a in args if isinstance(a, torch.Tensor) and not a.is_floating_point()), None)
    return int(ids.numel()) if isinstance(ids, torch.Tensor) else None


@dataclass
class FlopsRun:
    """The FLOPs profile in progress: its profiler, the optimizer step it covers, the tokens its forwards saw
    (None once a forward had no token ids) and the forward pre-hook counting them."""

    profiler: object
    step: int
    hook: object
    tokens: int | None = 0

    def count_tokens(self, module, args, kwargs) -> None:
        """Forward pre-hook (with kwargs) on the root module: add this forward's token count."""
        n = _tokens(args, kwargs)
        self.tokens = None if n is None or self.tokens is None else self.tokens + n


class Observer:
    """Owns the timers, FLOPs profiler and comms logger of one engine; prints on rank 0 every ``steps_per_print``.

    The engine calls ``before_forward(next_step)``, ``phase(name)`` around forward/backward/step and
    ``after_boundary(step)`` after each optimizer step. After a boundary: ``last_seconds`` holds that step's
    ``{phase: seconds}`` (``Timers.end_step()``; empty without ``wall_clock_breakdown``), ``last_comm_counts`` its
    ``{collective: calls}`` (``comms_logger``), ``last_memory`` the latest ``MemoryReport`` (``memory_breakdown``,
    every ``steps_per_print``) and ``last_profile`` the FLOPs ``Profile`` once taken. ``close()`` stops recording
    collectives (also done when the observer is garbage-collected). Mirrors DeepSpeed's engine wiring of these keys
    (see packages/zero-profiler/README.md, "Engine wiring").
    """

    def __init__(self, cfg: EngineConfig, runtime, rank: int):
        from zero_profiler import Timers

        self.cfg, self.runtime, self.rank = cfg, runtime, rank
        device = next(runtime.module.parameters()).device
        self.timers = Timers(device) if cfg.wall_clock_breakdown else None
        self.flops: FlopsRun | None = None
        self.last_profile = None
        self._flops_done = False
        self.last_seconds: dict[str, float] = {}
        self.last_comm_counts: dict[str, int] = {}
        self.comms: EngineCommsLogger | None = None
        self.last_memory = None
        self._comms_mark = 0
        cl = cfg.comms_logger
        if cl.enabled:  # entered for the engine's life (after the runtime's set-up broadcasts), as DeepSpeed's
            self.comms = EngineCommsLogger(cl.prof_all, cl.prof_ops, cl.debug).__enter__()
        # Leave zero_comm's active-logger list when this observer (its engine) is collected or close()d.
        self._leave = weakref.finalize(self, _leave, self.comms)

    @classmethod
    def maybe(cls, cfg: EngineConfig, runtime, rank: int) -> Observer | None:
        """An Observer when any observing key is on, else None."""
        on = cfg.wall_clock_breakdown or cfg.memory_breakdown or cfg.flops_profiler.enabled or cfg.comms_logger.enabled
        return cls(cfg, runtime, rank) if on else None

    def _print(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)

    def phase(self, name: str):
        """A context timing ``name`` (forward/backward/step) when wall_clock_breakdown is on.

        ``step`` first closes a running FLOPs profile so the optimizer's update is not counted (README: stop
        "after that step's backward"). A forward under ``no_grad`` (evaluation) is not a training phase: untimed.
        """
        if name == "step" and self.flops is not None:
            self._finish_flops()
        if self.timers is None or (name == "forward" and not torch.is_grad_enabled()):
            return contextlib.nullcontext()
        return self.timers(name)

    # --- flops_profiler ----------------------------------------------------------------------------------------
    def before_forward(self, next_step: int) -> None:
        """Start the FLOPs profiler on the first training forward of optimizer step ``profile_step``."""
        fp = self.cfg.flops_profiler
        if not fp.enabled or self._flops_done or self.flops is not None or next_step != fp.profile_step:
            return
        if not torch.is_grad_enabled():
            return  # an evaluation forward: profile the training step instead
        from zero_profiler import FlopsProfiler

        prof = FlopsProfiler(self.runtime.module, param_count_fn=full_numel_fn(self.runtime))
        self.flops = run = FlopsRun(prof, next_step, None)
        run.hook = self.runtime.module.register_forward_pre_hook(run.count_tokens, with_kwargs=True)
        prof.start_profile()

    def _finish_flops(self) -> None:
        """Stop the profiler, print the table on rank 0 (and write ``output_file``), forget the profiler."""
        run, self.flops, self._flops_done = self.flops, None, True
        run.hook.remove()
        self.last_profile = run.profiler.stop_profile()
        fp = self.cfg.flops_profiler
        if self.rank == 0:  # print_model_profile prints, or writes output_file (JSON when it ends in .json)
            text = run.profiler.print_model_profile(run.step, fp.module_depth, fp.top_modules, fp.detailed,
                                                    fp.output_file, tokens=run.tokens or None)  # fmt: skip
            if fp.output_file:
                print(text, flush=True)
        run.profiler.end_profile()

    # --- the accumulation boundary -----------------------------------------------------------------------------
    def after_boundary(self, step: int) -> None:
        """At the end of optimizer step ``step``: close the timers' step, stop the profiler, print reports."""
        every = self.cfg.steps_per_print or 0
        if self.timers is not None:
            self.last_seconds = self.timers.end_step()
            if every:
                self.timers.maybe_report(step, every, printer=self._print)
        if self.flops is not None:
            self._finish_flops()
        if self.comms is not None:
            self._comms_step(step, every)
        if self.cfg.memory_breakdown and every and step % every == 0:
            from zero_profiler import memory_report

            core = self.runtime.model_state_bytes()  # zero_core's names -> zero_profiler's categories
            known = {"parameters": core["params"], "gradients": core["grads"], "master_weights": core["master"],
                     "optimizer_state": core["optimizer"]}  # fmt: skip
            report = self.last_memory = memory_report(self.runtime.module, self.runtime.optimizer, known=known)
            print(f"rank {self.rank} step {step}: {report.format()}", flush=True)

    # --- comms_logger ------------------------------------------------------------------------------------------
    def _comms_step(self, step: int, every: int) -> None:
        start, self._comms_mark = self._comms_mark, len(self.comms.records)
        counts: dict[str, int] = {}
        for rec in self.comms.records[start:]:
            counts[rec.name] = counts.get(rec.name, 0) + 1
        self.last_comm_counts = counts
        if self.cfg.comms_logger.verbose:
            lines = [f"comms step {step}: {r.name} {r.dtype} {r.logical_bytes} B, {r.latency_s * 1e3:.3f} ms"
                     for r in self.comms.records[start:]]  # fmt: skip
            if self.comms.debug:
                lines += [f"comms step {step}: {k}: {v} call(s)" for k, v in self.comms.caller_counts(start).items()]
            self._print("\n".join(lines) or f"comms step {step}: no collectives")
        if every and step % every == 0:
            self._print(f"step {step}: " + self.comms_summary())

    def comms_summary(self) -> str:
        """The comms logger's table since the engine started (zero_comm ``CommsLogger.summary()``), with the
        calls per caller under ``debug``. Raises RuntimeError when ``comms_logger.enabled`` is false."""
        if self.comms is None:
            raise RuntimeError("comms_summary(): the comms logger is off; set comms_logger.enabled true in the config")
        text = f"collectives on rank {self.rank} ({len(self.comms.records)} calls):\n" + self.comms.summary()
        if self.comms.debug:
            text += "\n" + "\n".join(f"  {k}: {v}" for k, v in sorted(self.comms.caller_counts().items()))
        return text

    def close(self) -> None:
        """Stop recording collectives (leaves zero_comm's active-logger list) and any running FLOPs profile."""
        self._leave()
        if self.flops is not None:
            self.flops.hook.remove()
            self.flops.profiler.end_profile()
            self.flops = None


def _leave(comms: EngineCommsLogger | None) -> None:
    if comms is not None:
        with contextlib.suppress(ValueError):  # already left
            comms.__exit__(None, None, None)
