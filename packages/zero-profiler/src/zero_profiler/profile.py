"""The result of one profiling session: per-module tree and totals, as a table or JSON.

A :class:`Profile` is an immutable snapshot made by ``FlopsProfiler.stop_profile()``. Its table mirrors the
options of DeepSpeed's ``flops_profiler`` config section (``module_depth``, ``top_modules``, ``detailed``); the
layout is our own.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from zero_profiler.flop_formulas import Category


@dataclass(frozen=True)
class ModuleProfile:
    """One node of the call tree: a module in the context it was called from.

    ``path`` is the dotted call path from the root (``""`` for the root); a module shared by several parents
    appears once per parent, each node holding only the calls made from that parent. ``params`` is the count of
    distinct parameters in the module's subtree, as full (unsharded) element counts. ``macs``/``flops`` are
    forward counts including every descendant; ``latency_s`` is the wall-clock seconds summed over ``calls``.
    """

    path: str
    module_type: str
    depth: int
    params: int
    macs: int
    flops: int
    latency_s: float
    calls: int


@dataclass(frozen=True)
class PhaseTotals:
    """MACs and FLOPs of one phase; ``by_category`` maps a :class:`Category` value to its FLOPs."""

    macs: int = 0
    flops: int = 0
    by_category: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Profile:
    """Totals and per-module tree of one profiling session (one rank).

    * ``modules``: the call tree in pre-order, root first.
    * ``total_params`` / ``non_embedding_params``: distinct parameters of the model (full element counts), and
      those not owned by an ``nn.Embedding`` (the ``N`` of the 6N rule of thumb).
    * ``forward``: ops run inside the model's forward (module hooks active, not in autograd's backward).
    * ``backward``: every op run by autograd's engine (gradient formulas, activation-checkpoint recompute);
      not attributed to modules.
    * ``outside``: forward-phase ops outside the model (a loss computed by the caller, an optimizer step).
    * ``forward_latency_s``: wall-clock seconds of the root module's forward calls.
    * ``uncounted_ops``: ops whose formula failed on their arguments (counted as 0 and named in the table).
    """

    modules: tuple[ModuleProfile, ...]
    total_params: int
    non_embedding_params: int
    forward: PhaseTotals
    backward: PhaseTotals
    outside: PhaseTotals
    forward_latency_s: float
    uncounted_ops: tuple[str, ...] = ()

    @property
    def total_flops(self) -> int:
        """Forward + backward FLOPs of the model (excludes ``outside``)."""
        return self.forward.flops + self.backward.flops

    def flops_per_token(self, tokens: int) -> float:
        """(forward + backward) FLOPs / ``tokens``; raises ``ValueError`` for ``tokens <= 0``."""
        if tokens <= 0:
            raise ValueError(f"tokens must be a positive count, got {tokens!r}")
        return self.total_flops / tokens

    def to_dict(self) -> dict:
        """JSON-ready dict: ``{"totals": {...}, "modules": [ModuleProfile as dict, ...]}``."""
        return {
            "totals": {
                "params": self.total_params,
                "non_embedding_params": self.non_embedding_params,
                "forward": asdict(self.forward),
                "backward": asdict(self.backward),
                "outside": asdict(self.outside),
                "forward_latency_s": self.forward_latency_s,
                "uncounted_ops": list(self.uncounted_ops),
            },
            "modules": [asdict(m) for m in self.modules],
        }

    def to_json(self, indent: int | None = 2) -> str:
        """:meth:`to_dict` as a JSON string."""
        return json.dumps(self.to_dict(), indent=indent)

    def format(
        self,
        *,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        step: int | None = None,
        tokens: int | None = None,
    ) -> str:
        """Readable report: a summary, the ``top_modules`` heaviest nodes per depth, and (``detailed``) the tree.

        ``module_depth`` limits the depths shown (-1: all); ``top_modules`` is k per depth (0: none);
        ``tokens`` (the number of tokens the profiled step processed) adds FLOPs per token and its ratio to
        6 x non-embedding parameters. Raises ``ValueError`` for ``module_depth < -1`` or ``top_modules < 0``.
        """
        if module_depth < -1:
            raise ValueError(f"module_depth must be -1 (all depths) or >= 0, got {module_depth}")
        if top_modules < 0:
            raise ValueError(f"top_modules must be >= 0, got {top_modules}")
        shown = [m for m in self.modules if module_depth == -1 or m.depth <= module_depth]
        lines = self._summary(step, tokens)
        if top_modules:
            lines += ["", f"Top {top_modules} module(s) per depth by forward FLOPs, parameters and latency:"]
            lines += self._top(shown, top_modules)
        if detailed:
            lines += ["", "Per-module forward profile (a shared module is listed under each parent, per its calls):"]
            lines += self._tree(shown)
        return "\n".join(lines)

    def _summary(self, step: int | None, tokens: int | None) -> list[str]:
        fwd, bwd, lat = self.forward, self.backward, self.forward_latency_s
        rate = f" ({_si(fwd.flops / lat, 'FLOP/s')})" if lat > 0 else ""
        lines = [
            "zero flops profiler" + (f" - step {step}" if step is not None else ""),
            "conventions: 2 FLOPs per MAC; bias 1 FLOP per output element; params are full (unsharded) counts",
            f"params:             {_si(self.total_params)} (non-embedding {_si(self.non_embedding_params)})",
            f"forward:            {_si(fwd.macs, 'MACs')}, {_si(fwd.flops, 'FLOPs')} in {lat * 1e3:.2f} ms{rate}",
            f"backward:           {_si(bwd.macs, 'MACs')}, {_si(bwd.flops, 'FLOPs')}",
            f"outside the model:  {_si(self.outside.flops, 'FLOPs')} (forward-phase ops not inside any module)",
        ]
        kinds = {c.value: fwd.by_category.get(c.value, 0) + bwd.by_category.get(c.value, 0) for c in Category}
        total = sum(kinds.values())
        if total:
            parts = [f"{k} {v / total:.1%}" for k, v in kinds.items() if v]
            lines.append("FLOPs by kind:      " + ", ".join(parts) + " (forward + backward)")
        if self.uncounted_ops:
            lines.append(f"NOT COUNTED (formula failed): {', '.join(self.uncounted_ops)}")
        if tokens is not None:
            per_token = self.flops_per_token(tokens)
            ratio = per_token / (6 * self.non_embedding_params) if self.non_embedding_params else float("nan")
            lines.append(
                f"per token:          {_si(per_token, 'FLOPs')} forward + backward over {tokens} tokens = "
                f"{ratio:.3f} x (6 x non-embedding params)"
            )
        return lines

    def _top(self, shown: list[ModuleProfile], k: int) -> list[str]:
        lines = []
        for depth in sorted({m.depth for m in shown}):
            at = [m for m in shown if m.depth == depth]
            by_flops = sorted(at, key=lambda m: -m.flops)[:k]
            by_params = sorted(at, key=lambda m: -m.params)[:k]
            by_latency = sorted(at, key=lambda m: -m.latency_s)[:k]
            lines.append(
                f"  depth {depth}: FLOPs "
                + ", ".join(f"{_label(m)} {_si(m.flops)}" for m in by_flops)
                + " | params "
                + ", ".join(f"{_label(m)} {_si(m.params)}" for m in by_params)
                + " | latency "
                + ", ".join(f"{_label(m)} {m.latency_s * 1e3:.2f} ms" for m in by_latency)
            )
        return lines

    def _tree(self, shown: list[ModuleProfile]) -> list[str]:
        root = self.modules[0]
        header = ("module", "type", "params", "params%", "MACs", "FLOPs", "FLOPs%", "latency ms", "latency%", "calls")
        rows = [header]
        for m in shown:
            name = "  " * m.depth + (m.path.rsplit(".", 1)[-1] if m.path else "(root)")
            rows.append(
                (
                    name,
                    m.module_type,
                    _si(m.params),
                    _pct(m.params, root.params),
                    _si(m.macs),
                    _si(m.flops),
                    _pct(m.flops, root.flops),
                    f"{m.latency_s * 1e3:.3f}",
                    _pct(m.latency_s, root.latency_s),
                    str(m.calls),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        out = []
        for r in rows:
            cells = [r[0].ljust(widths[0]), r[1].ljust(widths[1])] + [c.rjust(w) for c, w in zip(r[2:], widths[2:])]
            out.append("  ".join(cells).rstrip())
        return out


def _label(m: ModuleProfile) -> str:
    return m.path or "(root)"


def _pct(part: float, whole: float) -> str:
    return f"{part / whole:.1%}" if whole else "-"


def _si(value: float, unit: str = "") -> str:
    """1234567 -> '1.23 M' (+ unit); exact below 1000."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {prefix}{unit}".rstrip()
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return f"{text} {unit}".rstrip()
