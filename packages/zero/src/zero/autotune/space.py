"""The tuning space: candidates of (ZeRO stage, micro-batch size, ``zero_optimization`` knobs).

As in DeepSpeed's autotuner, a list in the user's ``zero_optimization`` section is that key's candidate values
(``"stage": [1, 3]``, ``"reduce_bucket_size": [5e7, 5e8]``); a single value is kept fixed; a stage not given
means stages 0-3. With ``fast`` false, keys the user left unset get default candidate values per stage, sized from
the model's parameter count Ψ (DeepSpeed's absolute 5e7/5e8/1e9 all mean "one bucket" for a small model):

* stage 0: ``reduce_bucket_size`` in {Ψ/8, 5e8} (zero buckets the stage-0 all-reduce too)
* stages 1-2: ``reduce_bucket_size`` and ``allgather_bucket_size`` in {Ψ/8, 5e8}; stage 2 also ``overlap_comm``
* stage 3: ``overlap_comm``, ``stage3_unit_numel`` in {0, Ψ/8}, ``stage3_prefetch_bucket_size`` in {Ψ/8, 5e7}
  and ``stage3_param_persistence_threshold`` in {0, 1e5} (zero_core's stage 3 gathers by unit, not by
  ``reduce_bucket_size``, so that key is not tuned there)

``offload_optimizer`` / ``offload_param`` present in the user's config are "allowed": candidates with and without
them (device none).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

STAGE_KNOBS = {
    0: ("reduce_bucket_size",),
    1: ("reduce_bucket_size", "allgather_bucket_size"),
    2: ("overlap_comm", "reduce_bucket_size", "allgather_bucket_size"),
    3: ("overlap_comm", "stage3_unit_numel", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"),
}
OFFLOAD_KEYS = ("offload_optimizer", "offload_param")


@dataclass(frozen=True, order=True)
class Candidate:
    """One point of the space: ``stage``, ``micro_batch`` (samples per rank per micro-step) and ``knobs``
    (sorted ``(key, value)`` pairs of ``zero_optimization``; offload keys carry a device name or "none")."""

    stage: int
    micro_batch: int
    knobs: tuple[tuple[str, object], ...] = ()

    @property
    def name(self) -> str:
        """A short file-system-safe name, e.g. ``z2_mb4_overlap_comm-True``."""
        parts = [f"z{self.stage}", f"mb{self.micro_batch}"] + [f"{k}-{_short(v)}" for k, v in self.knobs]
        return "_".join(parts)

    def knob(self, key: str, default=None):
        return dict(self.knobs).get(key, default)

    def config(self, base: dict) -> dict:
        """``base`` (the user's config, lists already removed) with this candidate's stage, micro-batch and knobs.

        ``train_batch_size`` is dropped so that micro-batch x accumulation x ranks resolves it."""
        cfg = copy.deepcopy(base)
        cfg.pop("train_batch_size", None)
        cfg["train_micro_batch_size_per_gpu"] = self.micro_batch
        zo = cfg.setdefault("zero_optimization", {})
        zo["stage"] = self.stage
        for key, value in self.knobs:
            if key in OFFLOAD_KEYS:
                if value == "none":
                    zo.pop(key, None)
                continue
            zo[key] = value
        if self.stage != 3:
            zo.pop("offload_param", None)
        return cfg

    def features(self) -> list[float]:
        """Numbers for the model-based tuner's cost model, built from what is known to matter: a stage
        indicator per stage (0-3), log2 micro-batch, log2 micro-batch per stage (a larger micro-batch gains more
        where the step has more fixed cost), then each knob (booleans 0/1, sizes as log2(1 + value), offload 0/1
        for "none"/a device; absent knobs 0)."""
        import math

        log_mb = math.log2(self.micro_batch)
        values = [float(self.stage == s) for s in range(4)] + [log_mb] + [log_mb * (self.stage == s) for s in range(4)]
        for key in _FEATURE_KNOBS:
            v = self.knob(key)
            if isinstance(v, bool) or v is None:
                values.append(float(bool(v)))
            elif isinstance(v, str):
                values.append(0.0 if v == "none" else 1.0)
            else:
                values.append(math.log2(1 + float(v)))
        return values


_FEATURE_KNOBS = ("overlap_comm", "reduce_bucket_size", "allgather_bucket_size", "stage3_unit_numel",
                  "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "offload_optimizer",
                  "offload_param")  # fmt: skip


def _short(v) -> str:
    if isinstance(v, bool) or isinstance(v, str):
        return str(v)
    return f"{float(v):.0e}".replace("+", "") if float(v) >= 10_000 else str(v)


def split_user_space(user_config: dict) -> tuple[dict, dict[str, list]]:
    """``(base config with every list in zero_optimization replaced by its first value, {key: values})``."""
    base = copy.deepcopy(user_config)
    zo = base.get("zero_optimization") or {}
    lists = {k: list(v) for k, v in zo.items() if isinstance(v, list)}
    for k, v in lists.items():
        if not v:
            raise ValueError(f"zero_optimization.{k}: an empty list gives the autotuner no value to try")
        zo[k] = v[0]
    return base, lists


def stages_to_tune(user_config: dict, lists: dict[str, list]) -> list[int]:
    """Stages from ``zero_optimization.stage``: a list, one value, or absent (0-3)."""
    if "stage" in lists:
        stages = lists["stage"]
    elif "stage" in (user_config.get("zero_optimization") or {}):
        stages = [user_config["zero_optimization"]["stage"]]
    else:
        stages = [0, 1, 2, 3]
    bad = [s for s in stages if s not in (0, 1, 2, 3)]
    if bad:
        raise ValueError(f"zero_optimization.stage: {bad} is not a ZeRO stage (0-3)")
    return sorted(set(stages))


def knob_values(stage: int, base: dict, lists: dict[str, list], fast: bool, psi: int) -> dict[str, list]:
    """Candidate values per knob at ``stage`` (see the module docstring)."""
    zo = base.get("zero_optimization") or {}
    out: dict[str, list] = {k: v for k, v in lists.items() if k != "stage" and (k in STAGE_KNOBS[stage] or
                                                                                  k not in _ALL_KNOBS)}  # fmt: skip
    if not fast:
        eighth = max(1, psi // 8)
        defaults = {"overlap_comm": [True, False], "reduce_bucket_size": [eighth, 500_000_000],
                    "allgather_bucket_size": [eighth, 500_000_000], "stage3_unit_numel": [0, eighth],
                    "stage3_prefetch_bucket_size": [eighth, 50_000_000],
                    "stage3_param_persistence_threshold": [0, 100_000]}  # fmt: skip
        for key in STAGE_KNOBS[stage]:
            if key not in out and key not in zo:
                out[key] = defaults[key]
    for key in OFFLOAD_KEYS:
        section = zo.get(key)
        if isinstance(section, dict) and section.get("device", "none") != "none" and (key != "offload_param" or
                                                                                      stage == 3):  # fmt: skip
            out[key] = ["none", section["device"]]
    return out


_ALL_KNOBS = {k for ks in STAGE_KNOBS.values() for k in ks}


def micro_batch_sizes(largest: int, smallest: int, count: int) -> list[int]:
    """Up to ``count`` micro-batch sizes from ``largest`` down, halving, never below ``smallest``."""
    sizes, mb = [], largest
    while mb >= smallest and len(sizes) < count:
        sizes.append(mb)
        mb //= 2
    return sorted(set(sizes))


def enumerate_space(stage: int, micro_batches: list[int], knobs: dict[str, list]) -> list[Candidate]:
    """Every combination of ``micro_batches`` and the knob values at ``stage``."""
    keys = sorted(knobs)
    out = []
    for mb in micro_batches:
        for combo in itertools.product(*(knobs[k] for k in keys)):
            out.append(Candidate(stage, mb, tuple(zip(keys, combo))))
    return out
