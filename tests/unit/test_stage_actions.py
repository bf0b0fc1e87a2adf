"""Each pipeline rank's step split into its stage actions: the clock around torch's stage calls, the record's
per-rank split, and the summary's section with what a schedule saved of 1F1B's wait; expected values by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from harness.compare.run_diff import stage_actions_table
from harness.parallel import pipeline_clock
from harness.parallel.schedules import STAGE_ACTIONS, stage_action_split_ms
from harness.report.stage_actions import actions_frame, actions_section, wait_saved
from harness.run.measurement import RankMeasurement
from harness.run.record_metrics import _actions_ms

COST_S = {"F": 1.0, "B": 3.0, "I": 4.0, "W": 8.0, "R": 16.0, "wait": 32.0}
"""What each call lasts on :func:`lasting`'s clock: no two actions alike, so a label charged to the wrong action
changes the split (a clock of equal durations could not see two labels swapped)."""


class _Stage:
    """The calls a schedule makes on a ``PipelineStage`` (torch 2.13's names and keywords); each advances
    ``clock`` (when given) by its :data:`COST_S`."""

    def __init__(self, clock: list[float] | None = None) -> None:
        self.calls: list[str] = []
        self.clock = clock

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if self.clock is not None:
            self.clock[0] += COST_S[name[0]]

    def forward_one_chunk(self, chunk, args, kwargs=None):
        self._call(f"F{chunk}")
        return chunk

    def backward_one_chunk(self, chunk, loss=None, full_backward=True, last_backward=False):
        self._call(f"{'B' if full_backward else 'I'}{chunk}")

    def backward_weight_one_chunk(self, chunk, last_backward=False):
        self._call(f"W{chunk}")

    def perform_reduce_grad(self, scale):
        self._call(f"R{scale}")


@pytest.fixture
def lasting(monkeypatch) -> list[float]:
    """A perf_counter that only the calls move, each by its own :data:`COST_S`."""
    now = [0.0]
    monkeypatch.setattr(pipeline_clock.time, "perf_counter", lambda: now[0])
    return now


@pytest.fixture
def ticks(monkeypatch):
    """A perf_counter that advances 1 s each time it is read: every timed call lasts exactly 1 s."""
    now = iter(range(10_000))
    monkeypatch.setattr(pipeline_clock.time, "perf_counter", lambda: float(next(now)))


def test_the_clock_charges_each_stage_call_and_wait_to_its_action(lasting, monkeypatch):
    def wait(works):
        lasting[0] += COST_S["wait"]
        return len(works)

    monkeypatch.setattr(torch_schedules, "_wait_batch_p2p", wait)  # restored after the test
    a, b = _Stage(lasting), _Stage(lasting)
    clock = pipeline_clock.attach([a, b])
    assert a.forward_one_chunk(0, ()) == 0  # the call's result is the stage's
    b.forward_one_chunk(1, ())
    a.backward_one_chunk(0, loss=None, full_backward=False, last_backward=False)  # a zero-bubble schedule's I
    a.backward_weight_one_chunk(0, last_backward=True)
    b.backward_one_chunk(1, loss=None, last_backward=True)  # a whole backward (the keyword's default)
    b.perform_reduce_grad(8)
    assert torch_schedules._wait_batch_p2p([1, 2]) == 2  # the schedules module's waits are charged too
    torch_schedules._wait_batch_p2p([])
    assert a.calls == ["F0", "I0", "W0"] and b.calls == ["F1", "B1", "R8"]
    # F0 + F1 = 1 + 1; B1 = 3; I0 = 4; W0 = 8; R8 = 16; two waits = 32 + 32
    assert clock.lap() == {"forward": 2.0, "backward": 3.0, "backward_input": 4.0, "backward_weight": 8.0,
                           "reduce_grad": 16.0, "p2p_wait": 64.0}
    assert clock.lap() == dict.fromkeys(STAGE_ACTIONS, 0.0)  # a lap restarts the count


def test_a_second_pipeline_charges_the_waits_to_its_own_clock_once(ticks, monkeypatch):
    monkeypatch.setattr(torch_schedules, "_wait_batch_p2p", lambda works: None)
    first = pipeline_clock.attach([_Stage()])
    second = pipeline_clock.attach([_Stage()])  # the wait is wrapped once, not twice
    torch_schedules._wait_batch_p2p([])
    assert first.lap()["p2p_wait"] == 0.0 and second.lap()["p2p_wait"] == 1.0


def test_the_split_is_the_mean_measured_step_in_ms_and_other_is_what_the_actions_leave():
    laps = [{"forward": 0.010, "backward": 0.020, "p2p_wait": 0.004}, {"forward": 0.012, "backward": 0.022}]
    split = stage_action_split_ms(laps, [0.040, 0.044])
    # forward (10 + 12) / 2 = 11 ms, backward 21, wait 2; the mean step 42 ms less 34 ms of actions: 8
    assert split == pytest.approx({"forward": 11.0, "backward": 21.0, "backward_input": 0.0, "backward_weight": 0.0,
                                   "reduce_grad": 0.0, "p2p_wait": 2.0, "other": 8.0})
    assert stage_action_split_ms([], []) is None
    assert stage_action_split_ms(laps, [0.04]) is None  # a lap per step or nothing


def _rank(rank: int, times: list[float], parts: list[dict[str, float]] | None) -> RankMeasurement:
    return RankMeasurement(rank=rank, times=times, cpu_times=None, losses=None, g_small=None, mem={}, state_bytes={},
                           comm={}, comm_cp={}, moe_ep_rows=None, trace={}, profiled_times=[], probe={}, dynamo=None,
                           fp8_linears=[], step_parts=parts)


def test_the_record_holds_each_ranks_measured_steps_only_in_rank_order():
    warm = {"forward": 9.0}  # the warmup step's: left out
    ranks = [_rank(1, [9.0, 0.030], [warm, {"forward": 0.010, "p2p_wait": 0.015}]),
             _rank(0, [9.0, 0.020], [warm, {"forward": 0.020}])]
    out = _actions_ms(ranks, warmup=1)
    assert out is not None
    assert [o["forward"] for o in out] == pytest.approx([20.0, 10.0])  # rank 0 first
    assert out[1]["p2p_wait"] == pytest.approx(15.0) and out[1]["other"] == pytest.approx(5.0)  # 30 - 10 - 15
    assert _actions_ms([_rank(0, [1.0], None)], warmup=0) is None  # CUDA: the host's clock does not time kernels


def _record(cell: str, schedule: str, waits: list[float], size: str = "tiny") -> dict:
    split = [{"forward": 10.0, "backward": 20.0, "p2p_wait": w, "other": 2.0} for w in waits]
    return {"kind": "cell", "status": "ok", "cell_id": cell,
            "config": {"strategy": "pp", "degrees": {"pp": 2}, "pp_schedule": schedule, "microbatches": 8, "size": size,
                       "world_size": 2, "global_batch": 8},
            "metrics": {"pipeline": {"actions_ms_by_rank": split}}}


def test_the_section_splits_each_rank_and_says_what_a_schedule_saved_of_1f1bs_wait():
    records = [_record("a-1f1b", "1f1b", [8.0, 4.0]), _record("a-zbv", "zbv", [2.0, 6.0]),
               _record("b-zbv", "zbv", [1.0, 1.0], size="mini"),  # no 1f1b of its layout: no comparison
               {"kind": "calibration"}, {**_record("x", "zb", [1.0, 1.0]), "status": "failed"}]
    df = actions_frame(records)
    assert list(df["cell_id"]) == ["a-1f1b", "a-1f1b", "a-zbv", "a-zbv", "b-zbv", "b-zbv"]
    assert list(df["step_ms"]) == [40.0, 36.0, 34.0, 38.0, 33.0, 33.0]  # 10 + 20 + 2 + the wait
    saved = wait_saved(df)
    assert list(saved["saved"]) == pytest.approx([0.75, -0.5])  # 1 - 2/8, 1 - 6/4
    text = actions_section(df)
    assert text is not None
    assert ("- zbv against 1f1b in the same layout (`a-zbv`): rank 0 waited 75% less (2.0 vs 8.0 ms), "
            "rank 1 waited 50% more (6.0 vs 4.0 ms)") in text
    assert "b-zbv`)" not in text
    assert "| a-1f1b | pp         | 0      | 40.0      | 10.0   | 20.0   | 0.0    | 0.0    | 0.0         | 8.0       | 2.0" in text
    assert actions_section(actions_frame([])) is None


def test_harness_diff_holds_each_ranks_split_a_to_b_and_the_waits_change():
    a, b = _record("c", "1f1b", [8.0, 4.0]), _record("c", "1f1b", [2.0, 0.0])
    table = stage_actions_table(SimpleNamespace(a=a, b=b))
    assert table is not None
    assert list(table["p2p_wait"]) == ["8.0 -> 2.0", "4.0 -> 0.0"]
    assert list(table["wait change %"]) == ["-75", "-100"]  # 2/8 - 1, 0/4 - 1
    assert list(table["forward"]) == ["10.0 -> 10.0"] * 2
    assert stage_actions_table(SimpleNamespace(a=a, b={"metrics": {}})) is None  # one side without: no table
