"""Child jobs the harness starts (torchrun per cell, the collective calibration): run, tag, kill.

A job runs in a new process session, and every process it starts inherits a tag in its
environment, so a timeout or Ctrl-C kills all of them (torchrun starts each rank in a session
of its own, out of reach of a process-group kill): no job outlives the call that started it.
Commands are argument lists, never shell strings.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

KILL_GRACE_S = 5.0
KILL_ROUNDS = 5
"""SIGKILL rounds over the job's processes, each found anew: a cell's leader forking its ranks at the moment the
job is killed can leave a rank the first round did not see (once in CI: a rank alive 10 s after a Ctrl-C that
came while the second cell started)."""
JOB_TAG_ENV = "HARNESS_JOB_TAG"
"""Set in the job's environment, so every process it starts can be found and killed with it."""
REPO = Path(__file__).resolve().parents[1]
"""The checkout that holds ``harness`` and ``workloads``: on every job's ``PYTHONPATH``."""


def drop_empty_log(path: Path) -> None:
    """Remove ``path`` when the job printed nothing to it: an empty log says nothing, so a run directory
    keeps only the logs that hold something."""
    if path.is_file() and path.stat().st_size == 0:
        path.unlink()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def new_tag() -> str:
    return f"{os.getpid()}-{uuid.uuid4().hex}"


def job_env(tag: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a job: unbuffered output, the repo importable, the tag set."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra or {}), JOB_TAG_ENV: tag}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(REPO)) if p)
    return env


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C: schedulers (Slurm, CI timeouts, ``kill``) send it, not SIGINT."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


@contextlib.contextmanager
def sigterm_as_interrupt():
    """While inside, SIGTERM raises :class:`Terminated` (a KeyboardInterrupt), so every ``finally``
    that kills a job runs for it as it does for Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


INTERRUPTS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def interrupts_deferred():
    """Hold Ctrl-C and SIGTERM while a job starts, then deliver them: an interrupt inside Popen
    (after the fork, before the caller holds the process) would orphan the job's new session."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread handles signals
        return
    pending: list[tuple] = []
    previous = {s: signal.signal(s, lambda signum, frame: pending.append((signum, frame))) for s in INTERRUPTS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if pending:
            signum, frame = pending[0]
            handler = previous[signum]
            if callable(handler):
                handler(signum, frame)  # KeyboardInterrupt or Terminated is raised here
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), signum)  # the default action, as if it had not been held


def _job_processes(tag: str) -> list[psutil.Process]:
    """Every live process started by the job, found by the environment tag they all inherit.

    The job's process group is not enough: torchrun starts each rank in a session of its own,
    and a rank orphaned by torchrun's death is no longer in torchrun's process tree either.
    """
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(JOB_TAG_ENV) == tag:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue  # gone, dead, or not ours: not a live process of this job
    return found


def kill_job(proc: subprocess.Popen, tag: str) -> None:
    """SIGCONT + SIGTERM every process of the job (stopped ranks included), SIGKILL what is left."""
    procs = _job_processes(tag)
    if proc.poll() is None and proc.pid not in {p.pid for p in procs}:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(proc.pid))  # torchrun itself, however its environment reads
    for p in procs:
        for sig in (signal.SIGCONT, signal.SIGTERM):
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(sig)
    _, alive = psutil.wait_procs(procs, timeout=KILL_GRACE_S)
    left = alive + [p for p in _job_processes(tag) if p not in alive]
    for _ in range(KILL_ROUNDS):  # until none is left: a process forked while the job died is found next round
        for p in left:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.send_signal(sig)
        psutil.wait_procs(left, timeout=1.0)
        left = _job_processes(tag)
        if not left:
            break
    proc.wait()


WATCH_POLL_S = 0.5


@dataclass
class Job:
    """A started job: its process and the tag every process it starts inherits."""

    proc: subprocess.Popen
    tag: str

    def kill(self) -> None:
        kill_job(self.proc, self.tag)


def start_job(cmd: list[str], log, env_extra: dict[str, str] | None = None, pipes: bool = False) -> Job:
    """Start ``cmd`` as a tagged job in a session of its own, output to the open file ``log``
    (with ``pipes``: stdin and stdout are pipes, stderr goes to ``log``). Call it inside
    :func:`interrupts_deferred` and keep the job where a ``finally`` can kill it."""
    tag = new_tag()
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE if pipes else None,
                            stdout=subprocess.PIPE if pipes else log,
                            stderr=log if pipes else subprocess.STDOUT, env=job_env(tag, env_extra),
                            start_new_session=True)
    return Job(proc, tag)


def run_job(cmd: list[str], log_path: Path, timeout_s: float, env_extra: dict[str, str] | None = None,
            watchdog: Callable[[], bool] | None = None) -> int | None:
    """Run ``cmd`` as a tagged job with stdout and stderr to ``log_path``; its exit code, None on timeout.

    ``watchdog``, polled every :data:`WATCH_POLL_S` while the job runs, ends it early (as a timeout)
    by returning True. Whatever happens (clean exit, crash, timeout, Ctrl-C, SIGTERM under
    :func:`sigterm_as_interrupt`), no process of the job outlives this call; the interrupt is
    re-raised after the job is killed.
    """
    with open(log_path, "w") as log:
        job = None
        try:
            with interrupts_deferred():
                job = start_job(cmd, log, env_extra)
            deadline = time.monotonic() + timeout_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    return job.proc.wait(timeout=min(left, WATCH_POLL_S) if watchdog else left)
                except subprocess.TimeoutExpired:
                    if watchdog is not None and watchdog():
                        return None
            return None
        finally:
            if job is not None:
                job.kill()
