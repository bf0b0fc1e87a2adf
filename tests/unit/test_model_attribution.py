"""Where the model's error sits: per-term attribution of step time and peak memory."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.records.reader import load_records
from harness.report.model_attribution import TERMS, attribution_section, memory_attribution, step_attribution
from harness.units import GIB

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "results" / "reference" / "diff-w2-base"


def _record(**metrics) -> dict:
    parts = {"matmul": 0.04, "attention": 0.01, "other_compute": 0.01, "comm_exposed": 0.03, "optimizer": 0.01,
             "data": 0.005, "idle": 0.015}  # profiled step 0.12 s
    return {"kind": "cell", "status": "ok", "cell_id": "tiny-ddp-fp32-w2-gb8-strong", "fingerprint": "f" * 16,
            "config": {"strategy": "ddp", "world_size": 2},
            "metrics": {"step_time_s": {"median": 0.24}, "trace": {"composition": {"parts_s": parts}},
                        "model_state_bytes_per_rank": 1 * GIB, **metrics},
            "predicted": {"step_time_s": 0.18, "model_state_bytes_per_rank": 1 * GIB, "peak_tensor_gib": 1.5,
                          "peak_mem_gib": 1.85,
                          "breakdown": {"compute_s": 0.10, "exposed_comm_s": 0.05, "optimizer_s": 0.03,
                                        "bubble_s": 0.0}}}


def test_step_terms_are_scaled_to_the_median_and_sum_to_the_error() -> None:
    (row,) = step_attribution([_record()]).to_dict("records")
    # measured parts x 2 (median 0.24 / profiled 0.12): compute 0.12, comm 0.06, optimizer 0.02, idle 0.03, data 0.01
    assert row["compute meas_s"] == pytest.approx(0.12)
    assert row["compute %"] == pytest.approx(100 * (0.10 - 0.12) / 0.24)
    assert row["exposed comm %"] == pytest.approx(100 * (0.05 - 0.06) / 0.24)
    assert row["optimizer %"] == pytest.approx(100 * (0.03 - 0.02) / 0.24)
    assert row["bubble / idle %"] == pytest.approx(-100 * 0.03 / 0.24)
    assert row["data %"] == pytest.approx(-100 * 0.01 / 0.24)
    assert row["error_pct"] == pytest.approx(-25.0)
    assert sum(row[f"{t} %"] for t in TERMS) == pytest.approx(row["error_pct"])


def test_memory_terms_split_the_tensor_peak_error_and_the_base_apart() -> None:
    (row,) = memory_attribution([_record(peak_tensor_gib=1.6, peak_mem_gib=2.0)]).to_dict("records")
    assert row["error_pct"] == pytest.approx(100 * (1.5 - 1.6) / 1.6)
    assert row["model states %"] == 0.0
    assert row["activations and buffers %"] == pytest.approx(row["error_pct"])
    assert row["process base pred_gib"] == pytest.approx(0.35) and row["process base meas_gib"] == pytest.approx(0.4)
    assert row["process base %"] == pytest.approx(100 * (0.35 - 0.4) / 2.0)


def test_records_without_a_profile_or_a_tensor_peak_are_left_out() -> None:
    record = _record()
    del record["metrics"]["trace"]
    assert step_attribution([record]).empty and memory_attribution([record]).empty
    assert attribution_section(step_attribution([record]), memory_attribution([record])) == ""


def test_committed_profiled_cells_attribute_their_whole_error() -> None:
    frame = step_attribution(load_records(BASE))
    assert sorted(frame["strategy"]) == ["ddp", "fsdp", "pp", "tp"]
    for _, row in frame.iterrows():
        assert sum(row[f"{t} %"] for t in TERMS) == pytest.approx(row["error_pct"], abs=1e-9)
    assert "| **mean abs**" in attribution_section(step_attribution(load_records(BASE)), memory_attribution(load_records(BASE)))
