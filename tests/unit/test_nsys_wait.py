"""The bounded wait after a capture's ranks are done, and the retries of a hung capture (issue 47).

No nsys here: a stand-in "rank" is a sleeping process whose command line and environment look like a
captured rank's (``harness.run.worker`` with ``HARNESS_NSYS_TAG``), and the capture's job is a function
that behaves as a hung nsys would (its ranks end, the job does not, until the wait ends it). The real
nsys, hung on purpose, is in the nsys tier (tests/nsys/test_capture.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.jobs import WATCH_POLL_S
from harness.measure import nsys as nsys_mod
from harness.measure.nsys import TAG_ENV, workload_alive
from harness.planner import PlannedCell
from harness.run import nsys_capture
from harness.run.launch import Outcome
from harness.run.nsys_capture import Attempt, NsysTool, ReportWait, captured_job
from harness.spec import CellConfig
from tests.distributed._spawn import cell

LIMIT_S = 0.3


def _fake_rank(tag: str) -> subprocess.Popen:
    env = {**os.environ, TAG_ENV: tag}
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-m", "harness.run.worker"], env=env)


def _poll_until(wait: ReportWait, timeout_s: float = 20.0) -> float:
    """Poll until the wait ends the job; the seconds from when the wait saw the job over (its clock, which a call
    before this one may have started: timing from this call's start once read 0.295 s for a 0.3 s limit)."""
    t0 = time.monotonic()
    while not wait():
        assert time.monotonic() - t0 < timeout_s, "the wait never ended the job"
        time.sleep(0.05)
    assert wait.over_at is not None
    return time.monotonic() - wait.over_at


def test_the_wait_starts_when_the_ranks_are_gone_and_ends_the_job_after_its_limit(tmp_path: Path) -> None:
    wait = ReportWait("t4g1", LIMIT_S, tmp_path / "result.json")
    time.sleep(2 * LIMIT_S)
    assert not wait(), "before nsys started the launcher nothing is over, however long that takes"
    rank = _fake_rank("t4g1")
    try:
        deadline = time.monotonic() + 30
        while not workload_alive("t4g1"):
            assert time.monotonic() < deadline, "the stand-in rank was never seen"
            time.sleep(0.05)
        assert not workload_alive("other"), "another capture's ranks are not this one's"
        assert not wait() and wait.seen
        time.sleep(2 * LIMIT_S)
        assert not wait(), "a live rank: the job is not over"
    finally:
        rank.kill()
        rank.wait()
    waited = _poll_until(wait)
    assert wait.hung and LIMIT_S <= waited < LIMIT_S + 5
    assert wait.waited_s(time.monotonic()) >= LIMIT_S


def test_rank_0s_result_ends_the_job_even_while_a_rank_is_still_alive(tmp_path: Path) -> None:
    # The hang seen in issue 47: the ranks wrote their results, then nsys never let go of the session.
    rank = _fake_rank("t4g2")
    try:
        wait = ReportWait("t4g2", LIMIT_S, tmp_path / "result.json")
        (tmp_path / "result.json").write_text("{}")
        assert not wait() and wait.over_at is not None
        assert LIMIT_S <= _poll_until(wait) < LIMIT_S + 5 and wait.hung
    finally:
        rank.kill()
        rank.wait()


def _fake_nsys(tag: str, code: str) -> subprocess.Popen:
    """A process of the capture ``tag`` that is not a launcher or rank: nsys's, as far as the wait can tell."""
    return subprocess.Popen([sys.executable, "-c", code], env={**os.environ, TAG_ENV: tag})


WRITES = "import time, tempfile\nwith tempfile.TemporaryFile() as f:\n    for _ in range(40):\n        f.write(b'x' * 4096); f.flush(); time.sleep(0.05)"
SPINS = "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end: pass"


def test_a_capture_that_keeps_reading_or_writing_is_never_hung_a_spinning_one_is(tmp_path: Path) -> None:
    # the two cases measured on real nsys 2022.4 agents (docs/nsys.md): a healthy agent reads the ranks'
    # data after they end; a hung one spins at a full core with no I/O at all
    (tmp_path / "result.json").write_text("{}")
    busy = _fake_nsys("t4g4", WRITES)
    try:
        wait = ReportWait("t4g4", LIMIT_S, tmp_path / "result.json")
        t0 = time.monotonic()
        while busy.poll() is None and time.monotonic() - t0 < 1.5:
            assert not wait(), "a capture that writes is making progress"
            time.sleep(0.05)
        assert time.monotonic() - t0 > 3 * LIMIT_S, "the writer ended before the wait was tested past its limit"
    finally:
        busy.kill()
        busy.wait()
    spinner = _fake_nsys("t4g5", SPINS)
    try:
        wait = ReportWait("t4g5", LIMIT_S, tmp_path / "result.json")
        assert LIMIT_S <= _poll_until(wait) < LIMIT_S + 5 and wait.hung
    finally:
        spinner.kill()
        spinner.wait()


def test_the_importer_running_is_progress_however_quiet(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "result.json").write_text("{}")
    states = iter([nsys_mod.SessionActivity(frozenset({7}), 0, importing=True)] * 20)
    monkeypatch.setattr(nsys_mod, "session_activity", lambda tag: next(states))
    wait = ReportWait("t4g6", LIMIT_S, tmp_path / "result.json")
    for _ in range(20):
        assert not wait()
        time.sleep(LIMIT_S / 5)


def test_stale_nsys_state_is_cleared_only_when_no_nsys_runs(tmp_path: Path, monkeypatch) -> None:
    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    (tmp / "nvidia" / "nsight_systems" / "quadd_session_10546" / "streams").mkdir(parents=True)
    (tmp / "nvidia" / "nsight_systems" / "SessionManager-2022.4.2.1.lock").write_text("")
    shm.mkdir()
    for name in ("NSys-2022.4.2.1", "quadd-agent-instance-546", "sem.nsys_sem_555", "someone-elses"):
        (shm / name).write_text("")
    monkeypatch.setattr(nsys_mod, "_nsys_running", lambda: True)
    assert nsys_mod.clear_stale_state(str(tmp), str(shm)) == [], "another nsys session may still use them"
    monkeypatch.setattr(nsys_mod, "_nsys_running", lambda: False)
    removed = nsys_mod.clear_stale_state(str(tmp), str(shm))
    assert sorted(removed) == ["NSys-2022.4.2.1", "quadd-agent-instance-546", "quadd_session_10546", "sem.nsys_sem_555"]
    assert sorted(p.name for p in shm.iterdir()) == ["someone-elses"]
    assert [p.name for p in (tmp / "nvidia" / "nsight_systems").iterdir()] == ["SessionManager-2022.4.2.1.lock"]


def test_a_job_that_ends_within_one_poll_waited_nothing(tmp_path: Path) -> None:
    wait = ReportWait("t4g3", LIMIT_S, tmp_path / "result.json")
    assert wait.waited_s(time.monotonic()) == 0.0 and not wait.hung


# ---- captured_job: the retry, the record, the problem line --------------------------------------------------


def _planned(world: int = 2, nnodes: int = 1) -> PlannedCell:
    cfg = CellConfig.from_dict(cell("ddp", world, nnodes=nnodes))
    return PlannedCell(cfg.cell_id, cfg, {}, True, None)


class _Capture:
    """The job ``captured_job`` runs, as a hung nsys makes it: rank 0 writes its result, then the job
    only ends when the bounded wait says so (``hangs`` attempts), or at once."""

    def __init__(self, hangs: int, status: str = "ok") -> None:
        self.hangs, self.status, self.attempts = hangs, status, []

    def __call__(self, attempt: Attempt) -> Outcome:
        self.attempts.append(attempt)
        attempt.where.mkdir(parents=True, exist_ok=True)
        result = {"attempt": len(self.attempts)}
        (attempt.where / "result.json").write_text(str(result))
        if len(self.attempts) <= self.hangs:
            _poll_until(attempt.over)
        return Outcome(self.status, None if self.status == "ok" else "rank 1 died", result, 0, 1.0)


@pytest.fixture
def tool() -> NsysTool:
    return NsysTool("/nonexistent/nsys", "NVIDIA Nsight Systems version test", report_wait_s=LIMIT_S)


def test_a_hung_capture_is_taken_once_more_and_the_cell_keeps_its_first_measurement(tmp_path, tool, monkeypatch):
    monkeypatch.setattr(nsys_capture, "read_capture", lambda nsys, report: {})  # nothing to read without nsys
    job = _Capture(hangs=1)
    outcome, nsys = captured_job(tool, job, _planned(), tmp_path, "cpu")
    assert outcome.result == {"attempt": 1}, "the measurement is the first run's; only the trace is redone"
    assert [a.where for a in job.attempts] == [tmp_path, tmp_path / "nsys-retry"]
    assert [a.env[TAG_ENV] for a in job.attempts][0] != job.attempts[1].env[TAG_ENV], "a fresh nsys session"
    first, second = nsys["attempts"]
    assert first["hung"] and not second["hung"]
    assert LIMIT_S <= first["report_wait_s"] < LIMIT_S + 5 * WATCH_POLL_S
    assert nsys["seconds_lost"] == pytest.approx(first["report_wait_s"] + second["wall_s"])
    assert nsys["report"].endswith(".retry.nsys-rep") and nsys["report"] == second["report"]
    assert first["report"].endswith(f"{_planned().cell_id}.nsys-rep")
    # the retry's report was never written (no nsys here): said as such, not as a hang
    assert nsys["problem"].startswith("nsys wrote no ") and ".retry.nsys-rep" in nsys["problem"]


def test_a_hung_retry_is_taken_once_more_in_its_own_folder(tmp_path, tool, monkeypatch):
    monkeypatch.setattr(nsys_capture, "read_capture", lambda nsys, report: {})
    job = _Capture(hangs=2)
    outcome, nsys = captured_job(tool, job, _planned(), tmp_path, "cpu")
    assert outcome.result == {"attempt": 1}
    assert [a.where for a in job.attempts] == [tmp_path, tmp_path / "nsys-retry", tmp_path / "nsys-retry2"]
    assert len({a.env[TAG_ENV] for a in job.attempts}) == 3, "each capture its own nsys session"
    first, second, third = nsys["attempts"]
    assert [first["hung"], second["hung"], third["hung"]] == [True, True, False]
    assert second["report"].endswith(".retry.nsys-rep") and nsys["report"] == third["report"]
    assert third["report"].endswith(f"{_planned().cell_id}.retry2.nsys-rep")
    assert nsys["seconds_lost"] == pytest.approx(first["report_wait_s"] + second["wall_s"] + third["wall_s"])
    assert ".retry2.nsys-rep" in nsys["problem"] and "no progress" not in nsys["problem"]


def test_a_last_hang_is_the_captures_problem_not_the_cells_timeout(tmp_path, tool):
    job = _Capture(hangs=nsys_capture.CAPTURE_ATTEMPTS + 1)
    outcome, nsys = captured_job(tool, job, _planned(), tmp_path, "cpu")
    assert outcome.status == "ok" and len(job.attempts) == nsys_capture.CAPTURE_ATTEMPTS == 3
    assert [a["hung"] for a in nsys["attempts"]] == [True, True, True]
    first, *retries = nsys["attempts"]
    # the first capture's wait, then each retry whole (its own wait included)
    assert nsys["seconds_lost"] == pytest.approx(first["report_wait_s"] + sum(a["wall_s"] for a in retries))
    assert nsys["problem"].startswith("nsys made no progress on ") and "in 3 attempt(s)" in nsys["problem"]
    assert f"for {LIMIT_S:g} s after rank 0 was done" in nsys["problem"]
    assert nsys["ranks"] == [{"rank": 0, "ranges": 0}, {"rank": 1, "ranges": 0}]


def test_no_retry_after_a_retry_that_failed(tmp_path, tool, monkeypatch):
    class _FailsOnRetry(_Capture):
        def __call__(self, attempt: Attempt) -> Outcome:
            out = super().__call__(attempt)
            return out if len(self.attempts) == 1 else Outcome("crashed", "rank 1 died", out.result, 1, 1.0)

    outcome, nsys = captured_job(tool, _FailsOnRetry(hangs=3), _planned(), tmp_path, "cpu")
    assert outcome.status == "ok" and [a["hung"] for a in nsys["attempts"]] == [True, True]
    assert "in 2 attempt(s)" in nsys["problem"]
    # a retry that ended without hanging but failed: the trace's problem names it, the cell keeps its first run
    monkeypatch.setattr(nsys_capture, "read_capture", lambda nsys, report: {})
    report = tmp_path / "b" / "nsys" / f"{_planned().cell_id}.retry.nsys-rep"
    report.parent.mkdir(parents=True)
    report.write_bytes(b"")  # as if nsys had written the retry's report
    outcome, nsys = captured_job(tool, _FailsOnRetry(hangs=1), _planned(), tmp_path / "b", "cpu")
    assert outcome.status == "ok" and [a["hung"] for a in nsys["attempts"]] == [True, False]
    assert nsys["problem"] == "the capture's attempt 2 (a retry) ended crashed: rank 1 died"


@pytest.mark.parametrize("status,nnodes", [("crashed", 1), ("ok", 2)])
def test_no_retry_after_a_failed_cell_or_across_nodes(tmp_path, tool, status, nnodes):
    job = _Capture(hangs=1, status=status)
    outcome, nsys = captured_job(tool, job, _planned(world=2, nnodes=nnodes), tmp_path, "cpu")
    assert len(job.attempts) == 1 and outcome.status == status
    assert nsys["seconds_lost"] == nsys["attempts"][0]["report_wait_s"] >= LIMIT_S
    assert "in 1 attempt(s)" in nsys["problem"]
    assert ("not retried across nodes" in nsys["problem"]) == (nnodes > 1)
