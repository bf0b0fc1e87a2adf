"""Step (change-point) detection in a series of per-run values, pure and seeded.

Binary segmentation on a rank statistic, each split kept only if a permutation test says it is
not noise:

* the score of a split at position k is the standardised Mann-Whitney rank-sum of the first k runs
  against the rest, ``|W - k(n+1)/2| / sqrt(k(n-k)(n+1)/12)`` (Pettitt's change-point test,
  1979, normalised per position so that edge splits are not favoured). Ranks make it immune to a
  single slow run, and it keeps about 95% of the t-test's power on Gaussian noise, where the L1
  cost about asv's medians keeps about 64% (measured: ``scripts/history_power.py``);
* the best split of a segment (each side at least ``min_size`` runs) is the one with the largest
  score; its significance is the share of ``n_permutations`` random reorderings of the segment
  whose best split scores as high (the permutation test of E-divisive / hunter change-point
  detection, Matteson & James 2014; Fleming et al., ICPE 2020), so the search over split
  positions is paid for;
* a split with p < ``alpha`` and a shift of at least ``min_shift`` (ratio of medians after /
  before) is a change point; both sides are then searched again. ``min_shift`` is what keeps
  unchanged series quiet: a random split of 20 runs at CV 10% rarely moves the median by 8%.

``detect_steps`` returns the change points in order; each names the first run after the shift,
its size (ratio of medians of the neighbouring segments) and confidence (1 - p).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harness.errors import UsageError


@dataclass(frozen=True)
class ChangePoint:
    index: int
    """Position of the first run after the shift."""
    before_median: float
    after_median: float
    ratio: float
    """after / before (median of the segments on either side, up to the neighbouring change points)."""
    p_value: float

    @property
    def confidence(self) -> float:
        return 1.0 - self.p_value


def _split_scores(x: np.ndarray, min_size: int) -> np.ndarray:
    """Standardised rank-sum score of every admissible split of each row of ``x`` (rows: series),
    shape (rows, splits); ties are impossible in timings and broken by order if present."""
    n = x.shape[1]
    ranks = np.argsort(np.argsort(x, axis=1, kind="stable"), axis=1) + 1.0
    k = np.arange(min_size, n - min_size + 1)
    w = np.cumsum(ranks, axis=1)[:, k - 1]
    return np.abs(w - k * (n + 1) / 2.0) / np.sqrt(k * (n - k) * (n + 1) / 12.0)


def _l1_gains(x: np.ndarray, min_size: int) -> np.ndarray:
    """Decrease of the L1 cost (absolute deviations from the segment medians) of every admissible
    split of the 1-D segment ``x``."""
    total = np.abs(x - np.median(x)).sum()
    return np.array([total - np.abs(x[:k] - np.median(x[:k])).sum() - np.abs(x[k:] - np.median(x[k:])).sum()
                     for k in range(min_size, len(x) - min_size + 1)])


def best_split(x: np.ndarray, min_size: int, n_permutations: int, rng: np.random.Generator) -> tuple[int, float]:
    """(split position, permutation p-value) of one segment ``x``: whether it changes at all is the
    rank score's test; where is the L1 cost's answer (ranks blur a staircase whose levels are quieter
    than the steps between them, magnitudes do not)."""
    observed = _split_scores(x[None, :], min_size)[0].max()
    perms = np.stack([rng.permutation(x) for _ in range(n_permutations)])
    null = _split_scores(perms, min_size).max(axis=1)
    p = (1.0 + float(np.sum(null >= observed - 1e-12))) / (1.0 + n_permutations)
    return int(np.argmax(_l1_gains(x, min_size))) + min_size, p


def detect_steps(values: np.ndarray | list[float], alpha: float = 0.01, min_shift: float = 0.05, min_size: int = 3,
                 n_permutations: int = 1999, seed: int = 0) -> list[ChangePoint]:
    """Change points of a positive series (e.g. tokens/s per run), in order (module doc)."""
    x = np.asarray(values, dtype=float)
    if np.any(~np.isfinite(x)) or np.any(x <= 0):
        raise UsageError("history values must be finite and > 0 (throughput per run); a record is corrupt")
    if not 0.0 < alpha < 1.0:
        raise UsageError(f"alpha ({alpha}) must be in (0, 1); e.g. 0.01")
    if min_size < 2:
        raise UsageError(f"min_size ({min_size}) must be >= 2 runs per segment")
    logs = np.log(x)
    rng = np.random.default_rng(seed)
    cuts: list[tuple[int, float]] = []
    pending = [(0, len(x))]
    while pending:
        lo, hi = pending.pop()
        if hi - lo < 2 * min_size:
            continue
        k, p = best_split(logs[lo:hi], min_size, n_permutations, rng)
        shift = abs(np.exp(np.median(logs[lo + k:hi]) - np.median(logs[lo:lo + k])) - 1.0)
        if p < alpha and shift >= min_shift:
            cuts.append((lo + k, p))
            pending += [(lo, lo + k), (lo + k, hi)]
    cuts.sort()
    bounds = [0, *[c for c, _ in cuts], len(x)]
    out = []
    for i, (cut, p) in enumerate(cuts):
        before, after = x[bounds[i]:cut], x[cut:bounds[i + 2]]
        b, a = float(np.median(before)), float(np.median(after))
        out.append(ChangePoint(index=cut, before_median=b, after_median=a, ratio=a / b, p_value=p))
    return out
