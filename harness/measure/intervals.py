"""The distribution-free interval of a median, and when two intervals cannot be told apart.

For n values the interval ``(x_(j), x_(n+1-j))`` of the sorted values covers the median with
probability ``1 - 2 P(X <= j-1)``, X ~ Binomial(n, 1/2), whatever their distribution (the sign-test
interval). Pure.
"""

from __future__ import annotations

import math
import statistics

COVERAGE = 0.60
"""Wanted coverage of the median's order-statistic interval. From 5 rounds the choice is between
the full range (93.75%) and the 2nd to 4th value (62.5%): the full range is as wide as the one
round that a neighbour disturbed (a 5-round sweep here had rounds at 881 ms beside 49-58 ms), which
is exactly the round the median was taken to ignore. 60% takes the 2nd to 4th of 5, the 2nd to 6th
of 7 (87.5%), the 3rd to 7th of 9 (82%); the coverage each interval has is recorded beside it."""


def _binom_cdf(k: int, n: int) -> float:
    """P(X <= k) for X ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n


def median_interval(values: list[float], coverage: float = COVERAGE) -> tuple[float, float, float]:
    """The order-statistic interval of the median: ``(low, high, its coverage)``; the narrowest whose coverage
    reaches ``coverage``, else (fewer than 4 values at 60%) the full range with its own coverage."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        raise ValueError("median_interval of no values")
    best = 1
    for j in range(1, n // 2 + 1):
        if 1 - 2 * _binom_cdf(j - 1, n) >= coverage:
            best = j
    return xs[best - 1], xs[n - best], 1 - 2 * _binom_cdf(best - 1, n)


def overlaps(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Two intervals share a point: neither cell is measurably faster."""
    return a[0] <= b[1] and b[0] <= a[1]


def median_spread(values: list[float], coverage: float = COVERAGE) -> dict:
    """The median of ``values``, its :func:`median_interval` and that interval's half-width as % of the
    median: ``{"median", "low", "high", "coverage", "spread_pct"}`` (what ``±`` means in the tables)."""
    low, high, cov = median_interval(values, coverage)
    mid = statistics.median(values)
    return {"median": mid, "low": low, "high": high, "coverage": cov,
            "spread_pct": 100.0 * (high - low) / 2 / mid if mid > 0 else math.nan}
