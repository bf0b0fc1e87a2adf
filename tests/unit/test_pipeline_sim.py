"""The bubble played out from each schedule's action list, against the published formula where one exists.

Expected values from outside the code: Narayanan et al. 2021 (Megatron-LM, SC'21), the bubble fraction of
GPipe and 1F1B is (p - 1) / m, and of the interleaved schedule with v stages per rank (p - 1) / (v m), for
equal stages and free transfers; written here, not imported.
"""

from __future__ import annotations

import pytest

from harness.errors import UsageError
from harness.model.pipeline_sim import ActionTimes, live_peak, schedule_bubble, schedule_order, simulate


@pytest.mark.parametrize("pp, m", [(2, 2), (2, 4), (4, 4), (4, 8), (8, 16)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_one_stage_per_rank_schedules_equal_the_formula_on_every_rank(schedule, pp, m):
    for times in (ActionTimes(), ActionTimes(f=1.0, i=1.5, w=0.5)):  # the formula holds for any F:B ratio
        bubbles = simulate(schedule, pp, m, times)
        assert [b.fraction for b in bubbles] == pytest.approx([(pp - 1) / m] * pp)


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 16)])
def test_interleaved_1f1b_from_torchs_own_action_list_equals_the_formula(pp, m):
    assert schedule_bubble("interleaved1f1b", pp, m) == pytest.approx((pp - 1) / (2 * m))


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 16)])
@pytest.mark.parametrize("schedule", ["zb", "zbv", "dualpipev"])
def test_zero_bubble_fills_most_of_interleaved_1f1bs_bubble_with_weight_gradients(schedule, pp, m):
    zb, interleaved = schedule_bubble(schedule, pp, m), schedule_bubble("interleaved1f1b", pp, m)
    assert 0 <= zb < interleaved / 2, (zb, interleaved)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_the_v_schedules_run_each_ranks_two_stages_of_the_v(schedule):
    """Rank r runs stages r and 2 pp - 1 - r; DualPipeV's overlapped forward-and-backward pairs are both run."""
    pp, m = 4, 8
    for rank, actions in schedule_order(schedule, pp, m).items():
        assert {s for _, s, _ in actions} == {rank, 2 * pp - 1 - rank}
        for stage in (rank, 2 * pp - 1 - rank):
            forwards = [mb for k, s, mb in actions if k == "F" and s == stage]
            assert sorted(forwards) == list(range(m)), (rank, stage)
            backward = sum(2 if k == "B" else 1 for k, s, _ in actions if s == stage and k in "BIW")
            assert backward == 2 * m, (rank, stage)  # each microbatch's I and W, or one B standing for both


def test_zb_splits_every_backward_and_runs_each_weight_gradient_after_its_input_gradient():
    order = schedule_order("zb", 2, 4)
    for actions in order.values():
        kinds = [k for k, _, _ in actions]
        assert kinds.count("F") == kinds.count("I") == kinds.count("W") == 2 * 4 and "B" not in kinds
        pos = {(k, s, m): i for i, (k, s, m) in enumerate(actions)}
        assert all(pos[("W", s, m)] > pos[("I", s, m)] for k, s, m in actions if k == "W")


def test_busy_time_is_the_work_of_the_ranks_stages():
    """Each rank computes m microbatches of F, I and W on each of its stages, whatever the order."""
    times = ActionTimes(f=1.0, i=2.0, w=3.0)
    for schedule, v in (("1f1b", 1), ("interleaved1f1b", 2), ("zb", 2), ("zbv", 2), ("dualpipev", 2)):
        assert [b.busy for b in simulate(schedule, 2, 4, times)] == [v * 4 * 6.0] * 2


def test_an_unknown_schedule_is_refused():
    with pytest.raises(UsageError, match="unknown pipeline schedule 'zbx'"):
        simulate("zbx", 2, 4)


# ---- memory: the activations a rank holds in flight, from the same action list ----

def _chunks_in_flight(schedule: str, pp: int, m: int) -> list[float]:
    """Each rank's most stage-microbatches held at once, one unit each, nothing held for W."""
    order = schedule_order(schedule, pp, m)
    stages = range(2 * pp)
    return [live_peak(order[r], dict.fromkeys(stages, 1.0), dict.fromkeys(stages, 0.0)) for r in range(pp)]


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_one_stage_per_rank_schedules_hold_what_their_papers_say(pp, m):
    """GPipe holds every microbatch (Huang et al. 2019); 1F1B's rank r holds ``pp - r`` (Narayanan et al. 2021)."""
    assert _chunks_in_flight("gpipe", pp, m) == [m] * pp
    assert _chunks_in_flight("1f1b", pp, m) == [pp - r for r in range(pp)]


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_interleaved_1f1b_holds_korthikantis_factor_more_than_1f1b_on_the_first_rank(pp, m):
    """Korthikanti et al. 2022 (sec. 4.2.3): the interleaved schedule's first stage holds ``1 + (p - 1) / (p v)``
    times 1F1B's ``p`` microbatches of activations; with v = 2 chunks of half a rank's layers each, that is
    ``p v (1 + (p - 1) / (p v)) = p v + p - 1`` chunks. Each later rank holds two chunks fewer (torch's warmup)."""
    v = 2
    assert _chunks_in_flight("interleaved1f1b", pp, m) == [pp * v + pp - 1 - 2 * r for r in range(pp)]


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 16)])
def test_zbv_holds_1f1bs_first_rank_activations_on_every_rank(pp, m):
    """Qi et al. 2023 (ZB-V): the V schedule's peak activation memory equals 1F1B's, ``p`` microbatches of a rank's
    layers: ``2 p`` chunks of half of them, on every rank (the V balances it)."""
    assert _chunks_in_flight("zbv", pp, m) == [2 * pp] * pp


def test_a_split_backward_holds_its_microbatch_until_the_weight_gradient_step():
    """By hand: F0 keeps 1, I0 holds 0.5 more for its W, F1 keeps 1 (2.5 live), W0 frees 1.5, I1 and W1 the rest."""
    order = (("F", 0, 0), ("I", 0, 0), ("F", 0, 1), ("W", 0, 0), ("I", 0, 1), ("W", 0, 1))
    assert live_peak(order, {0: 1.0}, {0: 0.5}) == 2.5
    merged = (("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1))  # a whole backward frees at once
    assert live_peak(merged, {0: 1.0}, {0: 0.5}) == 1.0
