"""Which candidate wins when each measurement is noisy: medians over repeated runs, ties within the measured noise.

On a shared machine one short run of a configuration can be 30% off its typical speed, so the best single sample
of many is mostly the luckiest one. A search therefore measures its top candidates again (``Search``'s recheck
round) and ``choose`` decides on the medians: candidates whose medians differ by less than the measured noise
(the standard error of the difference) are ties, and a tie goes to the candidate measured more often, then to the
higher median. DeepSpeed's autotuner takes the single best sample; this is zero's own rule. (Breaking ties
towards the cheaper candidate, e.g. lower predicted memory, was tried and rejected: on a noisy objective it
steered the choice to stage 3 at the smallest micro-batch, the cheapest and usually the slowest.)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Hashable


def estimate(samples: list[float]) -> float:
    """The median of a candidate's successful measurements (metric oriented so that higher is better).
    Raises ValueError on an empty list."""
    if not samples:
        raise ValueError("estimate: no successful measurement to take the median of")
    return statistics.median(samples)


def relative_noise(samples: dict[Hashable, list[float]]) -> float | None:
    """The relative standard deviation of one measurement, pooled over the candidates measured at least twice
    (the spread of repeats of one configuration is noise by definition), or None when nothing was repeated."""
    variances = []
    for values in samples.values():
        if len(values) < 2:
            continue
        mean = statistics.fmean(values)
        if mean != 0:
            variances.append(statistics.variance(values) / mean**2)
    return math.sqrt(statistics.fmean(variances)) if variances else None


def choose(samples: dict[Hashable, list[float]], estimates: dict[Hashable, float] | None = None) -> Hashable | None:
    """The winner among ``samples`` (candidate -> successful measurements, higher is better), or None if none
    has a measurement. ``estimates`` (candidate -> value; default: the medians) are what is compared.
    See the module docstring for the rule."""
    est = estimates if estimates is not None else {c: estimate(v) for c, v in samples.items() if v}
    est = {c: e for c, e in est.items() if samples.get(c)}
    if not est:
        return None
    top = max(est, key=lambda c: est[c])
    noise = relative_noise(samples) or 0.0
    scale = abs(est[top]) or 1.0

    def tied(c) -> bool:
        band = noise * math.sqrt(1 / len(samples[top]) + 1 / len(samples[c]))
        return (est[top] - est[c]) / scale <= band

    ties = [c for c in est if tied(c)]
    return min(ties, key=lambda c: (-len(samples[c]), -est[c]))
