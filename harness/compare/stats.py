"""The gate's statistics, pure: ratio of medians, its bootstrap CI, Mann-Whitney U, the verdict.

Tested against exact numbers; nothing here reads records or prints.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from harness.errors import UsageError

PASS = "PASS"
IMPROVED = "IMPROVED"
INCONCLUSIVE = "INCONCLUSIVE"
REGRESSION = "REGRESSION"
NOT_COMPARABLE = "NOT COMPARABLE"
MISSING = "MISSING"
TOO_FEW = "TOO FEW SAMPLES"
SKIPPED = "SKIPPED"
UNCHANGED_FAILURES = ("invalid", "oom")
"""Statuses that, identical on both sides, mean "not measurable here", not a change."""
CANNOT_JUDGE = (NOT_COMPARABLE, MISSING, TOO_FEW)
MIN_SAMPLES = 5
NORMALIZE_CHOICES = ("none", "calibration")


@dataclass(frozen=True)
class CompareOptions:
    """Knobs of the gate; validated at construction."""

    threshold: float = 0.05
    """Relative change that matters: REGRESSION needs ratio < 1 - threshold."""
    alpha: float = 0.05
    """Significance level for the one-sided Mann-Whitney U test."""
    n_bootstrap: int = 2000
    """Bootstrap resamples for the CI of the ratio of medians."""
    seed: int = 0
    """Seed of the bootstrap generator, so a verdict is reproducible."""
    confidence: float = 0.95
    """Two-sided confidence level of the bootstrap interval."""
    normalize: str = "none"
    """``calibration`` divides each cell's throughput by the machine's matmul throughput around it
    (:mod:`harness.compare.cell_normaliser`)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold < 1.0:
            raise UsageError(f"--threshold ({self.threshold}) must be in [0, 1); e.g. 0.05 for 5%")
        if not 0.0 < self.alpha < 1.0:
            raise UsageError(f"--alpha ({self.alpha}) must be in (0, 1); e.g. 0.05")
        if self.n_bootstrap < 100:
            raise UsageError(f"--bootstrap ({self.n_bootstrap}) must be >= 100; e.g. 2000")
        if not 0.0 < self.confidence < 1.0:
            raise UsageError(f"confidence ({self.confidence}) must be in (0, 1); e.g. 0.95")
        if self.normalize not in NORMALIZE_CHOICES:
            raise UsageError(
                f"--normalize ({self.normalize!r}) must be one of {', '.join(NORMALIZE_CHOICES)}"
            )


@dataclass(frozen=True)
class PairResult:
    """Outcome of one base/cand pair; throughputs in tokens/s (ops/s for benchmark JSON)."""

    verdict: str
    reason: str
    base_median: float = float("nan")
    cand_median: float = float("nan")
    ratio: float = float("nan")
    ci_low: float = float("nan")
    ci_high: float = float("nan")
    p_value: float = float("nan")
    n_base: int = 0
    n_cand: int = 0


def median_ratio(base: np.ndarray, cand: np.ndarray) -> float:
    """Ratio of medians ``median(cand) / median(base)``; < 1 means the candidate is slower."""
    return float(np.median(cand) / np.median(base))


