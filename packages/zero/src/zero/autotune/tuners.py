"""Tuners: which candidate to launch next (``gridsearch``, ``random``, ``model_based``), with early stopping.

Every tuner sees the same list of candidates (those the memory model lets through) and the results so far, and
returns the next untried candidate or None. ``Search`` runs one: it stops after ``num_trials`` launches, when the
space is used up, or after ``early_stopping`` launches in a row without a better metric (DeepSpeed's
``tuner_early_stopping``). A failed experiment counts as a trial with the worst metric.

Noise: ``Search`` can end with a recheck round (the top candidates measured again, within the trial budget) and
picks the winner on medians, ties within the measured noise going to the candidate measured more often
(``choice``).

The model-based tuner (DeepSpeed's ``model_based``, which ranks with XGBoost) fits Bayesian ridge regression
from scikit-learn (the optional dependency ``zero[autotune]``) to the structured features of the experiments so
far (``Candidate.features``) and launches the untried candidate with the best upper confidence bound; until
``initial`` experiments have succeeded it picks at random.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from zero.autotune import choice
from zero.autotune.space import Candidate


class Tuner:
    """Grid search, and the base of the others: ``next(tried)`` returns the first untried candidate (in order of
    stage, micro-batch, knobs) or None; ``tried`` maps candidate -> metric (higher is better; None: failed)."""

    def __init__(self, candidates: list[Candidate], seed: int = 0):
        self.candidates = list(candidates)
        self.rng = random.Random(seed)

    def untried(self, tried: dict[Candidate, float | None]) -> list[Candidate]:
        return [c for c in self.candidates if c not in tried]

    def next(self, tried: dict[Candidate, float | None]) -> Candidate | None:
        left = self.untried(tried)
        return left[0] if left else None

    def estimates(self, samples: dict[Candidate, list[float]]) -> dict[Candidate, float]:
        """What each measured candidate's metric is taken to be: here the median of its measurements."""
        return {c: choice.estimate(v) for c, v in samples.items() if v}


class GridSearchTuner(Tuner):
    """Every candidate in order (stage, micro-batch, knobs): the base behaviour, named."""


class RandomTuner(Tuner):
    """Untried candidates in a seeded random order."""

    def next(self, tried):
        left = self.untried(tried)
        return self.rng.choice(left) if left else None


class ModelBasedTuner(Tuner):
    """Picks the untried candidate with the best optimistic prediction of a cost model fitted to the results so far.

    The cost model is Bayesian ridge regression (scikit-learn, the optional dependency ``zero[autotune]``) of the
    log metric on the candidate's structure (``Candidate.features``: stage, log micro-batch, their product per
    stage, the knobs): an additive model that a handful of experiments already pins down (which stage, how much a
    larger micro-batch gains), where a tree ensemble needs many. The next candidate maximizes the predicted mean
    plus ``explore`` predicted standard deviations (an upper confidence bound: untried structure gets a chance).
    Until ``initial`` experiments have succeeded it picks at random (seeded). A failed experiment is fitted as
    half the worst metric seen.

    Raises: ImportError naming the extra to install when scikit-learn is missing (at construction)."""

    def __init__(self, candidates, seed: int = 0, initial: int = 2, explore: float = 1.0):
        super().__init__(candidates, seed)
        try:
            from sklearn.linear_model import BayesianRidge
        except ImportError as e:
            raise ImportError("autotuning.tuner_type 'model_based' needs scikit-learn: "
                              "pip install 'zero[autotune]' (or scikit-learn)") from e  # fmt: skip
        self._regressor = BayesianRidge
        self.initial, self.explore = initial, explore
        self._scale = _Standardize([c.features() for c in self.candidates]) if self.candidates else None

    def _fit(self, samples: dict[Candidate, list[float | None]]):
        """The cost model fitted to every measurement (a repeated candidate weighs more), or None with fewer than
        ``initial`` successes."""
        ok = [m for v in samples.values() for m in v if m is not None]
        if len(ok) < self.initial:
            return None
        worst = min(_log(m) for m in ok)
        xs = self._scale([c.features() for c, v in samples.items() for _ in v])
        ys = [_log(m) if m is not None else worst - math.log(2) for v in samples.values() for m in v]
        return self._regressor().fit(xs, ys)

    def next(self, tried):
        left = self.untried(tried)
        if not left:
            return None
        model = self._fit({c: [m] for c, m in tried.items()})
        if model is None:
            return self.rng.choice(left)
        mean, std = model.predict(self._scale([c.features() for c in left]), return_std=True)
        return left[max(range(len(left)), key=lambda i: mean[i] + self.explore * std[i])]


