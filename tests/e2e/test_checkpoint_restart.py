"""Starting from a checkpoint, end to end at 2 and 4 CPU ranks.

- **Resharding**: tiny under fsdp at 4 ranks keeps its saves (``--checkpoint-keep``); cells under fsdp at 2 ranks,
  fsdp at 4 and fsdp+tp at 4 start from its save after step 2 (``--restore-from``) and train on: their global
  losses equal the source's for the same steps (the source's curve, kept beside its saves).
- **Resume**: the same training under fsdp at 2 ranks, its rank 1 killed in step 5 (after the save at step 4):
  the cell is ``crashed``; ``--resume`` continues it from that save, not from step 0, and its whole loss curve
  (steps 0-4 from attempt 1, 5-7 from attempt 2) equals the uninterrupted source's; the record says from which
  step it resumed and what the restart cost.
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
SOURCE = "tiny-fsdp-fp32-w4-gb8-strong-ckpt-sync2"
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
    save = ["--checkpoint", "sync", "--checkpoint-every", "2"]
    try:
        src = cli.run("bench", *TRAINING, "--strategies", "fsdp", "--gpus", "4", *save, "--checkpoint-keep",
                      "--out", str(tmp / "src"), timeout=600)
        assert src.returncode == 0, src.stderr[-3000:]
        step2 = tmp / "src" / "cells" / SOURCE / "checkpoints" / "step-000002"
        dst = cli.run("bench", *TRAINING, "--strategies", "fsdp,fsdp+tp", "--gpus", "2,4", "--restore-from",
                      str(step2), "--out", str(tmp / "dst"), timeout=600)
        assert dst.returncode == 0, dst.stderr[-3000:]
        cut = cli.run("bench", *TRAINING, "--strategies", "fsdp", "--gpus", "2", *save, "--out", str(tmp / "cut"),
                      timeout=600, faults=[{"cell": RESUMED, "rank": 1, "call": 6, "fault": "sigkill"}])
        assert cli.fired(RESUMED, "sigkill"), cut.stdout[-2000:]
        attempt1 = _cells(tmp / "cut")
        resumed = cli.run("bench", "--resume", str(tmp / "cut"), timeout=600)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    finally:
        kill_all(str(tmp))
    return tmp, _cells(tmp / "src")[SOURCE], _cells(tmp / "dst"), attempt1, _cells(tmp / "cut")


def test_a_save_under_fsdp_at_4_ranks_trains_on_under_fsdp_at_2_and_fsdp_tp_at_4(runs):
    tmp, source, restored, _, _ = runs
    curve = json.loads((tmp / "src" / "cells" / SOURCE / "checkpoints" / "curve.json").read_text())["losses"]
    assert curve == source["metrics"]["loss"], "the kept curve is the record's global loss"
    assert sorted(c for c, r in restored.items() if r["status"] == "ok") == [
        "tiny-fsdp+tp-fp32-w4-gb8-strong-from2", "tiny-fsdp-fp32-w2-gb8-strong-from2",
        "tiny-fsdp-fp32-w4-gb8-strong-from2"]
    for cell_id, rec in restored.items():
        if rec["status"] != "ok":
            continue
        start = rec["metrics"]["checkpoint"]["start"]
        assert (start["kind"], start["from_step"]) == ("restore", 2)
        # its step i is the source's step 3 + i: steps 3-6 of the source's 0-6 compared
        assert start["steps_compared"] == 4 and start["load_s"] > 0
        assert start["loss_max_abs_diff"] <= TOLERANCE, (cell_id, start)
        # the comparison is the test's too: the record's losses against the source's, by step
        assert rec["metrics"]["loss"][:4] == pytest.approx(curve[3:], abs=TOLERANCE)
        assert rec["config"]["restore_from"].endswith("step-000002")


def test_a_cell_killed_after_a_save_resumes_from_it_and_its_curve_is_the_uninterrupted_one(runs):
    _, source, _, attempt1, cells = runs
    assert attempt1[RESUMED]["status"] == "crashed"
    rec = cells[RESUMED]
    assert rec["status"] == "ok", rec.get("error")
    start = rec["metrics"]["checkpoint"]["start"]
    assert (start["kind"], start["from_step"], start["attempt"]) == ("resume", 4, 2)
    assert rec["metrics"]["loss"] == pytest.approx(source["metrics"]["loss"], abs=TOLERANCE)
    assert len(rec["samples"]["step_time_s"]) == 6  # every measured step once: 1-4 attempt 1's, 5-6 attempt 2's
    # the restart: a process, a build and a load before step 5; goodput under 1 by the restart and lost work
    assert start["restart_s"] > start["load_s"] > 0 and start["lost_s"] >= 0
    assert start["productive_s"] < start["wall_s"] and 0 < start["goodput"] < 1
    assert start["goodput"] == pytest.approx(start["productive_s"] / start["wall_s"])
