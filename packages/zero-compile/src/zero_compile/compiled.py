"""``CompiledZero``: a model compiled with the ZeRO passes, its schedule and its profile-guided loop.

The owner (the engine, through the core's seam) calls it for the forward, calls :meth:`after_backward` when a
backward ends (reduce-scatters in flight finish and land in the core's gradient shards) and :meth:`after_step`
after every optimizer step (gathered buffers dropped; at the end of warm-up the profile is reduced across ranks,
the plan made and the passes of the next schedule entry installed, which recompiles every graph once).
"""

from __future__ import annotations

import torch

from zero_compile.backend import ZeroBackend
from zero_compile.fallback import EagerFallback
from zero_compile.layout import ShardSource
from zero_compile.passes import PREFETCH, SELECTIVE_UNSHARD, ZERO3, make_list_schedule, make_zero1, passes_for_step
from zero_compile.passes.zero1 import PIECE_BYTES
from zero_compile.profile import Plan, UnitStats, make_plan
from zero_compile.store import UnitStore

WARMUP = 2


class CompiledZero:
    """Compile ``module`` so that its graphs gather, release and reduce ZeRO units themselves.

    Args:
        module: the model; its parameters are the core's (stage 3: empty storage between uses).
        source: the core's :class:`~zero_compile.layout.ShardSource`.
        group: the data-parallel process group.
        stage: 3 (ZeRO-3 pass: gathers, releases, reduce-scatters) or 1/2 (ZeRO-1 pass: reduce-scatters only).
        backend: inner compiler, "aot_eager" or "inductor".
        warmup_steps: optimizer steps profiled before the plan is made (0: no profile-guided passes).
        budget_bytes: memory budget for gathered parameters (prefetch and selective unsharding); None: unlimited.
        unshard / prefetch: enable the selective unsharding / prefetch passes after warm-up (stage 3 only).
        debug_dir: dump each pass's graph there (``compile.debug_log``), or None.
        list_schedule: reorder every graph's nodes by the memory-aware list scheduler (``passes/list_schedule.py``)
            from the first step on; ``schedule_budget_bytes`` is its budget in modelled live bytes (None: lowest).
        dynamic: passed to ``torch.compile`` (None: Dynamo marks a dimension dynamic when it first changes).
        piece_bytes: stages 1/2: most bytes of gradients per in-graph reduce-scatter (a bucket's gradients are
            reduced in pieces as the backward produces them; ``passes/zero1.py``); None: one per bucket.
        prefetch_distance: the most units ahead of its first use that the plan may start a unit's all-gather
            (``make_plan``'s ``max_distance``).
        measure: keep running graphs through the profiling interpreter after warm-up too (tests and the bench
            use it to measure the gathered bytes the planned graphs hold; slower).

    Attributes:
        compiles: graphs compiled so far, as ``(step, graph id, kind)``; after warm-up no step adds any unless
            an input shape the graphs have not seen arrives.
        notes: per compiled graph, what each pass did (counts of gathers, releases, reduces, moves).
        plan: the profile-guided :class:`~zero_compile.profile.Plan` once made.
    """

    def __init__(self, module: torch.nn.Module, source: ShardSource, group, *, stage: int = 3,
                 backend: str = "aot_eager", warmup_steps: int = WARMUP, budget_bytes: int | None = None,
                 unshard: bool = True, prefetch: bool = True, debug_dir: str | None = None,
                 dynamic: bool | None = None, measure: bool = False, list_schedule: bool = True,
                 schedule_budget_bytes: int | None = None, piece_bytes: int | None = PIECE_BYTES,
                 prefetch_distance: int = 2):  # fmt: skip
        if stage not in (1, 2, 3):
            raise ValueError(f"compile: zero_optimization.stage must be 1, 2 or 3, got {stage}")
        if warmup_steps < 0:
            raise ValueError(f"compile: warmup_steps must be >= 0, got {warmup_steps}")
        first = next(iter(module.parameters()), None)
        device = first.device if first is not None else torch.device("cpu")
        self.module = module
        self.store = UnitStore(source, group, device)
        self.group = group
        self.stage, self.inner, self.debug_dir, self.dynamic = stage, backend, debug_dir, dynamic
        self.budget_bytes = budget_bytes
        if prefetch_distance < 0:
            raise ValueError(f"compile: prefetch_distance must be >= 0 units, got {prefetch_distance}")
        self.prefetch_distance = prefetch_distance
        self.joint_passes = True  # inductor's joint-graph passes before the partition (an A/B switch)
        self.measure = measure
        base = [ZERO3 if stage == 3 else make_zero1(piece_bytes)]
        order = [make_list_schedule(schedule_budget_bytes)] if list_schedule else []
        unshard_pass = [SELECTIVE_UNSHARD] if unshard and stage == 3 else []
        prefetch_pass = [PREFETCH] if prefetch and stage == 3 else []
        self.warmup_steps = warmup_steps if unshard_pass or prefetch_pass else 0
        # the scheduler orders what unsharding kept; prefetch then moves starts earlier within its budget
        planned = base + unshard_pass + order + prefetch_pass
        self.schedule = [(0, base + order)] + ([(self.warmup_steps, planned)] if self.warmup_steps else [])
        self.stats = UnitStats.empty(len(self.store.layout.units))
        self.plan: Plan | None = None
        self.step = 0
        self.compiles: list[tuple[int, int, str]] = []
        self.notes: list[dict] = []
        self.fallback = EagerFallback(module, self.store) if stage == 3 else None
        self.backend: ZeroBackend | None = None  # the current schedule entry's backend (set by _install)
        self.compiled = None  # torch.compile's callable over it (None once closed)
        self._install()

    def _install(self) -> None:
        passes = passes_for_step(self.schedule, self.step)
        profile = self.step < self.warmup_steps or self.measure
        self.backend = ZeroBackend(self.store, passes, inner=self.inner, step=self.step,
                                   plan=self.plan, profile=profile, debug_dir=self.debug_dir,
                                   on_compile=self._on_compile, stats=self.stats,
                                   joint_passes=self.joint_passes)  # fmt: skip
        self.compiled = torch.compile(self.module, backend=self.backend, dynamic=self.dynamic)

    def _on_compile(self, graph_id: int, kind: str, notes: dict) -> None:
        self.compiles.append((self.step, graph_id, kind))
        self.notes.append({"step": self.step, "graph": graph_id, "kind": kind, **notes})

    def __call__(self, *args, **kwargs):
        """The compiled forward."""
        return self.compiled(*args, **kwargs)

    def after_backward(self) -> None:
        """Reduce what ran eagerly (graph breaks), then finish the reduce-scatters of this backward (their chunks
        are added into the core's gradient shards)."""
        if self.fallback is not None:
            self.fallback.after_backward()
        self.store.flush()

    def after_step(self) -> None:
        """The optimizer stepped: drop gathered buffers; at the end of warm-up make the plan (collective, at the
        same step on every rank) and install the next passes."""
        self.store.flush()
        self.store.end_step()
        self.step += 1
        if self.warmup_steps and self.step == self.warmup_steps:
            sizes = [self.store.unit_bytes(u) for u in range(len(self.store.layout.units))]
            passes = {p.name for p in passes_for_step(self.schedule, self.step)}
            self.plan = make_plan(self.stats, sizes, self.group, budget_bytes=self.budget_bytes,
                                  unshard="selective_unshard" in passes,
                                  prefetch="prefetch" in passes,
                                  max_distance=self.prefetch_distance)  # fmt: skip
            self.store.keep = self.plan.keep
            self._install()

    def close(self) -> None:
        """Finish collectives in flight and unregister the store; the compiled callable must not be used again."""
        if self.fallback is not None:
            self.fallback.close()
        self.store.close()
        self.compiled = None
