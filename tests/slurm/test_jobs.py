"""The slurm tier (``make test-slurm``): ``harness slurm`` jobs on a real scheduler.

A private Slurm (munged, slurmctld, two slurmd on this host; tests/slurm/cluster.py) runs the
generated script with ``sbatch``: a sweep lands complete records; a job stopped mid-cell, once by
a SIGTERM to its tasks and once by ``scontrol requeue``, finishes its sweep with every cell ok once
and nothing lost; a job at its time limit ends its cell on the warning signal and exits 143 with
the resume line; a two-node job runs one harness per node through srun and one rendezvous.
Without Slurm every test skips with "n/a: no slurm" (``make setup-slurm`` installs it).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from harness.records.reader import RECORDS_FILENAME, latest_per_cell, read_records
from tests.slurm.cluster import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.e2e]

CPU_CELLS = ["--device", "cpu", "--sizes", "tiny", "--warmup", "1", "--batch", "4", "--no-calibrate",
             "--no-reference"]
"""Tiny gpt2 cells on CPU ranks, no calibration (the tier tests the scheduler, not the model)."""
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
JOB_TIMEOUT_S = 600
PROGRESS = re.compile(r"^\[\d+/\d+\] .*$", re.M)
CELL_START = re.compile(r"^\[\d+/\d+\] \S+ \.\.\. ")
"""A cell's start line, "[2/3] tiny-fsdp-... ... (elapsed 0:32)"; its end line says "[2/3] tiny-fsdp-...: ok"."""


STEP_PAUSE = Path(__file__).resolve().parents[1] / "e2e" / "inject_step_parts"
"""A test-only hook (``HARNESS_TEST_OPTIMIZER_SLEEP_S``): each step of a job's ranks pauses after its update. The
jobs stopped mid-cell run long cells; paused, they hold the cell open for the same seconds at a fraction of the
CPU (CI runs this tier beside the slow tier, which the 2000-step job's busy ranks slowed by minutes)."""


