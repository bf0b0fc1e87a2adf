"""One cell's ranks forked from one process that has imported everything once: torchrun's job, without
paying Python's and torch's start-up once per rank.

``python -m harness.run.forkrun --nproc N --cell CELL.json --out CELL_DIR --log-dir DIR`` imports the
worker (torch, the harness) once, then forks N rank processes that call
:func:`harness.run.worker.main` with the environment torchrun would give them (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` on loopback, ...). Each cell is
still a job of its own (:func:`harness.jobs.run_job`): a fresh process tree per cell, so a crash,
an OOM or a hang costs only that cell, and a timeout or Ctrl-C kills the tree by its tag (forked
ranks keep the job's environment). Like torchrun, the parent ends the other ranks when one fails,
and it writes ``ranks.json``: each rank's exit, in the order they were seen to end.

Safe to fork because the parent does nothing but import: no torch op has run (no intra-op thread
pool, no OpenMP team), it is single-threaded (checked before forking), and CUDA is never
initialised in it: nothing the worker imports calls into CUDA (``tests/unit/test_forkrun.py``
imports it with CUDA's initialisation made to fail), the launcher sets ``PYTORCH_NVML_BASED_CUDA_CHECK``
so that an accidental ``torch.cuda.is_available()`` asks NVML instead of creating a driver context,
and the parent refuses to fork if ``torch.cuda.is_initialized()``. Each rank selects its device after the fork.
Single node only; multi-node cells and ``harness trace`` (nsys wraps each rank's command) use torchrun.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
import traceback
from pathlib import Path

import torch

from harness.jobs import KILL_GRACE_S, free_port
from harness.measure.phases import LAUNCHER_MARKS_ENV, PhaseMarks
from harness.records.atomic import write_json_atomic
from harness.run import worker
from harness.run.launch import RANKS_FILE


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _rank_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def _run_rank(rank: int, nproc: int, port: int, args: argparse.Namespace, launcher_marks: dict[str, float]) -> int:
    """In the forked child: the rank's environment, its own log files, then the worker."""
    os.environ.update(_rank_env(rank, nproc, port))
    os.environ[LAUNCHER_MARKS_ENV] = json.dumps(launcher_marks)
    logs = args.log_dir / str(rank)
    logs.mkdir(parents=True, exist_ok=True)
    for fd, name in ((1, "stdout.log"), (2, "stderr.log")):
        f = os.open(logs / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)  # a rank dies as a torchrun rank would
    try:
        return worker.main(["--cell", str(args.cell), "--out", str(args.out)])
    except BaseException:  # the worker records its own failures; anything else still ends this rank loudly
        traceback.print_exc()
        return 1


def _describe(status: int) -> int:
    """waitpid status -> an exit code, negative for a signal (as Popen.returncode and torchrun say)."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _end(pids: dict[int, int]) -> None:
    """SIGCONT + SIGTERM the ranks still running (stopped ones included)."""
    for sig in (signal.SIGCONT, signal.SIGTERM):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                continue


def _wait_all(pids: dict[int, int]) -> list[dict]:
    """Reap every rank; on the first failure end the others. Exits in the order they were seen."""
    exits: list[dict] = []
    deadline = None
    while pids:
        if deadline is not None and time.monotonic() > deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
            deadline = float("inf")
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.05)
            continue
        rank = pids.pop(pid)
        code = _describe(status)
        root = code != 0 and all(e["exitcode"] == 0 for e in exits)  # the first rank seen to fail
        exits.append({"rank": rank, "exitcode": code, "root": root})
        if code != 0 and deadline is None:  # as torchrun: one rank failed, the cell is over
            _end(pids)
            deadline = time.monotonic() + KILL_GRACE_S
    return exits


def main(argv: list[str] | None = None) -> int:
    marks = PhaseMarks.of_this_process()  # the ranks' start-up is this process's: they are forked after it
    ap = argparse.ArgumentParser(prog="harness.run.forkrun")
    ap.add_argument("--nproc", type=int, required=True)
    ap.add_argument("--cell", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--log-dir", type=Path, required=True)
    args = ap.parse_args(argv)
    if torch.cuda.is_initialized():
        raise SystemExit("forkrun: CUDA was initialised before the fork; ranks could not use it "
                         "(run with --launcher torchrun, and report which import did it)")
    if (threads := _threads()) != 1:
        raise SystemExit(f"forkrun: {threads} threads alive before the fork; forking would copy their locks "
                         "held (run with --launcher torchrun)")
    port = free_port()
    pids: dict[int, int] = {}
    for rank in range(args.nproc):
        pid = os.fork()
        if pid == 0:
            worker.exit_now(_run_rank(rank, args.nproc, port, args, marks.marks))
        pids[pid] = rank
    exits = _wait_all(pids)
    write_json_atomic(args.out / RANKS_FILE, {"launcher": "fork", "exits": exits})
    return 0 if all(e["exitcode"] == 0 for e in exits) else 1


if __name__ == "__main__":
    worker.exit_now(main())
