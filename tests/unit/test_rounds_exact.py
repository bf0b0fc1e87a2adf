"""Exact values for the corners of ``--rounds`` (issue 44): the median's interval at its edges, the tie rule's
missing values, the rounds state file, and one block matmul's FLOPs under tp.

Expected values come from outside the code under test: binomial coverages worked by hand (``1 - 2 P(X <= j-1)``,
``X ~ Binomial(n, 1/2)``, the sums written out in the comments), intervals drawn on paper, and the model's own
``nn.Linear`` names read from ``workloads.model.Decoder``.
"""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch.nn as nn

from harness.errors import UsageError
from harness.measure.intervals import median_interval, median_spread, overlaps
from harness.model.block_ops import Matmul, fp8_linears
from harness.report.ties import interval, spread_text, tied_with
from harness.run.rounds import STATE_FILE, RoundsPlan, RoundState, recorded_rounds, summary
from workloads.model import Decoder
from workloads.sizes import get_size


def test_median_interval_at_its_edges():
    with pytest.raises(ValueError, match="^median_interval of no values$"):
        median_interval([])
    # n=2: (x1, x2) covers 1 - 2 * 1/4 = 0.5, short of 60%, so the full range with its own coverage
    assert median_interval([2.0, 1.0]) == (1.0, 2.0, 0.5)
    # n=1: the value itself, covering 1 - 2 * 1/2 = 0
    assert median_interval([3.0]) == (3.0, 3.0, 0.0)
    # n=5, (x2, x4) covers 1 - 2 * (1 + 5)/32 = 0.625 exactly: asking for exactly that is met, not missed
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0], coverage=0.625) == (2.0, 4.0, 0.625)
    # asking for no coverage still stops at the middle pair (x2, x4) of 5: j runs to n // 2 only
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0], coverage=0.0) == (2.0, 4.0, 0.625)


def test_overlap_is_shared_points_in_either_order():
    assert overlaps((1.0, 5.0), (2.0, 3.0)), "one interval inside the other"
    assert overlaps((2.0, 3.0), (1.0, 5.0))
    assert overlaps((2.0, 3.0), (1.0, 2.0)), "touching at one end"
    assert not overlaps((2.0, 3.0), (0.5, 1.5)) and not overlaps((0.5, 1.5), (2.0, 3.0))


def test_median_spread_reads_every_field_and_takes_the_coverage_asked():
    # 0.9 of 5 values needs j=1: (x1, x5), 1 - 2/32 = 0.9375; half-width 2.0 over the median 3.0
    assert median_spread([5.0, 1.0, 3.0, 2.0, 4.0], coverage=0.9) == {
        "median": 3.0, "low": 1.0, "high": 5.0, "coverage": 0.9375, "spread_pct": pytest.approx(100 * 2.0 / 3.0)}
    spread = median_spread([-1.0, 0.0, 1.0])
    assert spread["median"] == 0.0 and math.isnan(spread["spread_pct"]), "no % of a zero median"


def test_a_rounds_summary_holds_every_field():
    # n=9: j=3 covers 1 - 2 * (1 + 9 + 36)/512 = 0.8203125, kept to 4 places
    medians = [1.0, 1.4, 1.2, 0.9, 1.1, 1.3, 0.8, 1.5, 1.6]
    plan = RoundsPlan(n=9, order="shuffle", seed=7)
    assert summary(medians, plan) == {
        "n": 9, "order": "shuffle", "seed": 7, "medians_s": medians, "chosen": 2, "ci_s": [1.0, 1.4],
        "ci_coverage": 0.8203, "spread_pct": pytest.approx(100 * 0.2 / 1.2)}


def test_the_round_order_error_names_every_choice():
    with pytest.raises(UsageError, match=r"--round-order 'zigzag': must be one of shuffle, rotate$"):
        RoundsPlan(n=2, order="zigzag")


