"""A run directory has one writer; Ctrl-C and SIGTERM (what schedulers send) end a run in one line.

Whatever the harness was doing (a calibration's process pool, a cell's ranks), no process it
started outlives it: every job carries a tag naming the harness's pid (``HARNESS_JOB_TAG``).
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
DDP = ["--gpus", "2", "--strategies", "ddp", "--no-reference"]


@pytest.mark.slow
def test_two_runs_into_one_out_exactly_one_runs(harness_cli, e2e):
    out = harness_cli.tmp / "run"
    procs = [harness_cli.popen("bench", *e2e.TINY, *DDP, "--out", str(out), log=f"run{i}") for i in range(2)]
    rcs = [p.wait(timeout=300) for p in procs]
    assert sorted(rcs) == [0, 2], [harness_cli.stderr(f"run{i}")[-1500:] for i in range(2)]
    refused = harness_cli.stderr(f"run{rcs.index(2)}").strip().splitlines()
    assert len(refused) == 1 and f"{out} is in use by another harness run (pid " in refused[0], refused
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len({r["run_id"] for r in records}) == 1, "a second run wrote into the directory"
    assert [r["cell_id"] for r in records if r["kind"] == "cell"] == ["tiny-ddp-fp32-w2-gb4-strong"]
    assert (out / ".harness.lock").read_text() == "", "a cleanly finished run leaves no holder behind"
    # the lock of a run that is gone is taken over, with a warning
    (out / ".harness.lock").write_text(json.dumps({"pid": 999999, "host": "elsewhere", "started": "then"}))
    res = harness_cli.run("bench", "--resume", str(out), "--no-calibrate", timeout=300, log="again")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "taking over the lock of a run that is gone (pid 999999 on elsewhere, started then)" in res.stderr


@pytest.mark.slow
def test_sigterm_mid_cell_kills_the_job_and_leaves_the_cell_unrecorded(harness_cli, e2e):
    out = harness_cli.tmp / "run"
    proc = harness_cli.popen("bench", *e2e.TINY[:-5], "--steps", "400", "--warmup", "1", "--batch", "4",
                             "--no-calibrate", *DDP, "--out", str(out), log="term")
    # SIGTERM 2 s after the ranks started: they are inside the training loop
    rc = harness_cli.signal_when(proc, lambda: bool(e2e.rank_processes(str(out))), signal.SIGTERM, log="term",
                                 settle_s=2.0)
    err = harness_cli.stderr("term")
    assert rc == 143, err[-2000:]
    assert "interrupted (SIGTERM)" in err and f"harness bench --resume {out}" in err
    assert "Traceback" not in err
    assert e2e.survivors(str(out)) == [], "torchrun or a worker outlived the harness"
    assert e2e.read_records(out) == [], "the interrupted cell must have no record, so --resume re-runs it"


def _interrupt_when(proc, harness_cli, log: str, ready, what: str, sig: int = signal.SIGINT) -> int:
    deadline = time.monotonic() + 240
    try:
        while not ready():
            assert proc.poll() is None, harness_cli.stderr(log)[-2000:]
            assert time.monotonic() < deadline, f"never reached: {what}"
            time.sleep(0.1)
        proc.send_signal(sig)  # the harness alone, as a terminal's Ctrl-C reaches it first
        return proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _one_line_and_nothing_left(harness_cli, e2e, proc, log: str, out) -> None:
    err = harness_cli.stderr(log)
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err[-3000:]
    assert lines == [f"interrupted (Ctrl-C): finished records are kept in {out}/records.jsonl, the running cell "
                     f"has none; finish with: harness bench --resume {out}"], lines
    deadline = time.monotonic() + 10
    while e2e.job_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert e2e.job_processes(proc.pid) == [], "a process the harness started outlived it"
    assert e2e.survivors(str(out)) == []


def _handles(pid: int, sig: int) -> bool:
    """The process has a handler installed for ``sig`` (its bit in SigCgt, /proc/PID/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    caught = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught, 16) & (1 << (sig - 1)))


@pytest.mark.parametrize("sig,name", [(signal.SIGINT, "Ctrl-C"), (signal.SIGTERM, "SIGTERM")])
def test_an_interrupt_while_the_harness_starts_is_one_line(harness_cli, e2e, sig, name):
    """The first second of the first command: the harness was started with SIGINT ignored (as by
    ``harness ... &`` in a script), and Ctrl-C, or a scheduler's SIGTERM, arrives while it still
    imports torch."""
    out = harness_cli.tmp / "run"
    proc = harness_cli.popen("bench", *e2e.TINY, *DDP, "--out", str(out), log="start")
    rc = _interrupt_when(proc, harness_cli, "start", lambda: _handles(proc.pid, sig), f"the harness's {name} handler",
                         sig)
    err = harness_cli.stderr("start")
    assert rc == 128 + sig, err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and f"interrupted ({name})" in lines[0], lines
    assert e2e.job_processes(proc.pid) == [] and e2e.survivors(str(out)) == []


@pytest.mark.slow
def test_ctrl_c_during_calibration_leaves_no_process_and_one_line(harness_cli, e2e):
    """Interrupted while the workload calibration's pool (2 copies, as 2 ranks compute) is running."""
    out = harness_cli.tmp / "run"
    proc = harness_cli.popen("bench", *e2e.TINY[:-1], *DDP, "--out", str(out), log="calib")
    # the calibrate child and its two pool workers: 3 processes of one job
    def pool_running() -> bool:
        procs = e2e.job_processes(proc.pid)
        return len(procs) >= 3 and any("--workloads" in p for p in procs)

    rc = _interrupt_when(proc, harness_cli, "calib", pool_running, "the workload calibration's pool")
    assert rc == 130, harness_cli.stderr("calib")[-2000:]
    _one_line_and_nothing_left(harness_cli, e2e, proc, "calib", out)


@pytest.mark.slow
def test_ctrl_c_during_a_cell_leaves_no_process_and_one_line(harness_cli, e2e):
    out = harness_cli.tmp / "run"
    proc = harness_cli.popen("bench", *e2e.TINY[:-5], "--steps", "400", "--warmup", "1", "--batch", "4",
                             "--no-calibrate", *DDP, "--out", str(out), log="cell")
    rc = _interrupt_when(proc, harness_cli, "cell",
                         lambda: len(e2e.rank_processes(str(out))) == 2,
                         "both ranks of the cell")
    assert rc == 130, harness_cli.stderr("cell")[-2000:]
    _one_line_and_nothing_left(harness_cli, e2e, proc, "cell", out)
    assert e2e.read_records(out) == []
