"""A pipelined cell's measured bubble (what each rank waited over what it computed) and the summary's section
that holds it against the schedule's simulated bubble; expected values by hand."""

from __future__ import annotations

import pytest

from harness.report.pipeline_bubble import bubble_frame, bubble_section
from harness.run.measurement import RankMeasurement
from harness.run.record_metrics import _idle_over_busy


def _rank(rank: int, times: list[float], cpu: list[float] | None) -> RankMeasurement:
    return RankMeasurement(rank=rank, times=times, cpu_times=cpu, losses=None, g_small=None, mem={}, state_bytes={},
                           comm={}, comm_cp={}, moe_ep_rows=None, trace={}, profiled_times=[], probe={}, dynamo=None,
                           fp8_linears=[])


def test_idle_over_busy_is_the_median_of_the_measured_steps_per_rank():
    # rank 0: warmup step (ignored) then steps of 1.2, 1.5, 1.1 s with 1.0 s of CPU: (0.2, 0.5, 0.1) -> median 0.2
    # rank 1: 2.0 s steps of 1.6 s CPU: 0.25 each
    ranks = [_rank(1, [9.0, 2.0, 2.0, 2.0], [1.0, 1.6, 1.6, 1.6]), _rank(0, [9.0, 1.2, 1.5, 1.1], [1.0] * 4)]
    assert _idle_over_busy(ranks, warmup=1) == pytest.approx([0.2, 0.25])
    assert _idle_over_busy([_rank(0, [1.0], None)], warmup=0) is None  # CUDA: no CPU time to hold it against


def _record(cell: str, schedule: str, simulated: list[float], measured: list[float | None]) -> dict:
    return {"kind": "cell", "status": "ok", "cell_id": cell,
            "config": {"strategy": "pp", "degrees": {"pp": 2}, "pp_schedule": schedule, "microbatches": 8},
            "metrics": {"pipeline": {"idle_over_busy_by_rank": measured}},
            "predicted": {"pipeline_bubble_by_rank": simulated}}


def test_the_section_holds_the_largest_ranks_bubble_against_the_simulation_and_names_the_smallest():
    records = [_record("a", "1f1b", [0.125, 0.125], [0.20, 0.15]), _record("b", "zb", [0.02, 0.02], [0.05, 0.10]),
               _record("c", "zbv", [0.02, 0.02], [None, 0.1]),  # a rank without its measure: left out
               {"kind": "calibration"}]
    df = bubble_frame(records)
    assert list(df["cell_id"]) == ["a", "b"]
    text = bubble_section(df)
    assert text is not None
    assert "1f1b 7.5 points (1 cells); zb 8.0 points (1 cells)" in text  # |0.20 - 0.125|, |0.10 - 0.02|
    assert "smallest measured bubble: pp (zb) (`b`), 10% at its largest rank" in text
    assert "| a      | pp         | 8              | 12, 12" in text
    assert bubble_section(bubble_frame([])) is None
