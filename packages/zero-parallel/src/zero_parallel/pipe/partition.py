"""Splitting a list of layers into pipeline stages: boundaries as DeepSpeed's ``partition_uniform`` and
``partition_balanced`` (``deepspeed.runtime.utils``) compute them, so a model is cut at the same layers.

A partition of ``n`` items into ``p`` parts is ``p + 1`` ascending boundaries ``parts`` from 0 to ``n``: part ``s``
holds items ``parts[s]:parts[s + 1]``.
"""

from __future__ import annotations

import math


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries giving each part ``num_items // num_parts`` items, the first ``num_items % num_parts`` parts one
    more. With ``num_items <= num_parts`` the first parts hold one item each and the rest none (DeepSpeed's)."""
    if num_items <= num_parts:
        return [min(s, num_items) for s in range(num_parts + 1)]
    size, extra = divmod(num_items, num_parts)
    return [s * size + min(s, extra) for s in range(num_parts + 1)]


def partition_balanced(weights: list[int | float], num_parts: int) -> list[int]:
    """Boundaries of contiguous, non-empty parts minimising the spread (heaviest part's weight minus the
    lightest's), by dynamic programming over (items, parts) as DeepSpeed does; among equal spreads the split
    whose last part starts latest wins, as in DeepSpeed. With ``len(weights) <= num_parts``:
    :func:`partition_uniform`."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = math.inf
    # best[i][j]: (spread, heaviest, lightest, start of the last part) of the first i items in j parts
    heaviest = [[inf] * (m + 1) for _ in range(n + 1)]
    lightest = [[inf] * (m + 1) for _ in range(n + 1)]
    spread = [[inf] * (m + 1) for _ in range(n + 1)]
    start = [[0] * (m + 1) for _ in range(n + 1)]
    heaviest[0][0], spread[0][0] = 0.0, 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                hi = max(heaviest[k][j - 1], part)
                lo = min(lightest[k][j - 1], part)
                if hi - lo <= spread[i][j]:
                    spread[i][j], heaviest[i][j], lightest[i][j], start[i][j] = hi - lo, hi, lo, k
    bounds = [n]
    for j in range(m, 0, -1):
        bounds.append(start[bounds[-1]][j])
    return bounds[::-1]
