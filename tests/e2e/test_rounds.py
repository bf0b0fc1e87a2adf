"""``harness bench --rounds N`` end to end: every cell once per round, its record from the median
round, a crashed cell recorded at once, and ``--resume`` keeping the rounds that finished."""

from __future__ import annotations

import json
import statistics

import pytest

from tests.e2e.conftest import TINY

FLAGS = [*TINY, "--gpus", "2", "--strategies", "ddp,fsdp", "--no-reference"]


def _rounds_done(out) -> int:
    path = out / "rounds.json"
    if not path.exists():
        return 0
    return sum(len(r) for r in json.loads(path.read_text())["cells"].values())


@pytest.mark.e2e
def test_a_cell_crashed_in_a_round_is_recorded_at_once_and_the_others_finish_their_rounds(harness_cli, e2e):
    crash = "tiny-ddp-fp32-w2-gb4-strong"
    out = harness_cli.tmp / "run"
    res = harness_cli.run("bench", *FLAGS, "--rounds", "2", "--out", str(out), timeout=300,
                          faults=[{"cell": crash, "rank": 1, "call": 1, "fault": "sigkill"}])
    assert res.returncode == 1, res.stderr[-2000:]
    assert harness_cli.fired(crash, "sigkill")
    recs = {r["cell_id"]: r for r in e2e.read_records(out)}
    assert recs[crash]["status"] == "crashed"
    assert [r["cell_id"] for r in e2e.read_records(out)].count(crash) == 1, "a failed cell runs no more rounds"
    ok = recs["tiny-fsdp-fp32-w2-gb4-strong"]
    assert ok["status"] == "ok" and ok["metrics"]["rounds"]["n"] == 2
    state = json.loads((out / "rounds.json").read_text())["cells"]
    assert list(state[crash]) == ["0"] and state[crash]["0"]["status"] == "crashed"
    assert "± " in (out / "summary.md").read_text(), "the table shows the round spread beside the median"


@pytest.mark.e2e
@pytest.mark.slow
def test_rounds_rotate_take_the_median_round_and_resume_keeps_finished_rounds(harness_cli, e2e):
    out = harness_cli.tmp / "run"
    proc = harness_cli.popen("bench", *FLAGS, "--rounds", "3", "--round-order", "rotate", "--out", str(out),
                             log="interrupted")
    rc = harness_cli.signal_when(proc, lambda: _rounds_done(out) >= 3, log="interrupted")
    assert rc == 130, harness_cli.stderr("interrupted")[-2000:]
    before = json.loads((out / "rounds.json").read_text())["cells"]
    kept = {(cid, k): (out / "cells" / cid / f"round{int(k) + 1}" / "result.json").stat().st_mtime_ns
            for cid, rounds in before.items() for k, r in rounds.items() if r["status"] == "ok"}
    assert len(kept) >= 3
    assert e2e.read_records(out) == [], "no cell is recorded before its last round"

    res = harness_cli.run("bench", "--resume", str(out), timeout=420, log="resume")  # rounds from rounds.json
    assert res.returncode == 0, res.stderr[-3000:]
    for (cid, k), mtime in kept.items():
        path = out / "cells" / cid / f"round{int(k) + 1}" / "result.json"
        assert path.stat().st_mtime_ns == mtime, f"{cid} round {int(k) + 1} ran again after resume"
    state = json.loads((out / "rounds.json").read_text())["cells"]
    recs = e2e.read_records(out)
    assert sorted(r["cell_id"] for r in recs) == sorted(state) and len(recs) == 2
    for rec in recs:
        rounds = rec["metrics"]["rounds"]
        assert rounds["n"] == 3 and rounds["order"] == "rotate"
        assert len(rounds["medians_s"]) == 3
        assert rec["metrics"]["step_time_s"]["median"] == pytest.approx(statistics.median(rounds["medians_s"]))
        assert rounds["ci_s"][0] <= rec["metrics"]["step_time_s"]["median"] <= rounds["ci_s"][1]
    # rotate: the cell that ran first in round 1 runs last in round 2
    starts = {k: sorted(state, key=lambda c: state[c][k]["started_at"]) for k in ("0", "1")}
    assert starts["1"] == starts["0"][1:] + starts["0"][:1]