def test_a_fresh_state_ignores_an_old_file_and_a_resumed_one_keeps_its_path_and_plan(tmp_path):
    plan = RoundsPlan(n=3, order="rotate", seed=1)
    assert recorded_rounds(tmp_path) is None, "no file: nothing recorded"
    old = RoundState.open(tmp_path, plan, resume=False)
    old.add("b", 2, {"status": "ok", "median_s": 1.2})
    old.add("b", 0, {"status": "ok", "median_s": 1.0})
    # another plan without --resume: a fresh state, the old file not read (and not refused)
    fresh = RoundState.open(tmp_path, RoundsPlan(n=5, order="shuffle", seed=2), resume=False)
    assert fresh.done == {} and not fresh.has("b", 0)
    again = RoundState.open(tmp_path, plan, resume=True)
    assert again.path == tmp_path / STATE_FILE and again.plan == plan
    assert list(again.rounds_of("b")) == [0, 2], "rounds in order, whatever order they finished in"
    assert again.rounds_of("b")[2]["median_s"] == 1.2
    assert again.rounds_of("nobody") == {} and not again.has("nobody", 0) and not again.failed("nobody")


def _row(status: str, tps: float, median: float, lo: float | None, hi: float | None) -> dict:
    return {"status": status, "tokens_per_s_per_device": tps, "step_time_median_s": median,
            "round_ci_low_s": lo, "round_ci_high_s": hi, "round_spread_pct": math.nan}


def test_an_interval_needs_both_ends():
    for lo, hi in ((None, 1.0), (1.0, None), (math.nan, 1.0), (1.0, math.nan)):
        assert interval(pd.Series(_row("ok", 1.0, 1.0, lo, hi))) is None, (lo, hi)
    assert interval(pd.Series(_row("ok", 1.0, 1.0, 0.9, 1.1))) == (0.9, 1.1)


def test_ties_skip_failed_cells_and_scale_both_ends():
    # by hand: the second row moves tokens at 961.5/s/dev over 0.52 s, so its step is worth
    # 1000 * 1.0 / (961.5 * 0.52) = 2.0 of the best row's: its interval (0.5, 0.55) becomes (1.0, 1.1), which
    # touches the best's (0.95, 1.05). The crashed row's interval overlaps too, but it is not a result.
    tps = 1000.0 / (2 * 0.52)
    df = pd.DataFrame([_row("ok", 1000.0, 1.0, 0.95, 1.05), _row("ok", tps, 0.52, 0.5, 0.55),
                       _row("crashed", 1000.0, 1.0, 0.95, 1.05)])
    assert list(tied_with(df, df.iloc[0]).index) == [1]


def test_spread_text_is_empty_without_rounds():
    assert spread_text(pd.Series({"round_spread_pct": math.nan})) == ""
    assert spread_text(pd.Series({"other": 1.0})) == ""
    assert spread_text(pd.Series({"round_spread_pct": 3.14})) == " ± 3.1%"


def test_a_matmuls_flops_under_tp():
    # 2 FLOPs per multiply-add: 2 * rows * k * n, split over tp unless replicated (the router)
    for split, expected in (("column", 2 * 0.5 * 64 * 96 / 4), ("row", 2 * 0.5 * 64 * 96 / 4),
                            ("replicated", 2 * 0.5 * 64 * 96)):
        assert Matmul("m", k=64, n=96, rows=0.5, split=split).flops(4) == expected, split


@pytest.mark.parametrize("arch", ["gpt2", "llama3", "moe"])
def test_fp8_linears_are_the_models_own_linear_names(arch):
    """The expected names are the model's: every name fp8_linears gives is an nn.Linear in Decoder."""
    size = get_size("tiny", arch)
    linears = {n for n, m in Decoder(size).named_modules() if isinstance(m, nn.Linear)}
    names = fp8_linears(size)
    assert names and set(names) <= linears, sorted(set(names) - linears)