def _submit(slurm: SlurmCluster, out: Path, *flags: str, step_pause_s: float = 0.0) -> str:
    pause = {"PYTHONPATH": os.pathsep.join([str(STEP_PAUSE), slurm.env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
             "HARNESS_TEST_OPTIMIZER_SLEEP_S": str(step_pause_s)} if step_pause_s else None
    done = slurm.run("harness", "slurm", *CPU_CELLS, *flags, "--out", str(out), "--submit", timeout=120,
                     extra_env=pause)
    found = re.search(r"^submitted job (\d+): run directory (.+)$", done.stdout, re.M)
    assert found, done.stdout
    job = found.group(1)
    assert Path(found.group(2)) == out.resolve()
    assert f"tail -f {out.resolve()}/slurm-{job}.out" in done.stdout, "the follow command names the job's log"
    return job


def _log(out: Path, job: str) -> str:
    path = out / f"slurm-{job}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def _cell_records(out: Path) -> list[dict]:
    path = out / RECORDS_FILENAME
    return [r for r in read_records(path)[0] if r.get("kind", "cell") == "cell"] if path.exists() else []


def _ok_cells(out: Path) -> list[str]:
    return [r["cell_id"] for r in _cell_records(out) if r["status"] == "ok"]


MID_CELL_STEPS = "80"
MID_CELL_PAUSE_S = 0.05
"""Each of those steps pauses this long (:data:`STEP_PAUSE`): a cell of >= 4 s, whatever the machine's load."""
"""Steps of a cell the test stops mid-way: long enough that it is still running when the test acts on the
second's start line (with 40, on a busy machine, one cell ended first)."""
ENDED_FOR_S = 60
"""A job that requeued itself may read COMPLETED for a moment before Slurm makes it PENDING again (seen
once in CI, right after its restart count rose; over 15 s once, under load): ended means ended at every
poll for this long."""


def _wait_until(ready, timeout: float, what: str, slurm: SlurmCluster, out: Path, job: str) -> None:
    deadline = time.monotonic() + timeout
    ended_since = None
    while not ready():
        now = time.monotonic()
        if now > deadline:
            raise AssertionError(f"not after {timeout:.0f} s: {what}\n--- job log\n{_log(out, job)[-3000:]}\n"
                                 f"{slurm.logs()}")
        if slurm.job(job).get("JobState") not in ENDED:
            ended_since = None
        elif ended_since is None:
            ended_since = now
        elif now - ended_since > ENDED_FOR_S:
            fields = slurm.job(job)
            raise AssertionError(f"job {job} ended before {what} (JobState={fields.get('JobState')}, Reason="
                                 f"{fields.get('Reason')}, Restarts={fields.get('Restarts')})\n--- job log\n"
                                 f"{_log(out, job)[-3000:]}\n{slurm.logs()}")
        time.sleep(0.5)


def _mid_cell(out: Path, job: str, n_ok: int, attempt: int = 1) -> bool:
    """``n_ok`` cells are recorded ok and the job's attempt ``attempt`` has started and is running a cell.

    The attempt is named: between a requeue and the next start the log still ends with the previous
    attempt, which may itself have stopped at a cell's start line (once in CI, under load: attempt 1 had
    finished cell 2 and started cell 3 when its SIGTERM came, so "2 ok, a cell running" read true while
    the job was pending, and ``scontrol requeue`` refused it)."""
    marker = f"harness job {job}: attempt "
    current = _log(out, job).rsplit(marker, 1)
    if len(current) < 2 or not current[1].startswith(f"{attempt} on "):
        return False
    progress = PROGRESS.findall(current[1])
    return len(_ok_cells(out)) >= n_ok and bool(progress) and CELL_START.match(progress[-1]) is not None


def test_a_submitted_sweep_lands_complete_records(slurm, tmp_path):
    out = tmp_path / "run"
    job = _submit(slurm, out, "--gpus", "2", "--strategies", "ddp,fsdp", "--steps", "3")
    fields = slurm.wait_for(job, ENDED, JOB_TIMEOUT_S)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), _log(out, job)
    records = _cell_records(out)
    assert sorted(r["cell_id"] for r in records) == ["tiny-ddp-fp32-w2-gb4-strong", "tiny-fsdp-fp32-w2-gb4-strong"]
    assert all(r["status"] == "ok" for r in records), [(r["cell_id"], r["error"]) for r in records]
    assert (out / "summary.md").exists() and (out / "job.sbatch").exists()
    assert re.search(rf"^harness job {job}: attempt 1 on n[12], ", _log(out, job), re.M)


def _saved_mid_cell(out: Path, job: str) -> bool:
    """Cell 1 is ok and the running cell has a complete save (every rank's progress file beside DCP's)."""
    running = [d for d in (out / "cells").glob("*") if d.name not in _ok_cells(out)] if (out / "cells").exists() else []
    return _mid_cell(out, job, 1) and any(
        (s / ".metadata").exists() and (s / "harness-rank1.json").exists()
        for d in running for s in (d / "checkpoints").glob("step-*"))


def test_a_job_stopped_mid_cell_twice_finishes_its_sweep_with_nothing_lost(slurm, tmp_path):
    """The cells checkpoint every 10 steps: the cell SIGTERM stops after its first save resumes from it in attempt
    2 (not from step 0), and its loss curve across the two attempts is the one the same cell trains uninterrupted
    (run here without Slurm); its record says from which step it resumed and the goodput."""
    out = tmp_path / "run"
    ckpt = ["--checkpoint", "sync", "--checkpoint-every", "10"]
    job = _submit(slurm, out, "--gpus", "2", "--strategies", "ddp,fsdp,zero2", "--steps", MID_CELL_STEPS, *ckpt,
                  step_pause_s=2 * MID_CELL_PAUSE_S)  # >= 8 s a cell: the signal lands after the save
    cells = 3

    # Attempt 1: SIGTERM to the job's tasks (what the time-limit warning sends) once cell 2 runs and has saved.
    _wait_until(lambda: _saved_mid_cell(out, job), JOB_TIMEOUT_S, "cell 1 ok and cell 2 saved", slurm, out, job)
    slurm.run("scancel", "--signal=TERM", job)  # at once: on a busy machine cell 2 can end within seconds
    slurm.wait_restarted(job, 1, 120)  # the script requeues the job after the harness exits 143
    report = slurm.run("harness", "report", str(out), timeout=120)  # a run not finished: complete records only
    assert "tiny-ddp-fp32-w2-gb4-strong-ckpt-sync10" in (out / "summary.csv").read_text(), report.stdout
    first_attempt = (out / RECORDS_FILENAME).read_bytes()
    slurm.release(job)

    # Attempt 2: Slurm's own requeue (as for preemption) while the next cell runs.
    _wait_until(lambda: _mid_cell(out, job, 2, attempt=2), JOB_TIMEOUT_S, "attempt 2 running a cell, 2 ok",
                slurm, out, job)
    slurm.run("scontrol", "requeue", job)
    slurm.wait_restarted(job, 2, 120)
    slurm.release(job)

    fields = slurm.wait_for(job, ENDED, JOB_TIMEOUT_S)
    log = _log(out, job)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    final = (out / RECORDS_FILENAME).read_bytes()
    assert final.startswith(first_attempt), "a later attempt appends; no earlier record is lost or rewritten"
    records = _cell_records(out)
    latest, _ = latest_per_cell(records)
    assert len(latest) == cells and all(r["status"] == "ok" for r in latest)
    assert sorted(_ok_cells(out)) == sorted(r["cell_id"] for r in latest), "every cell is recorded ok once"
    assert len({json.loads(line)["run_id"] for line in final.splitlines()}) == 1, "one run id over the attempts"
    for attempt in (1, 2, 3):
        assert f"harness job {job}: attempt {attempt} on" in log, log[-3000:]
    assert log.count("interrupted (SIGTERM)") == 2 and log.count("finish with: harness bench --resume") == 2
    assert "requeueing (restart 1 of 3)" in log
    assert log.count("holds this sweep's records; finishing it") == 2
    [resumed] = [r for r in latest if r["config"]["strategy"] == "fsdp"]
    start = resumed["metrics"]["checkpoint"]["start"]
    assert start["kind"] == "resume" and start["attempt"] == 2 and start["from_step"] >= 10, start
    assert 0 < start["goodput"] < 1 and start["restart_s"] > 0
    alone = slurm.run("harness", "bench", *CPU_CELLS, "--gpus", "2", "--strategies", "fsdp", "--steps", MID_CELL_STEPS,
                      *ckpt, "--out", str(tmp_path / "alone"), timeout=300)
    [uninterrupted] = _cell_records(tmp_path / "alone")
    assert uninterrupted["status"] == "ok", alone.stdout[-2000:]
    assert resumed["metrics"]["loss"] == pytest.approx(uninterrupted["metrics"]["loss"], abs=1e-6), \
        "the curve across the two attempts is the uninterrupted one"


def test_a_preempted_job_is_requeued_by_slurm_and_finishes_its_sweep(slurm, tmp_path):
    """A job in the ``urgent`` partition preempts the sweep (PreemptMode=REQUEUE): Slurm sends
    SIGTERM, requeues the job itself, and the next attempt finishes the sweep."""
    out = tmp_path / "run"
    job = _submit(slurm, out, "--gpus", "2", "--strategies", "ddp,fsdp", "--steps", MID_CELL_STEPS,
                  step_pause_s=MID_CELL_PAUSE_S)
    _wait_until(lambda: _mid_cell(out, job, 1), JOB_TIMEOUT_S, "cell 1 ok and cell 2 running", slurm, out, job)
    urgent = slurm.run("sbatch", "--parsable", "--partition", "urgent", "--exclusive", "--nodes", "2",
                       "--output", str(tmp_path / "urgent.out"), "--wrap", "echo urgent ran").stdout.strip()
    slurm.wait_restarted(job, 1, 120)
    assert (slurm.wait_for(urgent, ENDED, 120)["JobState"]) == "COMPLETED"
    slurm.release(job)
    fields = slurm.wait_for(job, ENDED, JOB_TIMEOUT_S)
    log = _log(out, job)
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "1"), log[-3000:]
    assert "DUE TO PREEMPTION" in log and "interrupted (SIGTERM)" in log
    assert "requeueing" not in log, "Slurm requeued the preempted job; the script must not requeue it again"
    latest, attempts = latest_per_cell(_cell_records(out))
    assert [r["status"] for r in latest] == ["ok", "ok"] and sorted(_ok_cells(out)) == sorted(attempts)


