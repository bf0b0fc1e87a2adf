"""Child jobs end when they must: the cell timeout, the stall watchdog, and the heartbeat it reads."""

from __future__ import annotations

import os
import sys
import time

import psutil

from harness.jobs import JOB_TAG_ENV, run_job
from harness.run.heartbeat import DONE, Heartbeat, StallWatch, clear, heartbeat_files

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def _tagged_alive() -> list[int]:
    return [p.pid for p in psutil.process_iter() if _tag(p) and p.status() != psutil.STATUS_ZOMBIE]


def _tag(p) -> str | None:
    try:
        return p.environ().get(JOB_TAG_ENV, "").startswith(f"{os.getpid()}-") or None
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def test_a_job_past_its_timeout_is_killed_and_returns_none(tmp_path):
    assert run_job(SLEEPER, tmp_path / "log", timeout_s=0.5) is None
    assert _tagged_alive() == [], "the job outlived run_job"


def test_a_finished_job_returns_its_exit_code(tmp_path):
    assert run_job([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "log", timeout_s=60) == 3


def test_the_watchdog_ends_a_job_before_its_timeout(tmp_path):
    polls = []

    def watchdog() -> bool:
        polls.append(1)
        return len(polls) >= 2

    assert run_job(SLEEPER, tmp_path / "log", timeout_s=600, watchdog=watchdog) is None
    assert len(polls) == 2 and _tagged_alive() == []


def _age(path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_stall_watch_names_every_rank_idle_past_the_limit_and_ignores_finished_ones(tmp_path):
    beats = [Heartbeat(tmp_path, r) for r in range(3)]
    for b in beats:
        b.open_window()
    watch = StallWatch(tmp_path, stall_s=10)
    assert not watch.stalled() and watch.reason is None
    _age(beats[1].path, 30)
    _age(beats[2].path, 20)
    assert watch.stalled()
    assert "on ranks 1, 2 (--stall-timeout 10)" in watch.reason and "for 30 s" in watch.reason, watch.reason
    beats[1].close_window()  # a rank past its window is never stalled, however old its file
    beats[2].beat()          # a step finished: fresh again
    _age(beats[1].path, 300)
    assert beats[1].path.read_text() == DONE
    assert not StallWatch(tmp_path, stall_s=10).stalled()


def test_heartbeat_files_are_cleared(tmp_path):
    Heartbeat(tmp_path, 0).open_window()
    assert heartbeat_files(tmp_path)
    clear(tmp_path)
    assert heartbeat_files(tmp_path) == []