def bootstrap_ratio_ci(
    base: np.ndarray, cand: np.ndarray, n_resamples: int, seed: int, confidence: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap CI of ``median(cand*) / median(base*)``.

    Each side is resampled with replacement independently (two-sample bootstrap),
    ``n_resamples`` times with ``numpy.random.default_rng(seed)``; the interval is the
    ``(1 - confidence) / 2`` and ``(1 + confidence) / 2`` quantiles of the resampled ratios.
    """
    rng = np.random.default_rng(seed)
    base_idx = rng.integers(0, len(base), size=(n_resamples, len(base)))
    cand_idx = rng.integers(0, len(cand), size=(n_resamples, len(cand)))
    ratios = np.median(cand[cand_idx], axis=1) / np.median(base[base_idx], axis=1)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(ratios, [tail, 1.0 - tail])
    return float(low), float(high)


def mannwhitney_less_p(base: np.ndarray, cand: np.ndarray) -> float:
    """One-sided Mann-Whitney U p-value for H1: cand is stochastically smaller than base."""
    from scipy.stats import mannwhitneyu  # noqa: PLC0415  (heavy: scipy only when a gate runs)

    return float(mannwhitneyu(cand, base, alternative="less").pvalue)


def decide(
    ratio: float, ci_low: float, ci_high: float, p_value: float, threshold: float, alpha: float
) -> tuple[str, str]:
    """Verdict and reason from the ratio of medians, its CI and the MWU p-value.

    REGRESSION: ratio < 1 - threshold, CI high < 1 and p < alpha. INCONCLUSIVE: ratio <
    1 - threshold otherwise. IMPROVED: ratio > 1 + threshold and CI low > 1. INCONCLUSIVE too where
    the ratio is not slower beyond the threshold but the CI's low end is: a slowdown past the threshold is
    not ruled out (a 40% slower candidate measured at 0.937, CI [0.605, 1.107], on a machine that slowed
    down mid-gate). Else PASS: no slowdown beyond the threshold within the CI.
    """
    change = f"{abs(1.0 - ratio):.1%}"
    ci = f"CI [{ci_low:.3f}, {ci_high:.3f}]"
    if ratio < 1.0 - threshold:
        if ci_high < 1.0 and p_value < alpha:
            return REGRESSION, f"slower by {change} ({ci}, MWU p={p_value:.2g})"
        why = f"{ci} crosses 1" if ci_high >= 1.0 else f"MWU p={p_value:.2g} >= alpha {alpha}"
        return INCONCLUSIVE, f"slower by {change} but {why}; rerun with more steps"
    if ratio > 1.0 + threshold and ci_low > 1.0:
        return IMPROVED, f"faster by {change} ({ci})"
    if ci_low < 1.0 - threshold:
        return INCONCLUSIVE, (f"ratio {ratio:.3f} but {ci} reaches below {1.0 - threshold:.3f}: a slowdown of up "
                              f"to {1.0 - ci_low:.1%} is not ruled out; rerun with more steps")
    if ratio > 1.0 + threshold:
        return PASS, f"faster by {change} but {ci} crosses 1"
    return PASS, f"within +/-{threshold:.0%} (ratio {ratio:.3f}, {ci})"


def judge_samples(
    base: np.ndarray, cand: np.ndarray, opts: CompareOptions, ci_factor: float = 1.0
) -> PairResult:
    """Compare two arrays of per-step throughput samples (higher is better).

    ``ci_factor`` (>= 1) widens the bootstrap CI to ``[low / ci_factor, high * ci_factor]``
    before the verdict: the uncertainty of what the samples were divided by
    (:mod:`harness.compare.cell_normaliser`), which resampling the steps cannot see.
    """
    if not ci_factor >= 1.0:
        raise UsageError(f"ci_factor ({ci_factor}) must be >= 1; it widens the CI, 1 leaves it as is")
    n_base, n_cand = len(base), len(cand)
    medians = {
        "base_median": float(np.median(base)) if n_base else float("nan"),
        "cand_median": float(np.median(cand)) if n_cand else float("nan"),
    }
    if min(n_base, n_cand) < MIN_SAMPLES:
        reason = (
            f"{n_base} base and {n_cand} cand samples, need >= {MIN_SAMPLES} per side; "
            "rerun with more measured steps"
        )
        return PairResult(TOO_FEW, reason, n_base=n_base, n_cand=n_cand, **medians)
    ratio = median_ratio(base, cand)
    low, high = bootstrap_ratio_ci(base, cand, opts.n_bootstrap, opts.seed, opts.confidence)
    low, high = low / ci_factor, high * ci_factor
    p_value = mannwhitney_less_p(base, cand)
    verdict, reason = decide(ratio, low, high, p_value, opts.threshold, opts.alpha)
    return PairResult(verdict, reason, ratio=ratio, ci_low=low, ci_high=high,
                      p_value=p_value, n_base=n_base, n_cand=n_cand, **medians)


def withhold_change(result: PairResult, notes: list[str]) -> PairResult:
    """A change that a side's own measurement cannot support is no change: IMPROVED or REGRESSION
    becomes INCONCLUSIVE, its reason followed by ``but`` and the notes (a side flagged unstable,
    an unsteady normaliser). Any other verdict keeps, the notes appended to its reason."""
    if not notes:
        return result
    if result.verdict in (IMPROVED, REGRESSION):
        return replace(result, verdict=INCONCLUSIVE, reason=f"{result.reason} but " + "; ".join(notes))
    return replace(result, reason="; ".join([result.reason, *notes]))
