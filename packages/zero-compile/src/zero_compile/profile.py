"""Profile-guided loop: a profiling interpreter for warm-up steps and the rank-agreed plan made from it.

During warm-up the compiled graphs run through :class:`ProfilingInterpreter` (an ``fx.Interpreter``): per node it
records seconds and the bytes alive after it (tensors the interpreter still holds plus the store's gathered
buffers), and per unit the seconds spent waiting for its all-gather and computing while it is gathered.
:func:`make_plan` reduces those per-unit figures across ranks (one all-reduce of a fixed-size vector, called by
every rank at the same optimizer step whatever graphs each compiled, so ranks with different input shapes still
agree) and decides, identically everywhere, which units stay gathered (selective unsharding) and how many units
ahead each all-gather starts (prefetch), within the memory budget. Mirrors DeepCompile's profiling interpreter and
its prefetch / selective-gather planning (arXiv 2504.09983, sections 3.3-3.4).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from zero_comm import all_reduce
from zero_compile import ops


@dataclass
class GraphProfile:
    """What one run of one graph measured: ``node_seconds`` (node name -> seconds), ``live_bytes`` (node name ->
    bytes alive after it), ``peak_bytes`` (max of ``live_bytes``) and ``peak_gathered_bytes`` (max bytes of gathered
    unit buffers held by the store)."""

    node_seconds: dict[str, float] = field(default_factory=dict)
    live_bytes: dict[str, int] = field(default_factory=dict)
    peak_bytes: int = 0
    peak_gathered_bytes: int = 0


@dataclass
class UnitStats:
    """Per unit, summed over warm-up runs on this rank: ``wait_s`` (seconds blocked in all-gather waits),
    ``busy_s`` (seconds of compute between a unit's wait and its release) and ``gathers`` (waits counted)."""

    wait_s: list[float]
    busy_s: list[float]
    gathers: list[int]

    @classmethod
    def empty(cls, units: int) -> UnitStats:
        """Zeros for ``units`` units."""
        return cls([0.0] * units, [0.0] * units, [0] * units)


class ProfilingInterpreter(fx.Interpreter):
    """Run a graph node by node, timing each and tracking live bytes; feeds ``stats`` for the unit operations.

    Args:
        gm: the graph (after the passes of the warm-up schedule).
        store: the :class:`~zero_compile.store.UnitStore` its operations use.
        stats: per-unit accumulators (shared by all graphs of a model).
    """

    def __init__(self, gm: fx.GraphModule, store, stats: UnitStats):
        super().__init__(gm, garbage_collect_values=True)
        self.store = store
        self.stats = stats
        self.profile = GraphProfile()
        self._open: dict[int, float] = {}

    def run_node(self, n: fx.Node):
        t0 = time.perf_counter()
        out = super().run_node(n)
        dt = time.perf_counter() - t0
        p = self.profile
        p.node_seconds[n.name] = p.node_seconds.get(n.name, 0.0) + dt
        if n.op == "call_function" and n.target is ops.WAIT:
            unit = n.args[1]
            self.stats.wait_s[unit] += dt
            self.stats.gathers[unit] += 1
            self._open[unit] = time.perf_counter()
        elif n.op == "call_function" and n.target is ops.RELEASE and n.args[1] in self._open:
            unit = n.args[1]
            self.stats.busy_s[unit] += time.perf_counter() - self._open.pop(unit)
        gathered = self.store.gathered_bytes()
        live = _env_bytes(self.env, out, self.store.gathered_buffers())
        p.live_bytes[n.name] = live
        p.peak_bytes = max(p.peak_bytes, live)
        p.peak_gathered_bytes = max(p.peak_gathered_bytes, gathered)
        return out


def _env_bytes(env: dict, extra, gathered: list) -> int:
    """Bytes of the distinct storages the interpreter holds, the node's output and the store's gathered buffers."""
    seen, total = set(), 0
    for v in list(env.values()) + [extra, gathered]:
        for t in v if isinstance(v, (list, tuple)) else (v,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                key = t.untyped_storage().data_ptr()
                if key not in seen:
                    seen.add(key)
                    total += t.untyped_storage().nbytes()
    return total


@dataclass(frozen=True)
class Plan:
    """The rank-agreed decisions of the profile-guided loop.

    Attributes:
        keep: units kept gathered across forward, backward and accumulation micro-steps until the optimizer step.
        prefetch: unit -> how many units ahead of its first use its all-gather starts (0: just before).
        budget_bytes: the gathered-parameter memory budget the plan respects (None: unlimited).
        fuse_below_bytes: starts of units smaller than this that land at the same place share one collective.
    """

    keep: frozenset[int] = frozenset()
    prefetch: dict[int, int] = field(default_factory=dict)
    budget_bytes: int | None = None
    fuse_below_bytes: int = 0


def make_plan(stats: UnitStats, unit_bytes: list[int], group, *, budget_bytes: int | None, unshard: bool,
              prefetch: bool, max_distance: int = 2, fuse_below_bytes: int = 1 << 20) -> Plan:  # fmt: skip
    """Reduce ``stats`` across ``group`` (max over ranks) and decide the :class:`Plan`. Collective: every rank
    calls it at the same step with the same number of units.

    Selective unsharding keeps units, the most waited-for per byte first, while their bytes fit ``budget_bytes``
    (all of them when None). Prefetch gives every unit, kept or not (a kept unit's first gather of the step waits
    as any other), a distance, in units, long enough for the compute of the units before it to cover its measured
    wait (at most ``max_distance``); the prefetch pass then moves the start only where the gathered bytes stay
    within the budget.
    """
    n = len(unit_bytes)
    vec = torch.tensor(stats.wait_s + stats.busy_s + [float(g) for g in stats.gathers], dtype=torch.float64)
    if group is not None and group.size() > 1:
        all_reduce(vec, group, op="max")
    wait, busy, count = vec[:n].tolist(), vec[n : 2 * n].tolist(), vec[2 * n :].tolist()
    keep: set[int] = set()
    if unshard:
        room = budget_bytes
        for u in sorted(range(n), key=lambda u: (-wait[u] / max(unit_bytes[u], 1), u)):
            if room is None or unit_bytes[u] <= room:
                keep.add(u)
                room = None if room is None else room - unit_bytes[u]
    distance: dict[int, int] = {}
    if prefetch:
        per_unit = [b / c if c else 0.0 for b, c in zip(busy, count)]
        for u in range(n):
            need, covered, d = (wait[u] / count[u] if count[u] else 0.0), 0.0, 0
            while d < max_distance and u - d - 1 >= 0 and (covered < need or d == 0):
                covered += per_unit[u - d - 1]
                d += 1
            distance[u] = d
    return Plan(frozenset(keep), distance, budget_bytes, fuse_below_bytes)
