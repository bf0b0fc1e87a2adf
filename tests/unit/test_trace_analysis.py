"""Trace analysis: interval algebra with exact numbers, a hand-made GPU trace, a real gloo trace."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from harness.measure.trace_analysis import (
    analyse_rank,
    analyse_traces,
    events_frame,
    find_rank_traces,
    intersect_intervals,
    is_comm_op_name,
    load_trace,
    merge_intervals,
    outermost_mask,
    rank_skew_s,
    total_length,
)

DATA = Path(__file__).parent / "data"
GPU = {0: DATA / "trace_gpu_rank0.json", 1: DATA / "trace_gpu_rank1.json"}
CPU = {0: DATA / "trace_cpu_gloo_rank0.json.gz", 1: DATA / "trace_cpu_gloo_rank1.json.gz"}


# ---- interval helpers --------------------------------------------------------------------


def test_merge_intervals_unions_touching_and_drops_empty() -> None:
    assert merge_intervals([(5, 7), (0, 2), (1, 3), (3, 4), (6, 6), (10, 9)]) == [(0, 4), (5, 7)]
    assert merge_intervals([]) == []


def test_total_length_counts_overlap_once() -> None:
    assert total_length([(0, 10), (5, 15), (20, 25)]) == 20
    assert total_length([(0, 1.5), (0, 1.5)]) == 1.5


def test_intersect_intervals_exact() -> None:
    compute = [(100, 400), (400, 700), (1100, 1500), (1700, 1900)]
    comm = [(500, 900), (1400, 1800)]
    assert intersect_intervals(compute, comm) == [(500, 700), (1400, 1500), (1700, 1800)]
    assert total_length(intersect_intervals(compute, comm)) == 400
    assert intersect_intervals([(0, 1)], [(1, 2)]) == []  # touching is not overlapping
    assert intersect_intervals([(0, 10)], []) == []


def test_outermost_mask_keeps_call_stack_roots() -> None:
    # (0,10) contains (1,4) which contains (2,3); (4,9) is nested in (0,10) too; (12,13) is a root.
    starts, ends = [0, 1, 2, 4, 12], [10, 4, 3, 9, 13]
    assert outermost_mask(starts, ends) == [True, False, False, False, True]


def test_rank_skew_uses_common_steps() -> None:
    steps = {0: {1: 1.0, 2: 1.0, 3: 9.0}, 1: {1: 1.1, 2: 1.3}}
    assert rank_skew_s(steps) == pytest.approx(0.2)
    assert rank_skew_s({0: {1: 1.0}}) == 0.0
    assert rank_skew_s({0: {1: 1.0}, 1: {2: 1.0}}) is None


def test_comm_name_heuristic() -> None:
    for name in ("gloo:all_reduce", "c10d::allreduce_", "record_param_comms", "nccl:all_gather",
                 "c10d::_allgather_base_", "gloo:send", "c10d::barrier", "reduce_scatter_tensor_coalesced"):
        assert is_comm_op_name(name), name
    for name in ("aten::broadcast_tensors", "aten::mm", "DistributedDataParallel.forward",
                 "torch.distributed.ddp.reducer::copy_bucket_to_grad", "aten::sendfoo", "descend"):
        assert not is_comm_op_name(name), name


# ---- GPU fixture: exact numbers ------------------------------------------------------------


def test_gpu_rank0_exact() -> None:
    df = load_trace(GPU[0])
    assert df.attrs["source"] == "gpu-kernels"
    assert df["kind"].value_counts().to_dict() == {"other": 7, "compute": 4, "comm": 2}
    res = analyse_rank(df)
    assert res["compute_s"] == pytest.approx(1200e-6)  # [100,700] + [1100,1500] + [1700,1900]
    assert res["comm_s"] == pytest.approx(800e-6)  # [500,900] + [1400,1800]
    assert res["overlap_s"] == pytest.approx(400e-6)
    assert res["overlap_pct"] == pytest.approx(50.0)
    assert res["idle_pct"] == pytest.approx(20.0)  # busy 1600 of a 2000 us window
    assert res["steps"] == 2  # gpu_user_annotation copies of ProfilerStep# are not counted
    assert res["step_time_s"] == pytest.approx({1: 1e-3, 2: 1e-3})


def test_gpu_two_ranks_aggregate_exact() -> None:
    table, agg = analyse_traces(GPU)
    assert list(table["rank"]) == [0, 1]
    assert table["idle_pct"].tolist() == pytest.approx([20.0, 100.0 / 3.0])
    assert agg["compute_s"] == pytest.approx(600e-6)  # per profiled step
    assert agg["comm_s"] == pytest.approx(400e-6)
    assert agg["overlap_pct"] == pytest.approx(50.0)
    assert agg["idle_pct"] == pytest.approx((20.0 + 100.0 / 3.0) / 2)
    assert agg["rank_skew_s"] == pytest.approx(200e-6)  # step 1: 100 us, step 2: 300 us
    assert (agg["ranks"], agg["steps"], agg["source"], agg["reason"]) == (2, 2, "gpu-kernels", None)
    json.dumps(agg)


# ---- CPU gloo fixture: a real trace ----------------------------------------------------------


# Independent of the analyser: the fixture's events read straight from the JSON, a brute-force
# containment test instead of the call-stack mask, a boundary sweep instead of merged intervals.
_FIXTURE_COMM = {"gloo:all_reduce", "c10d::allreduce_"}  # every collective the 2-rank DDP fixture ran


def _union_us(intervals: list[tuple[float, float]]) -> float:
    points = sorted([(s, 1) for s, e in intervals if e > s] + [(e, -1) for s, e in intervals if e > s],
                    key=lambda p: (p[0], -p[1]))
    depth, total, opened = 0, 0.0, 0.0
    for x, step in points:
        if depth == 0 and step == 1:
            opened = x
        depth += step
        if depth == 0:
            total += x - opened
    return total


def _pairwise_overlaps(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    return [(max(s1, s2), min(e1, e2)) for s1, e1 in a for s2, e2 in b if min(e1, e2) > max(s1, s2)]


def _by_hand(path: Path) -> dict:
    with gzip.open(path, "rt") as fh:
        events = [e for e in json.load(fh)["traceEvents"] if e.get("ph") == "X"]
    comm = [e for e in events if e["name"] in _FIXTURE_COMM]
    aten = [e for e in events if e.get("cat") == "cpu_op" and e["name"].startswith("aten::")]

    def nested(e: dict) -> bool:  # inside another aten or comm op of the same thread
        return any(f is not e and f["tid"] == e["tid"] and f["ts"] <= e["ts"] and e["ts"] + e["dur"] <= f["ts"] + f["dur"]
                   and (f["ts"], -f["dur"]) < (e["ts"], -e["dur"]) for f in comm + aten)

    compute = [(e["ts"], e["ts"] + e["dur"]) for e in aten if not nested(e)]
    comms = [(e["ts"], e["ts"] + e["dur"]) for e in comm]
    steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
    window = (min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps))
    busy = _union_us(_pairwise_overlaps(compute + comms, [window]))
    return {
        "compute_s": _union_us(compute) / 1e6,
        "comm_s": _union_us(comms) / 1e6,
        "overlap_s": _union_us(_pairwise_overlaps(compute, comms)) / 1e6,
        "window_s": (window[1] - window[0]) / 1e6,
        "idle_pct": 100 * (1 - busy / (window[1] - window[0])),
        "step_time_s": {int(e["name"].split("#")[1]): e["dur"] / 1e6 for e in steps},
    }


def test_cpu_gloo_traces_exact() -> None:
    """Every number of the analysis of the committed 2-rank gloo traces, recomputed from the JSON."""
    table, agg = analyse_traces(CPU)
    hand = {rank: _by_hand(path) for rank, path in CPU.items()}
    # Pinned as well, so the analyser and the hand count cannot drift together: rank 0 then rank 1.
    assert [h["compute_s"] for h in hand.values()] == pytest.approx([0.1603072880859375, 0.1089973203125], rel=1e-12)
    assert [h["comm_s"] for h in hand.values()] == pytest.approx([0.0175007587890625, 0.054024291015625], rel=1e-12)
    assert [h["step_time_s"] for h in hand.values()] == [{2: 0.1075561, 3: 0.074833527},
                                                        {2: pytest.approx(0.107052295), 3: 0.067983298}]
    for rank, h in hand.items():
        row = table[table["rank"] == rank].iloc[0]
        assert row["compute_s"] == pytest.approx(h["compute_s"], rel=1e-12)
        assert row["comm_s"] == pytest.approx(h["comm_s"], rel=1e-12)
        assert row["overlap_s"] == pytest.approx(h["overlap_s"], abs=1e-12)
        assert row["window_s"] == pytest.approx(h["window_s"], rel=1e-12)
        assert row["idle_pct"] == pytest.approx(h["idle_pct"], rel=1e-9)
        assert row["steps"] == 2
        assert row["compute_s_per_step"] == pytest.approx(h["compute_s"] / 2, rel=1e-12)
        assert row["comm_s_per_step"] == pytest.approx(h["comm_s"] / 2, rel=1e-12)
        assert row["overlap_pct"] == pytest.approx(100 * h["overlap_s"] / h["comm_s"], abs=1e-9)
    # The main thread waits in c10d::allreduce_ while gloo's thread works: no compute overlaps it.
    assert agg["overlap_pct"] == 0.0
    assert agg["compute_s"] == pytest.approx((hand[0]["compute_s"] + hand[1]["compute_s"]) / 4, rel=1e-12)
    assert agg["comm_s"] == pytest.approx((hand[0]["comm_s"] + hand[1]["comm_s"]) / 4, rel=1e-12)
    assert agg["idle_pct"] == pytest.approx((hand[0]["idle_pct"] + hand[1]["idle_pct"]) / 2, rel=1e-9)
    assert agg["idle_pct"] == pytest.approx(4.726673248927783, rel=1e-9)
    # Skew: mean over steps 2 and 3 of (slowest - fastest rank).
    skew = ((0.1075561 - 0.107052295) + (0.074833527 - 0.067983298)) / 2
    assert agg["rank_skew_s"] == pytest.approx(skew, rel=1e-9)
    assert (agg["ranks"], agg["steps"], agg["source"], agg["reason"]) == (2, 2, "cpu-ops", None)


def test_cpu_classification_outermost_aten_only() -> None:
    df = load_trace(CPU[0])
    comm_names = set(df.loc[df["kind"] == "comm", "name"])
    assert comm_names == {"gloo:all_reduce", "c10d::allreduce_"}
    compute = df[df["kind"] == "compute"]
    assert compute["name"].str.startswith("aten::").all()
    # aten::addmm runs inside aten::linear on the same thread: only the parent is counted.
    assert "aten::linear" in set(compute["name"]) and "aten::addmm" not in set(compute["name"])


def test_aten_inside_collective_is_not_compute() -> None:
    trace = {"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "ts": 0, "dur": 10, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::empty", "ts": 1, "dur": 2, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 20, "dur": 5, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mul", "ts": 5, "dur": 10, "pid": 1, "tid": 2},
    ]}
    df = events_frame(trace)
    assert df["kind"].tolist() == ["comm", "other", "compute", "compute"]
    res = analyse_rank(df)
    assert res["comm_s"] == pytest.approx(10e-6) and res["compute_s"] == pytest.approx(15e-6)
    assert res["overlap_pct"] == pytest.approx(50.0)  # tid 2's mul covers [5,10] of the collective
    assert res["steps"] == 0 and res["window_s"] == pytest.approx(25e-6)


def test_no_comm_gives_none_overlap_and_missing_steps_reason(tmp_path: Path) -> None:
    trace = {"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5, "pid": 1, "tid": 1}]}
    path = tmp_path / "rank0.json.gz"
    with gzip.open(path, "wt") as fh:
        json.dump(trace, fh)
    assert analyse_rank(load_trace(path))["overlap_pct"] is None
    _, agg = analyse_traces({0: path})
    assert agg["compute_s"] is None and "no ProfilerStep# events" in agg["reason"]


def test_errors_name_the_problem(tmp_path: Path) -> None:
    bad = tmp_path / "rank0.json"
    bad.write_text("[]")
    with pytest.raises(ValueError, match="is not a Chrome trace"):
        load_trace(bad)
    with pytest.raises(ValueError, match="no complete"):
        analyse_rank(events_frame({"traceEvents": []}))
    with pytest.raises(ValueError, match="at least one rank"):
        analyse_traces({})
    with pytest.raises(ValueError, match="mix sources"):
        analyse_traces({0: GPU[0], 1: CPU[1]})


def test_find_rank_traces(tmp_path: Path) -> None:
    shutil.copy(GPU[0], tmp_path / "rank0.111.1700000000001.pt.trace.json")
    with gzip.open(tmp_path / "rank1.222.1700000000002.pt.trace.json.gz", "wt") as fh:
        fh.write(GPU[1].read_text())
    (tmp_path / "notes.txt").write_text("x")
    found = find_rank_traces(tmp_path)
    assert sorted(found) == [0, 1]
    assert isinstance(analyse_traces(found)[0], pd.DataFrame)
