"""Summary statistics of raw step samples (pytest-benchmark ``stats.py``, pyperf style)."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

UNSTABLE_CV = 0.10
"""A cell whose step-time coefficient of variation exceeds this is flagged unstable (pyperf uses 10%)."""


def fit_line(xs: list[float], ys: list[float], weights: list[float] | None = None) -> tuple[float, float]:
    """(Weighted) least squares ``y = a + b x``; when ``a < 0`` or ``b <= 0`` (noise), refit through the origin."""
    w = weights or [1.0] * len(xs)
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, xs)) / sw
    my = sum(wi * y for wi, y in zip(w, ys)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs))
    b = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, ys)) / sxx if sxx else 0.0
    a = my - b * mx
    if a < 0 or b <= 0:
        a, b = 0.0, sum(wi * x * y for wi, x, y in zip(w, xs, ys)) / sum(wi * x * x for wi, x in zip(w, xs))
    return a, b


def percentile(sorted_xs: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default, 'linear'), q in [0, 100]."""
    if not sorted_xs:
        raise ValueError("percentile of an empty sample")
    pos = (len(sorted_xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Stats:
    n: int
    median: float
    p10: float
    p90: float
    mean: float
    std: float
    """Sample standard deviation (n - 1); 0 for a single sample."""
    cv: float
    """std / mean."""

    @classmethod
    def of(cls, xs: list[float]) -> Stats:
        if not xs:
            raise ValueError("Stats.of needs at least one sample, got none")
        s = sorted(xs)
        mean = statistics.fmean(s)
        std = statistics.stdev(s) if len(s) > 1 else 0.0
        return cls(
            n=len(s),
            median=statistics.median(s),
            p10=percentile(s, 10),
            p90=percentile(s, 90),
            mean=mean,
            std=std,
            cv=std / mean if mean else math.inf,
        )

    def unstable_reason(self, limit: float = UNSTABLE_CV) -> str | None:
        """pyperf-style warning with its remedy, or None when stable."""
        if self.cv > limit:
            return f"unstable: CV {self.cv:.0%} > {limit:.0%}, rerun with more steps"
        return None

    def as_dict(self) -> dict:
        return asdict(self)
