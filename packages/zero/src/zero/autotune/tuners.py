"""Tuners: which candidate to launch next (``gridsearch``, ``random``, ``model_based``), with early stopping.

Every tuner sees the same list of candidates (those the memory model lets through) and the results so far, and
returns the next untried candidate or None. ``Search`` runs one: it stops after ``num_trials`` launches, when the
space is used up, or after ``early_stopping`` launches in a row without a better metric (DeepSpeed's
``tuner_early_stopping``). A failed experiment counts as a trial with the worst metric.

The model-based tuner (DeepSpeed's ``model_based``, which ranks with XGBoost) fits a random forest from
scikit-learn (the optional dependency ``zero[autotune]``) to the features of the experiments so far
(``Candidate.features``) and launches the untried candidate with the best predicted metric; until
``initial`` experiments have succeeded it picks at random.
"""

from __future__ import annotations

import random
from collections.abc import Callable

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


class GridSearchTuner(Tuner):
    """Every candidate in order (stage, micro-batch, knobs): the base behaviour, named."""


class RandomTuner(Tuner):
    """Untried candidates in a seeded random order."""

    def next(self, tried):
        left = self.untried(tried)
        return self.rng.choice(left) if left else None


class ModelBasedTuner(Tuner):
    """Picks the untried candidate a cost model fitted on the results so far predicts best.

    Raises: ImportError naming the extra to install when scikit-learn is missing (at construction)."""

    def __init__(self, candidates, seed: int = 0, initial: int = 2):
        super().__init__(candidates, seed)
        try:
            from sklearn.ensemble import RandomForestRegressor
        except ImportError as e:
            raise ImportError("autotuning.tuner_type 'model_based' needs scikit-learn: "
                              "pip install 'zero[autotune]' (or scikit-learn)") from e  # fmt: skip
        self._regressor = RandomForestRegressor
        self.initial = initial

    def next(self, tried):
        left = self.untried(tried)
        if not left:
            return None
        ok = {c: m for c, m in tried.items() if m is not None}
        if len(ok) < self.initial:
            return self.rng.choice(left)
        worst = min(ok.values())
        xs = [c.features() for c in tried]
        ys = [m if m is not None else worst * 0.5 for m in tried.values()]  # a crash: worse than anything seen
        model = self._regressor(n_estimators=50, random_state=self.rng.randrange(2**31), min_samples_leaf=1)
        model.fit(xs, ys)
        predicted = model.predict([c.features() for c in left])
        return left[max(range(len(left)), key=lambda i: predicted[i])]


TUNERS = {"gridsearch": GridSearchTuner, "random": RandomTuner, "model_based": ModelBasedTuner}


def make_tuner(kind: str, candidates: list[Candidate], seed: int = 0) -> Tuner:
    """The tuner named by ``autotuning.tuner_type``. Raises: ValueError for an unknown name."""
    if kind not in TUNERS:
        raise ValueError(f"autotuning.tuner_type: {kind!r} is not one of {', '.join(TUNERS)}")
    return TUNERS[kind](candidates, seed)


class Search:
    """Runs a tuner: ``run(evaluate)`` calls ``evaluate(candidate) -> metric or None`` (None: failed; metric
    oriented so that higher is better) until a stopping rule holds; returns the candidates tried, in order.

    Args:
        tuner: what picks the next candidate. num_trials: most launches. early_stopping: launches in a row
            without improving the best metric after which the search stops. tried: results known before the
            search (e.g. the micro-batch confirmations); they count towards neither limit.
    """

    def __init__(self, tuner: Tuner, num_trials: int, early_stopping: int, tried: dict | None = None):
        self.tuner, self.num_trials, self.early_stopping = tuner, num_trials, early_stopping
        self.tried: dict[Candidate, float | None] = dict(tried or {})
        self.stop_reason = ""

    def run(self, evaluate: Callable[[Candidate], float | None]) -> list[Candidate]:
        order: list[Candidate] = []
        known = [m for m in self.tried.values() if m is not None]
        best = max(known) if known else None
        stale = 0
        while True:
            if len(order) >= self.num_trials:
                self.stop_reason = f"tuner_num_trials ({self.num_trials}) reached"
                break
            if stale >= self.early_stopping:
                self.stop_reason = f"no better metric in {stale} experiments (tuner_early_stopping)"
                break
            cand = self.tuner.next(self.tried)
            if cand is None:
                self.stop_reason = "space exhausted"
                break
            metric = evaluate(cand)
            self.tried[cand] = metric
            order.append(cand)
            if metric is not None and (best is None or metric > best):
                best, stale = metric, 0
            else:
                stale += 1
        return order
