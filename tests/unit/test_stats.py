"""Step statistics against numbers worked out by hand, and the unstable flag at realistic means.

The flag's threshold is written here (10%, pyperf's), not imported: loosening the product's
constant must fail this file.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from harness.measure.step_stats import Stats, fit_line, percentile

STEP_S = 0.05  # a realistic step: 50 ms


def _two_point(mean: float, cv: float, n: int = 10) -> list[float]:
    """n samples, half at mean - a and half at mean + a, with sample std = cv * mean exactly.

    Sample variance = n a^2 / (n - 1), so a = cv * mean * sqrt((n - 1) / n).
    """
    a = cv * mean * math.sqrt((n - 1) / n)
    return [mean - a] * (n // 2) + [mean + a] * (n // 2)


@pytest.mark.parametrize("cv, flagged", [(0.05, False), (0.099, False), (0.0999, False), (0.1001, True),
                                         (0.101, True), (0.15, True)])
def test_unstable_flag_switches_at_cv_10_percent_for_50ms_steps(cv: float, flagged: bool) -> None:
    s = Stats.of(_two_point(STEP_S, cv))
    assert s.mean == pytest.approx(STEP_S, rel=1e-12)
    assert s.cv == pytest.approx(cv, rel=1e-9)
    # std is 0.005 s or less here: a flag on std (not cv) would never fire at this mean.
    assert s.std == pytest.approx(cv * STEP_S, rel=1e-9)
    reason = s.unstable_reason()
    if flagged:
        assert reason == f"unstable: CV {cv:.0%} > 10%, rerun with more steps"
    else:
        assert reason is None


def test_unstable_flag_is_relative_not_absolute() -> None:
    # 20 s steps with a 1 s std: cv 5%, stable, although the std is far above 0.1.
    assert Stats.of(_two_point(20.0, 0.05)).unstable_reason() is None
    # 2 ms steps with a 0.3 ms std: cv 15%, unstable, although the std is tiny.
    assert Stats.of(_two_point(0.002, 0.15)).unstable_reason() == "unstable: CV 15% > 10%, rerun with more steps"


def test_unstable_limit_is_a_parameter() -> None:
    s = Stats.of(_two_point(STEP_S, 0.15))
    assert s.unstable_reason(limit=0.2) is None
    assert s.unstable_reason(limit=0.149) == "unstable: CV 15% > 15%, rerun with more steps"
    assert s.unstable_reason(limit=0.12) == "unstable: CV 15% > 12%, rerun with more steps"
    assert s.unstable_reason(limit=s.cv) is None  # the limit itself is still stable: CV must exceed it


def test_stats_of_realistic_steps_exact() -> None:
    xs = [0.052, 0.048, 0.050, 0.047, 0.053, 0.051]  # unsorted on purpose
    s = Stats.of(xs)
    assert s.n == 6
    assert s.median == pytest.approx(0.0505, rel=1e-12)  # (0.050 + 0.051) / 2
    assert s.mean == pytest.approx(0.0501666666666667, rel=1e-12)  # 0.301 / 6
    # Sample variance: squared deviations from the mean over n - 1 = 5.
    var = sum((x - 0.301 / 6) ** 2 for x in xs) / 5
    assert s.std == pytest.approx(math.sqrt(var), rel=1e-12)
    assert s.std == pytest.approx(0.0023166067138525404, rel=1e-9)
    assert s.cv == pytest.approx(0.0023166067138525404 / 0.0501666666666667, rel=1e-9)
    # numpy 'linear': position (n - 1) q / 100 in the sorted sample [47, 48, 50, 51, 52, 53] ms.
    assert s.p10 == pytest.approx(0.0475, rel=1e-12)  # pos 0.5: halfway 47 -> 48
    assert s.p90 == pytest.approx(0.0525, rel=1e-12)  # pos 4.5: halfway 52 -> 53
    assert s.p10 == pytest.approx(float(np.percentile(xs, 10)), rel=1e-12)
    assert s.as_dict() == {"n": 6, "median": s.median, "p10": s.p10, "p90": s.p90, "mean": s.mean,
                           "std": s.std, "cv": s.cv}


def test_single_sample_and_zero_mean() -> None:
    s = Stats.of([0.05])
    assert (s.n, s.median, s.p10, s.p90, s.mean, s.std, s.cv) == (1, 0.05, 0.05, 0.05, 0.05, 0.0, 0.0)
    assert s.unstable_reason() is None
    z = Stats.of([0.0, 0.0])
    assert z.std == 0.0 and z.cv == math.inf
    with pytest.raises(ValueError) as e:
        Stats.of([])
    assert str(e.value) == "Stats.of needs at least one sample, got none"
    two = Stats.of([1.0, 3.0])  # the smallest sample with a spread: deviations +-1 over n - 1 = 1
    assert (two.std, two.cv) == (pytest.approx(math.sqrt(2)), pytest.approx(math.sqrt(2) / 2))


def test_percentile_interpolates_linearly() -> None:
    xs = [10.0, 20.0, 30.0, 40.0, 50.0]
    assert percentile(xs, 0) == 10.0 and percentile(xs, 100) == 50.0
    assert percentile(xs, 50) == 30.0
    assert percentile(xs, 10) == pytest.approx(14.0)  # pos 0.4
    assert percentile(xs, 90) == pytest.approx(46.0)  # pos 3.6
    assert percentile(xs, 30) == pytest.approx(22.0)  # pos 1.2
    assert percentile([1.0, 3.0], 25) == pytest.approx(1.5)
    with pytest.raises(ValueError) as e:
        percentile([], 50)
    assert str(e.value) == "percentile of an empty sample"


def test_fit_line_exact() -> None:
    # y = 2 + 3x exactly.
    assert fit_line([1.0, 2.0, 3.0, 4.0], [5.0, 8.0, 11.0, 14.0]) == pytest.approx((2.0, 3.0))
    # Unweighted least squares on (0,1), (1,2), (2,4): slope 1.5, intercept 5/6.
    a, b = fit_line([0.0, 1.0, 2.0], [1.0, 2.0, 4.0])
    assert (a, b) == pytest.approx((5 / 6, 1.5))
    # Weights pull the line towards the heavy points: (0,1) and (1,2) weigh 1, (2,4) weighs 4.
    # weighted means x 9/6 = 1.5, y 19/6; Sxx = 2.25 + 0.25 + 0.25 * 4 = 3.5;
    # Sxy = (-1.5)(1 - 19/6) + (-0.5)(2 - 19/6) + 4 (0.5)(4 - 19/6) = 3.25 + 7/12 + 5/3 = 5.5.
    a, b = fit_line([0.0, 1.0, 2.0], [1.0, 2.0, 4.0], weights=[1.0, 1.0, 4.0])
    assert b == pytest.approx(5.5 / 3.5)
    assert a == pytest.approx(19 / 6 - 1.5 * 5.5 / 3.5)


def test_fit_line_refits_through_the_origin_on_noise() -> None:
    # A negative intercept (y = -1 + 2x) is noise for a cost model: refit y = b x,
    # b = sum(xy) / sum(x^2) = (1*1 + 2*3 + 3*5) / (1 + 4 + 9) = 22 / 14.
    assert fit_line([1.0, 2.0, 3.0], [1.0, 3.0, 5.0]) == pytest.approx((0.0, 22 / 14))
    # A falling line (b < 0): the same refit. sum(xy) = 3 + 4 + 3 = 10, sum(x^2) = 14.
    assert fit_line([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == pytest.approx((0.0, 10 / 14))
    # A flat line (b == 0) is refit too: sum(xy) = 12, sum(x^2) = 14.
    assert fit_line([1.0, 2.0, 3.0], [2.0, 2.0, 2.0]) == pytest.approx((0.0, 12 / 14))
    # One distinct x: Sxx = 0, slope 0, then the origin refit: (2*4 + 2*6) / (4 + 4) = 2.5.
    assert fit_line([2.0, 2.0], [4.0, 6.0]) == pytest.approx((0.0, 2.5))
    # Weighted origin refit: (1*1*1 + 9*3*5) / (1*1 + 9*9) with weights 1 and 9 on x = 1, 3.
    assert fit_line([1.0, 3.0], [1.0, 5.0], weights=[1.0, 9.0])[1] == pytest.approx((1 + 135) / (1 + 81))
