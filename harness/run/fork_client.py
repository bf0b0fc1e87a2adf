"""The sweep's side of its fork server (:mod:`harness.run.fork_server`): start it once, run cells on it.

The server is a job of its own (:mod:`harness.jobs`): tagged, in a session of its own, started on
the first cell that needs it (whose ``metrics.overhead`` then shows the server's launch and imports,
and every later cell's none) and killed whole by :meth:`ForkServer.close` (the sweep's ``finally``,
so Ctrl-C and SIGTERM leave nothing running). A cell past its timeout, or stalled, is killed by its
session (its leader's process group), and the server goes on to the next cell. A server that dies
is started again for the next cell; the cell it was running is recorded as crashed.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from harness.jobs import KILL_GRACE_S, Job, drop_empty_log, interrupts_deferred, start_job

READY_TIMEOUT_S = 300.0
"""Importing torch and the harness: seconds on an idle machine, far more under load."""
SERVER_LOG = "fork_server.log"


class ForkServerDied(RuntimeError):
    """The server exited while a cell was running; the message says how and where its log is."""


class ForkServer:
    def __init__(self, run_dir: Path, env_extra: dict[str, str] | None = None) -> None:
        self.run_dir = run_dir
        self.env_extra = env_extra or {}
        self.job: Job | None = None
        self._buf = b""

    # ---- the server's lifetime

    def _start(self) -> None:
        env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "PYTORCH_NVML_BASED_CUDA_CHECK": "1",  # an accidental is_available() in the server inits no CUDA
               # numpy's OpenBLAS starts a thread server at import: the server must be single-threaded when
               # it forks, and the ranks' math is torch's, not numpy's
               "OPENBLAS_NUM_THREADS": "1", **self.env_extra}
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / SERVER_LOG, "a") as log, interrupts_deferred():
            self.job = start_job([sys.executable, "-m", "harness.run.fork_server", "--run-dir", str(self.run_dir)],
                                 log, env, pipes=True)
        self._buf = b""
        msg = self._read(READY_TIMEOUT_S)
        if not msg or "ready" not in msg:
            why = (msg or {}).get("error") or f"no answer in {READY_TIMEOUT_S:.0f} s"
            self.close()
            raise ForkServerDied(f"the fork server did not start: {why} (log: {self.run_dir / SERVER_LOG})")

    def close(self) -> None:
        if self.job is not None:
            self.job.kill()
            for pipe in (self.job.proc.stdin, self.job.proc.stdout):
                if pipe is not None:
                    pipe.close()
            self.job = None
        drop_empty_log(self.run_dir / SERVER_LOG)

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the protocol: JSON lines

    def _send(self, msg: dict) -> None:
        assert self.job is not None and self.job.proc.stdin is not None
        try:
            self.job.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.job.proc.stdin.flush()
        except BrokenPipeError:
            raise self._died() from None

    def _read(self, timeout_s: float) -> dict | None:
        """The server's next message, or None when ``timeout_s`` passes first; ForkServerDied at its end."""
        assert self.job is not None and self.job.proc.stdout is not None
        fd = self.job.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise self._died()
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def _died(self) -> ForkServerDied:
        code = self.job.proc.poll() if self.job else None
        self.close()
        return ForkServerDied(f"the fork server died (exit {code}); see {self.run_dir / SERVER_LOG}")

    # ---- one cell

    def run(self, request: dict, timeout_s: float, watchdog: Callable[[], bool] | None = None) -> int | None:
        """Run one cell (``{"nproc", "cell", "out", "log_dir", "launcher_log"}``): its leader's exit code,
        or None when it ran past ``timeout_s`` or ``watchdog`` said it stalled (then it is killed)."""
        if self.job is None or self.job.proc.poll() is not None:
            self._start()
        self._send(request)
        msg = self._read(READY_TIMEOUT_S)
        if not msg or "started" not in msg:
            raise ForkServerDied(f"the fork server did not start the cell: {msg}")
        leader = msg["started"]
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self._read(min(0.5, max(0.0, deadline - time.monotonic())))
            if msg and msg.get("exited") == leader:
                _kill_group(leader, signal.SIGKILL)  # anything a rank started and left behind (compile workers)
                return msg["code"]
            if time.monotonic() >= deadline or (watchdog is not None and watchdog()):
                self._kill_cell(leader)
                return None

    def _kill_cell(self, leader: int) -> None:
        """SIGCONT + SIGTERM the cell's session (stopped ranks included), SIGKILL what outlives the grace;
        wait until the server reports the leader's exit."""
        for sig, wait_s in ((signal.SIGCONT, 0.0), (signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, READY_TIMEOUT_S)):
            _kill_group(leader, sig)
            end = time.monotonic() + wait_s
            while time.monotonic() < end:
                msg = self._read(end - time.monotonic())
                if msg and msg.get("exited") == leader:
                    _kill_group(leader, signal.SIGKILL)
                    return


def _kill_group(pgid: int, sig: signal.Signals) -> None:
    """Signal the cell's session (the leader's process group, which outlives the leader while a member does)."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
