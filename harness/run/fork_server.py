"""A sweep's fork server: torch and the harness imported once, every cell's ranks forked from there.

``python -m harness.run.fork_server --run-dir DIR`` imports the worker (torch, the harness), says
``{"ready": ...}`` on stdout, then reads one JSON request a line on stdin, one cell at a time:
``{"nproc", "cell", "out", "log_dir", "launcher_log"}``. For each it forks a *leader* that starts a
session of its own, sends its output to ``launcher_log`` and forks the cell's ranks; each rank gets
the environment torchrun would give it (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` /
``MASTER_PORT`` on loopback, ...) and runs :func:`harness.run.worker.main`. Like torchrun, the leader
ends the other ranks when one fails, and writes ``ranks.json`` (each rank's exit, in the order they
were seen to end) before it exits. The server answers ``{"started": leader_pid}`` and, when the
leader has exited, ``{"exited": leader_pid, "code": code}``. :class:`harness.run.fork_client.ForkServer`
is the sweep's side.

Isolation is the same as a job per cell: the server never runs cell code, so every cell starts from
the same freshly imported state in processes of its own; a crash, an OOM or a hang costs only that
cell, whose session (leader and ranks) the sweep kills on a timeout; Ctrl-C or SIGTERM kill the
server's whole tree (its job tag, which every forked process keeps in its environment).

Safe to fork because the server does nothing but import: no torch op has run (no intra-op thread
pool, no OpenMP team), it is single-threaded when it forks (checked: the client sets
``OPENBLAS_NUM_THREADS=1``, since numpy's OpenBLAS otherwise starts a thread server at import), and
CUDA is never initialised in it: nothing the worker imports calls into CUDA
(``tests/unit/test_fork_server.py`` imports it with every CUDA entry point made to fail),
``PYTORCH_NVML_BASED_CUDA_CHECK=1`` makes an accidental ``torch.cuda.is_available()`` ask NVML
instead of creating a driver context, and the server refuses to start if
``torch.cuda.is_initialized()``. Each rank selects its device after the fork.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

from harness.jobs import KILL_GRACE_S, free_port
from harness.measure.phases import LAUNCHER_MARKS_ENV, PhaseMarks
from harness.records.atomic import write_json_atomic
from harness.run import worker
from harness.run.launch import RANKS_FILE

CELL_JSON_ENV = "HARNESS_CELL_JSON"
"""Set in a forked rank: the cell it runs (a torchrun rank has it on its command line)."""


FORK_SAFE_THREADS = {
    "jemalloc_bg_thd": "jemalloc's purging thread: jemalloc's pthread_atfork handlers hold every one of its locks "
                       "across the fork, and the child starts its own thread again",
}
"""Native threads a fork may copy, by name (``/proc/self/task/*/comm``), with why. The lent H200's image
preloads jemalloc with background threads on: its ``jemalloc_bg_thd`` starts at the first import after
torch, so the server saw 2 threads and refused every cell on CUDA."""


def other_threads() -> list[str]:
    """The names of this process's threads other than the calling one."""
    me = str(threading.get_native_id())
    names = []
    for tid in sorted(os.listdir("/proc/self/task")):
        if tid != me:
            try:
                names.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
            except OSError:  # the thread ended while we looked
                continue
    return names


def fork_safety_problem(threads: list[str] | None = None) -> str | None:
    """Why this process must not fork ranks, or None. ``threads``: the other threads' names (default: read)."""
    if torch.cuda.is_initialized():
        return "CUDA was initialised before the fork, so no rank could use it"
    unsafe = [t for t in (other_threads() if threads is None else threads) if t not in FORK_SAFE_THREADS]
    if unsafe:
        return (f"{len(unsafe)} other threads are alive ({', '.join(unsafe)}), and a fork would copy the locks they "
                "hold")
    return None


def _rank_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def _redirect(path: Path, fds: tuple[int, ...] = (1, 2)) -> None:
    """This process's ``fds`` (stdout and stderr) to the file ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for fd in fds:
        os.dup2(f, fd)
    os.close(f)


def _run_rank(rank: int, port: int, req: dict, marks: dict[str, float]) -> int:
    """In a forked rank: its environment and log files, then the worker."""
    os.environ.update(_rank_env(rank, req["nproc"], port))
    os.environ[LAUNCHER_MARKS_ENV] = json.dumps(marks)
    os.environ[CELL_JSON_ENV] = req["cell"]
    logs = Path(req["log_dir"]) / str(rank)
    _redirect(logs / "stdout.log", (1,))
    _redirect(logs / "stderr.log", (2,))
    try:
        return worker.main(["--cell", req["cell"], "--out", req["out"]])
    except BaseException:  # the worker records its own failures; anything else still ends this rank loudly
        traceback.print_exc()
        return 1


def _describe(status: int) -> int:
    """waitpid status -> an exit code, negative for a signal (as Popen.returncode and torchrun say)."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _signal_all(pids, sigs: tuple[signal.Signals, ...]) -> None:
    for sig in sigs:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                continue


def _wait_all(pids: dict[int, int]) -> list[dict]:
    """Reap every rank; on the first failure end the others (SIGCONT + SIGTERM, SIGKILL after the
    grace). Exits in the order they were seen."""
    exits: list[dict] = []
    deadline = None
    while pids:
        if deadline is None:  # nothing to do until a rank exits: block, never wake a core the ranks compute on
            pid, status = os.waitpid(-1, 0)
        else:
            if time.monotonic() > deadline:
                _signal_all(pids, (signal.SIGKILL,))
                deadline = float("inf")
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                time.sleep(0.02)
                continue
        rank = pids.pop(pid)
        code = _describe(status)
        root = code != 0 and all(e["exitcode"] == 0 for e in exits)  # the first rank seen to fail
        exits.append({"rank": rank, "exitcode": code, "root": root})
        if code != 0 and deadline is None:  # as torchrun: one rank failed, the cell is over
            _signal_all(pids, (signal.SIGCONT, signal.SIGTERM))
            deadline = time.monotonic() + KILL_GRACE_S
    return exits


def lead_cell(req: dict, marks: dict[str, float]) -> int:
    """The leader, forked from the server: a session of its own, the ranks forked, waited for, accounted."""
    os.setsid()  # the cell's processes: one group the sweep can kill without touching the server
    _forget_child_wakeup()
    _redirect(Path(req["launcher_log"]))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)  # the leader and its ranks die as torchrun's would
    port = free_port()
    pids: dict[int, int] = {}
    for rank in range(req["nproc"]):
        pid = os.fork()
        if pid == 0:
            worker.exit_now(_run_rank(rank, port, req, marks))
        pids[pid] = rank
    exits = _wait_all(pids)
    write_json_atomic(Path(req["out"]) / RANKS_FILE, {"launcher": "fork", "exits": exits})
    return 0 if all(e["exitcode"] == 0 for e in exits) else 1


def _say(msg: dict) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


_WAKEUP: tuple[int, int] | None = None
"""The server's SIGCHLD wake-up pipe (read end, write end): a leader's exit wakes its ``select``."""


def _child_wakeup() -> int:
    """A pipe that SIGCHLD writes to, so the server sleeps in ``select`` until a request or a leader's exit
    (polling every 50 ms, as before, woke a core the ranks compute on 20 times a second)."""
    global _WAKEUP
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a Python handler, so the wake-up fd is written
    signal.set_wakeup_fd(w)
    _WAKEUP = (r, w)
    return r


def _forget_child_wakeup() -> None:
    """In a forked leader: its ranks' exits are its own business, not the server's wake-up pipe's."""
    if _WAKEUP is not None:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in _WAKEUP:
            os.close(fd)


def serve(marks: PhaseMarks) -> None:
    """Fork a leader per request; report each leader's exit. Ends when stdin closes (the sweep is gone),
    killing whatever cell is still running."""
    leaders: set[int] = set()
    wakeup = _child_wakeup()
    while True:
        readable, _, _ = select.select([sys.stdin, wakeup], [], [], None if not leaders else 5.0)
        if wakeup in readable:
            while True:
                try:
                    if not os.read(wakeup, 512):
                        break
                except BlockingIOError:
                    break
        readable = [f for f in readable if f is sys.stdin]
        while leaders:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            leaders.discard(pid)
            _say({"exited": pid, "code": _describe(status)})
        if not readable:
            continue
        line = sys.stdin.readline()
        if not line:
            for pid in leaders:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
            return
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = lead_cell(req, marks.marks)
            finally:
                worker.exit_now(code)
        leaders.add(pid)
        _say({"started": pid})


def main(argv: list[str] | None = None) -> int:
    marks = PhaseMarks.of_this_process()  # every rank's start-up: they are forked after it
    ap = argparse.ArgumentParser(prog="harness.run.fork_server")
    ap.add_argument("--run-dir", type=Path, required=True, help="the sweep's run directory (names the server)")
    ap.parse_args(argv)
    problem = fork_safety_problem()
    if problem:
        _say({"error": f"fork server: {problem}; run with --launcher torchrun"})
        return 1
    _say({"ready": True, "marks": marks.marks})
    serve(marks)
    return 0


if __name__ == "__main__":
    worker.exit_now(main())
