"""The pure parts of ``--rounds``: each round's order, the median round, its interval, ties, the state file."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from harness.errors import UsageError
from harness.measure.intervals import median_interval, overlaps
from harness.report.ties import tied_with
from harness.run.rounds import RoundsPlan, RoundState, median_round, recorded_rounds, round_order, summary

IDS = ["a", "b", "c", "d", "e"]


def test_rotate_moves_the_first_cell_last_each_round():
    plan = RoundsPlan(n=3, order="rotate")
    assert round_order(IDS, 0, plan) == IDS
    assert round_order(IDS, 1, plan) == ["b", "c", "d", "e", "a"]
    assert round_order(IDS, 5, plan) == IDS


def test_shuffle_is_seeded_differs_between_rounds_and_keeps_every_cell():
    plan = RoundsPlan(n=5, order="shuffle", seed=7)
    orders = [round_order(IDS, k, plan) for k in range(5)]
    assert all(sorted(o) == IDS for o in orders)
    assert len({tuple(o) for o in orders}) > 1
    assert orders == [round_order(IDS, k, RoundsPlan(n=5, order="shuffle", seed=7)) for k in range(5)]
    assert orders != [round_order(IDS, k, RoundsPlan(n=5, order="shuffle", seed=8)) for k in range(5)]


def test_median_round_is_the_middle_one_and_the_lower_middle_when_even():
    assert median_round([3.0, 1.0, 2.0]) == 2
    assert median_round([4.0, 1.0, 3.0, 2.0]) == 3  # sorted 1,2,3,4: lower middle is 2.0, round index 3


def test_median_interval_uses_the_narrowest_order_statistics_with_60_percent_coverage():
    lo, hi, cov = median_interval([5.0, 1.0, 4.0, 2.0, 3.0])  # n=5: (x2, x4) covers 62.5%
    assert (lo, hi) == (2.0, 4.0) and cov == pytest.approx(0.625)
    lo, hi, cov = median_interval([float(x) for x in range(1, 11)])  # n=10: (x4, x7) 65.6%, (x5, x6) 24.6%
    assert (lo, hi) == (4.0, 7.0) and cov == pytest.approx(1 - 2 * 176 / 1024)
    lo, hi, cov = median_interval([2.0, 1.0, 3.0])  # n=3: only the full range, its coverage said
    assert (lo, hi) == (1.0, 3.0) and cov == pytest.approx(0.75)
    lo, hi, _ = median_interval([0.881, 0.049, 0.058, 0.050, 0.050])  # one disturbed round of five
    assert (lo, hi) == (0.050, 0.058), "one disturbed round does not widen the interval"
    lo, hi, cov = median_interval([1.0, 2.0, 3.0, 4.0, 5.0], coverage=0.9)
    assert (lo, hi, cov) == (1.0, 5.0, 0.9375)


def test_summary_spread_is_half_the_interval_as_percent_of_the_median():
    s = summary([0.9, 1.0, 1.1, 1.05, 0.95], RoundsPlan(n=5))
    assert s["ci_s"] == [0.95, 1.05] and s["spread_pct"] == pytest.approx(5.0) and s["ci_coverage"] == 0.625
    assert s["medians_s"][s["chosen"]] == 1.0


def test_bad_plans_are_refused_with_the_value():
    with pytest.raises(UsageError, match="--rounds 0"):
        RoundsPlan(n=0)
    with pytest.raises(UsageError, match="'zigzag'"):
        RoundsPlan(n=2, order="zigzag")


def test_state_is_kept_across_a_resume_and_refuses_another_plan(tmp_path):
    plan = RoundsPlan(n=3, order="rotate", seed=1)
    st = RoundState.open(tmp_path, plan, resume=False)
    st.add("a", 0, {"status": "ok", "median_s": 1.0})
    st.add("b", 0, {"status": "crashed", "median_s": None})
    again = RoundState.open(tmp_path, plan, resume=True)
    assert again.has("a", 0) and not again.has("a", 1)
    assert again.failed("b") and not again.failed("a")
    assert recorded_rounds(tmp_path) == plan
    with pytest.raises(UsageError, match="--rounds 3 --round-order rotate"):
        RoundState.open(tmp_path, RoundsPlan(n=5, order="rotate", seed=1), resume=True)


def _row(name, tps, median, lo, hi):
    return {"cell_id": name, "status": "ok", "tokens_per_s_per_device": tps, "step_time_median_s": median,
            "round_ci_low_s": lo, "round_ci_high_s": hi, "round_spread_pct": 100 * (hi - lo) / 2 / median}


def test_overlapping_intervals_are_a_tie_and_disjoint_ones_are_not():
    assert overlaps((1.0, 2.0), (2.0, 3.0)) and not overlaps((1.0, 1.9), (2.0, 3.0))
    df = pd.DataFrame([_row("fast", 1000.0, 1.00, 0.97, 1.03), _row("near", 990.0, 1.01, 0.99, 1.05),
                       _row("slow", 800.0, 1.25, 1.20, 1.30)])
    assert list(tied_with(df, df.iloc[0])["cell_id"]) == ["near"]
    no_rounds = df.assign(round_ci_low_s=math.nan, round_ci_high_s=math.nan)
    assert tied_with(no_rounds, no_rounds.iloc[0]).empty, "without rounds there is no interval, so no tie"


def test_a_tie_across_world_sizes_is_judged_on_tokens_per_device():
    # same step interval, but the second cell moves half the tokens per device: twice slower, no tie
    df = pd.DataFrame([_row("one", 1000.0, 1.0, 0.95, 1.05), _row("two", 500.0, 1.0, 0.95, 1.05)])
    assert tied_with(df, df.iloc[0]).empty


def test_diff_gives_each_round_alone_beside_the_median_of_rounds():
    from harness.compare.run_diff import CellDiff, RunDiff, round_spread_pct
    from harness.compare.stats import PairResult

    def rec(medians):
        return {"status": "ok", "metrics": {"rounds": {"medians_s": medians}}}

    diff = RunDiff([CellDiff("x", rec([1.0, 2.0, 1.0]), rec([1.1, 1.0, 1.0]), PairResult("PASS", "")),
                    CellDiff("y", rec([1.0, 1.0, 1.0]), rec([1.3, 1.0, 2.0]), PairResult("PASS", ""))], [], [])
    rows = round_spread_pct(diff)
    assert [(k, n) for k, n, _, _ in rows] == [(1, 2), (2, 2), (3, 2)]
    assert rows[0][2] == pytest.approx(20.0) and rows[1][2] == pytest.approx(25.0) and rows[2][3] == pytest.approx(50.0)
    assert round_spread_pct(RunDiff([CellDiff("z", {"status": "ok", "metrics": {}}, rec([1.0]),
                                              PairResult("PASS", ""))], [], [])) == []
