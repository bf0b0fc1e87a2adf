"""Starting from a checkpoint, end to end at 2 and 4 CPU ranks, in one chain of runs.

- **Resume**: tiny under fsdp at 2 ranks, saving every 2 steps and keeping its saves, its rank 1 killed in step 5
  (after the save at step 4): the cell is ``crashed``; ``--resume`` continues it from that save, not from step 0.
- **Resharding**: cells under fsdp at 4 ranks and fsdp+tp at 4 start from that cell's save after step 2
  (``--restore-from``) and train on. Their global losses at steps 3-6 equal the resumed cell's at the same steps
  (its kept curve: steps 0-4 from its first attempt, 5-6 from the second), which checks both: a resumed curve that
  went wrong would not equal continuations computed from the earlier save under other layouts, and those would not
  equal each other.
(results/reference/checkpoint-reshard-cpu-tiny-mini-w4-w2 has the other direction, fsdp at 4 ranks to 2.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.conftest import HarnessCLI, kill_all

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
TRAINING = ["--device", "cpu", "--sizes", "tiny", "--batch", "8", "--steps", "6", "--warmup", "1", "--no-calibrate",
            "--no-reference"]
"""The same training for every run here: one model, data and learning rate (7 steps: 0 is warmup)."""
RESUMED = "tiny-fsdp-fp32-w2-gb8-strong-ckpt-sync2"
TOLERANCE = 1e-5
"""fp32 losses of one training under two layouts: the reductions' order differs (1e-7 measured), nothing else."""


def _cells(out: Path) -> dict[str, dict]:
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    return {r["cell_id"]: r for r in records if r["kind"] == "cell"}  # the latest record of each cell


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("restart")
    cli = HarnessCLI(tmp)
    try:
        cut = cli.run("bench", *TRAINING, "--strategies", "fsdp", "--gpus", "2", "--checkpoint", "sync",
                      "--checkpoint-every", "2", "--checkpoint-keep", "--out", str(tmp / "cut"), timeout=600,
                      faults=[{"cell": RESUMED, "rank": 1, "call": 6, "fault": "sigkill"}])
        assert cli.fired(RESUMED, "sigkill"), cut.stdout[-2000:]
        attempt1 = _cells(tmp / "cut")
        resumed = cli.run("bench", "--resume", str(tmp / "cut"), timeout=600)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        step2 = tmp / "cut" / "cells" / RESUMED / "checkpoints" / "step-000002"
        dst = cli.run("bench", *TRAINING, "--strategies", "fsdp,fsdp+tp", "--gpus", "4", "--restore-from",
                      str(step2), "--out", str(tmp / "dst"), timeout=600)
        assert dst.returncode == 0, dst.stderr[-3000:]
    finally:
        kill_all(str(tmp))
    return tmp, attempt1, _cells(tmp / "cut")[RESUMED], _cells(tmp / "dst")


def test_a_cell_killed_after_a_save_resumes_from_it(runs):
    tmp, attempt1, rec, _ = runs
    assert attempt1[RESUMED]["status"] == "crashed"
    assert rec["status"] == "ok", rec.get("error")
    start = rec["metrics"]["checkpoint"]["start"]
    assert (start["kind"], start["from_step"], start["attempt"]) == ("resume", 4, 2)
    assert len(rec["metrics"]["loss"]) == 7 and len(rec["samples"]["step_time_s"]) == 6  # 1-4 attempt 1's, 5-6 2's
    # the restart: a process, a build and a load before step 5; goodput under 1 by the restart and lost work
    assert start["restart_s"] > start["load_s"] > 0 and start["lost_s"] >= 0
    assert start["productive_s"] < start["wall_s"] and 0 < start["goodput"] < 1
    assert start["goodput"] == pytest.approx(start["productive_s"] / start["wall_s"])
    curve = json.loads((tmp / "cut" / "cells" / RESUMED / "checkpoints" / "curve.json").read_text())["losses"]
    assert curve == rec["metrics"]["loss"], "the kept curve is the record's global loss, both attempts"


def test_its_earlier_save_trains_on_under_fsdp_and_fsdp_tp_at_4_ranks_as_its_curve_did(runs):
    _, _, resumed, restored = runs
    assert sorted(restored) == ["tiny-fsdp+tp-fp32-w4-gb8-strong-from2", "tiny-fsdp-fp32-w4-gb8-strong-from2"]
    for cell_id, rec in restored.items():
        assert rec["status"] == "ok", (cell_id, rec.get("error"))
        start = rec["metrics"]["checkpoint"]["start"]
        assert (start["kind"], start["from_step"]) == ("restore", 2)
        # its step i is the source's step 3 + i: steps 3-6 of the source's 0-6 compared
        assert start["steps_compared"] == 4 and start["load_s"] > 0
        assert start["loss_max_abs_diff"] <= TOLERANCE, (cell_id, start)
        # the comparison is the test's too: the record's losses against the resumed cell's, by step
        assert rec["metrics"]["loss"][:4] == pytest.approx(resumed["metrics"]["loss"][3:], abs=TOLERANCE)
        assert rec["config"]["restore_from"].endswith("step-000002")