def _log(metric: float) -> float:
    """Log of a metric oriented so that higher is better (a negated latency stays monotone)."""
    return math.copysign(math.log(max(abs(metric), 1e-30)), metric)


class _Standardize:
    """Scales each feature to zero mean and unit spread over the whole space (ridge priors assume comparable
    scales; a bucket size's log2 of ~25 would otherwise dwarf a stage indicator)."""

    def __init__(self, rows: list[list[float]]):
        cols = list(zip(*rows))
        self.mean = [sum(c) / len(c) for c in cols]
        self.std = [max(1e-9, (sum((v - m) ** 2 for v in c) / len(c)) ** 0.5) for c, m in zip(cols, self.mean)]

    def __call__(self, rows: list[list[float]]) -> list[list[float]]:
        return [[(v - m) / s for v, m, s in zip(r, self.mean, self.std)] for r in rows]


TUNERS = {"gridsearch": GridSearchTuner, "random": RandomTuner, "model_based": ModelBasedTuner}


def make_tuner(kind: str, candidates: list[Candidate], seed: int = 0) -> Tuner:
    """The tuner named by ``autotuning.tuner_type``. Raises: ValueError for an unknown name."""
    if kind not in TUNERS:
        raise ValueError(f"autotuning.tuner_type: {kind!r} is not one of {', '.join(TUNERS)}")
    return TUNERS[kind](candidates, seed)


class Search:
    """Runs a tuner: ``run(evaluate)`` calls ``evaluate(candidate) -> metric or None`` (None: failed; metric
    oriented so that higher is better) until a stopping rule holds, then rechecks the best candidates; returns
    the candidates launched, in order (a rechecked one appears again).

    Args:
        tuner: what picks the next candidate. num_trials: most launches, rechecks included. early_stopping:
            launches in a row without improving the best metric after which the exploration stops. tried: results
            known before the search (e.g. the micro-batch confirmations); they count towards neither limit.
        recheck_top_k: after exploring, the ``k`` candidates with the best medians are measured once more each,
            one after the other (interleaved, so that they see the same machine load), within ``num_trials``:
            exploration stops ``k`` launches early to leave room for them.

    After ``run``: ``samples`` (candidate -> successful measurements), ``tried`` (candidate -> median, None when
    every launch failed), ``choice`` (the winner by ``choice.choose``), ``noise`` (relative noise of one
    measurement from the repeats, or None) and ``stop_reason``.
    """

    def __init__(self, tuner: Tuner, num_trials: int, early_stopping: int, tried: dict | None = None,
                 recheck_top_k: int = 0):  # fmt: skip
        self.tuner, self.num_trials, self.early_stopping = tuner, num_trials, early_stopping
        self.recheck_top_k = recheck_top_k
        self.samples: dict[Candidate, list[float]] = {c: ([] if m is None else [m]) for c, m in (tried or {}).items()}
        self.tried: dict[Candidate, float | None] = dict(tried or {})
        self.choice: Candidate | None = None
        self.noise: float | None = None
        self.stop_reason = ""

    def _measure(self, cand: Candidate, evaluate: Callable[[Candidate], float | None]) -> float | None:
        metric = evaluate(cand)
        got = self.samples.setdefault(cand, [])
        if metric is not None:
            got.append(metric)
        self.tried[cand] = choice.estimate(got) if got else None
        return metric

    def run(self, evaluate: Callable[[Candidate], float | None]) -> list[Candidate]:
        order: list[Candidate] = []
        known = [m for m in self.tried.values() if m is not None]
        best = max(known) if known else None
        stale = 0
        explore = max(1, self.num_trials - self.recheck_top_k) if self.num_trials > 1 else self.num_trials
        while True:
            if len(order) >= explore:
                self.stop_reason = f"tuner_num_trials ({self.num_trials}) reached"
                break
            if stale >= self.early_stopping:
                self.stop_reason = f"no better metric in {stale} experiments (tuner_early_stopping)"
                break
            cand = self.tuner.next(self.tried)
            if cand is None:
                self.stop_reason = "space exhausted"
                break
            metric = self._measure(cand, evaluate)
            order.append(cand)
            if metric is not None and (best is None or metric > best):
                best, stale = metric, 0
            else:
                stale += 1
        est = self.tuner.estimates(self.samples)
        ranked = sorted(est, key=lambda c: -est[c])
        top = ranked[: min(self.recheck_top_k, self.num_trials - len(order))]
        for cand in top:
            self._measure(cand, evaluate)
            order.append(cand)
        if top:
            self.stop_reason += f"; top {len(top)} measured again"
        self.noise = choice.relative_noise(self.samples)
        self.choice = choice.choose(self.samples, self.tuner.estimates(self.samples))
        return order