def test_a_job_at_its_time_limit_ends_its_cell_and_exits_143_with_the_resume_line(slurm, tmp_path):
    """--time 3 with the warning 60 s before: Slurm checks every 30 s and may signal up to 30 s
    early, so SIGTERM comes 90-120 s in, with the harness well started also beside CI's slow tier
    (with --time 2 it once came 30 s in while the harness still imported), and well before the limit."""
    out = tmp_path / "run"
    job = _submit(slurm, out, "--gpus", "2", "--strategies", "ddp,fsdp,zero2", "--steps", "2000", "--time", "3",
                  "--warn-before", "60", "--max-restarts", "0", step_pause_s=0.2)  # a cell of >= 400 s
    fields = slurm.wait_for(job, ENDED, 300)
    log = _log(out, job)
    assert fields["ExitCode"] == "143:0", f"{fields['JobState']} {fields['ExitCode']}\n{log[-3000:]}"
    assert fields["JobState"] == "FAILED", "ended by the harness on the warning, not killed at the limit"
    assert f"finish with: harness bench --resume {out.resolve()}" in log
    assert "the sweep stopped on SIGTERM after 0 restarts; resubmit to finish the sweep: sbatch" in log
    assert not any(r["status"] != "ok" for r in _cell_records(out)), "the cell the signal ended is not recorded"


def test_a_two_node_job_runs_one_harness_per_node_through_one_rendezvous(slurm, tmp_path):
    out = tmp_path / "run"
    job = _submit(slurm, out, "--nnodes", "2", "--gpus", "1", "--strategies", "ddp", "--steps", "3",
                  "--cell-timeout", "240")
    fields = slurm.wait_for(job, ENDED, JOB_TIMEOUT_S)
    log = _log(out, job)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    assert fields["NodeList"] == "n[1-2]"
    assert re.search(r"^run \S+: 1 cells to run", log, re.M) and re.search(r"^node 1: 1 cells to run", log, re.M), \
        "one harness per node, node 0 naming the run"
    [record] = _cell_records(out)
    assert record["status"] == "ok" and record["cell_id"] == "tiny-ddp-fp32-w2-gb4-strong"
    assert record["config"]["nnodes"] == 2 and record["config"]["world_size"] == 2
