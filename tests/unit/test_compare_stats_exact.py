"""The gate's statistics at their boundaries: options, the bootstrap as documented, the verdict edges."""

from __future__ import annotations

import math

import numpy as np
import pytest

from harness.compare import stats
from harness.compare.stats import CompareOptions
from harness.errors import UsageError


@pytest.mark.parametrize("kw", [{"threshold": 0.0}, {"threshold": 0.999}, {"alpha": 1e-9}, {"alpha": 0.999},
                                {"n_bootstrap": 100}, {"confidence": 1e-9}, {"confidence": 0.999},
                                {"normalize": "calibration"}])
def test_options_accept_their_edges(kw: dict) -> None:
    CompareOptions(**kw)


@pytest.mark.parametrize("kw, message", [
    ({"threshold": -0.01}, "--threshold (-0.01) must be in [0, 1); e.g. 0.05 for 5%"),
    ({"threshold": 1.0}, "--threshold (1.0) must be in [0, 1); e.g. 0.05 for 5%"),
    ({"alpha": 0.0}, "--alpha (0.0) must be in (0, 1); e.g. 0.05"),
    ({"alpha": 1.0}, "--alpha (1.0) must be in (0, 1); e.g. 0.05"),
    ({"alpha": 1.5}, "--alpha (1.5) must be in (0, 1); e.g. 0.05"),
    ({"n_bootstrap": 99}, "--bootstrap (99) must be >= 100; e.g. 2000"),
    ({"confidence": 0.0}, "confidence (0.0) must be in (0, 1); e.g. 0.95"),
    ({"confidence": 1.0}, "confidence (1.0) must be in (0, 1); e.g. 0.95"),
    ({"confidence": 1.5}, "confidence (1.5) must be in (0, 1); e.g. 0.95"),
    ({"normalize": "median"}, "--normalize ('median') must be one of none, calibration"),
])
def test_options_refuse_outside_with_the_range(kw: dict, message: str) -> None:
    with pytest.raises(UsageError) as e:
        CompareOptions(**kw)
    assert str(e.value) == message


def test_bootstrap_is_the_documented_two_sample_percentile_interval() -> None:
    base = np.array([10.0, 11.0, 9.0, 12.0, 10.5, 9.5])
    cand = np.array([9.0, 8.0, 10.0, 8.5, 9.5])
    # As the docstring says: default_rng(seed), base indices then cand indices, each uniform over
    # [0, n); percentile interval of the ratio of medians.
    rng = np.random.default_rng(7)
    bi = rng.integers(0, 6, size=(500, 6))
    ci = rng.integers(0, 5, size=(500, 5))
    ratios = np.median(cand[ci], axis=1) / np.median(base[bi], axis=1)
    for confidence in (0.95, 0.8):
        tail = (1 - confidence) / 2
        expected = tuple(np.quantile(ratios, [tail, 1 - tail]))
        assert stats.bootstrap_ratio_ci(base, cand, 500, 7, confidence) == pytest.approx(expected, rel=1e-12)
    assert stats.bootstrap_ratio_ci(base, cand, 500, 7) == stats.bootstrap_ratio_ci(base, cand, 500, 7, 0.95)
    assert stats.bootstrap_ratio_ci(base, cand, 500, 8) != stats.bootstrap_ratio_ci(base, cand, 500, 7)


def test_judge_samples_uses_the_options_seed_and_confidence() -> None:
    rng = np.random.default_rng(0)
    base, cand = 100 + rng.standard_normal(12), 97 + rng.standard_normal(12)
    opts = CompareOptions(seed=5, confidence=0.8, n_bootstrap=300)
    r = stats.judge_samples(base, cand, opts)
    assert (r.ci_low, r.ci_high) == stats.bootstrap_ratio_ci(base, cand, 300, 5, 0.8)
    assert r.p_value == stats.mannwhitney_less_p(base, cand) < 0.05


def test_mannwhitney_is_one_sided_cand_smaller() -> None:
    low, high = np.arange(10.0), np.arange(10.0) + 100
    assert stats.mannwhitney_less_p(base=high, cand=low) < 1e-3
    assert stats.mannwhitney_less_p(base=low, cand=high) > 0.999


@pytest.mark.parametrize("args, verdict, reason", [
    # ratio exactly at 1 - threshold is not slower "beyond" it
    ((0.95, 0.95, 0.97, 0.01), "PASS", "within +/-5% (ratio 0.950, CI [0.950, 0.970])"),
    # within the threshold, but the CI's low end is not: a slowdown beyond it not ruled out (either side of 1)
    ((0.95, 0.9, 0.97, 0.01), "INCONCLUSIVE",
     "ratio 0.950 but CI [0.900, 0.970] reaches below 0.950: a slowdown of up to 10.0% is not ruled out; "
     "rerun with more steps"),
    ((1.2, 0.7, 1.5, 0.9), "INCONCLUSIVE",
     "ratio 1.200 but CI [0.700, 1.500] reaches below 0.950: a slowdown of up to 30.0% is not ruled out; "
     "rerun with more steps"),
    ((0.963, 0.605, 1.107, 0.21), "INCONCLUSIVE",
     "ratio 0.963 but CI [0.605, 1.107] reaches below 0.950: a slowdown of up to 39.5% is not ruled out; "
     "rerun with more steps"),
    ((0.94, 0.9, 1.0, 0.01), "INCONCLUSIVE", "slower by 6.0% but CI [0.900, 1.000] crosses 1; rerun with more steps"),
    ((0.94, 0.9, 0.99, 0.05), "INCONCLUSIVE", "slower by 6.0% but MWU p=0.05 >= alpha 0.05; rerun with more steps"),
    ((0.94, 0.9, 0.99, 0.0499), "REGRESSION", "slower by 6.0% (CI [0.900, 0.990], MWU p=0.05)"),
    ((1.05, 1.01, 1.1, 0.9), "PASS", "within +/-5% (ratio 1.050, CI [1.010, 1.100])"),
    ((1.06, 1.0, 1.1, 0.9), "PASS", "faster by 6.0% but CI [1.000, 1.100] crosses 1"),
    ((1.06, 1.001, 1.1, 0.9), "IMPROVED", "faster by 6.0% (CI [1.001, 1.100])"),
    ((2.5, 2.2, 2.8, 0.9), "IMPROVED", "faster by 150.0% (CI [2.200, 2.800])"),
    ((1.0, 0.97, 1.03, 0.5), "PASS", "within +/-5% (ratio 1.000, CI [0.970, 1.030])"),
])
def test_decide_at_the_edges(args: tuple, verdict: str, reason: str) -> None:
    ratio, low, high, p = args
    assert stats.decide(ratio, low, high, p, 0.05, 0.05) == (verdict, reason)


def test_too_few_samples_keeps_the_medians_it_has() -> None:
    r = stats.judge_samples(np.array([1.0, 3.0]), np.array([]), CompareOptions())
    assert r.verdict == stats.TOO_FEW and (r.n_base, r.n_cand) == (2, 0)
    assert r.base_median == 2.0 and math.isnan(r.cand_median) and math.isnan(r.ratio)
    r = stats.judge_samples(np.array([]), np.array([4.0]), CompareOptions())
    assert math.isnan(r.base_median) and r.cand_median == 4.0
