"""Launch one cell as its own job: isolation, timeout, outcome captured.

The job is a :func:`harness.jobs.run_job`: tagged, in a session of its own, and killed whole
on a timeout or Ctrl-C, so no orphans survive a cell. On one node its ranks are forked by the sweep's
fork server, which imported everything once (:mod:`harness.run.fork_server`, ``--launcher fork``,
the default); across nodes, under Nsight Systems (``trace``, ``bench --nsys``: ``nsys profile`` in
front of torchrun, whose ranks nsys starts in a session of their own, ended by
:func:`harness.measure.nsys.end_sessions`) and with ``--launcher torchrun`` they are torchrun's,
started afresh.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from harness.jobs import drop_empty_log, free_port, run_job
from harness.records.atomic import write_json_atomic
from harness.run import heartbeat
from harness.run.fork_client import ForkServer, ForkServerDied
from harness.run.heartbeat import StallWatch
from harness.spec import CellConfig


@dataclass(frozen=True)
class Rendezvous:
    nnodes: int = 1
    node_rank: int = 0
    endpoint: str | None = None
    """``HOST:PORT`` of the c10d rendezvous; None = a free port on loopback (single node)."""


@dataclass
class Outcome:
    status: str
    error: str | None
    result: dict | None
    returncode: int | None
    wall_s: float
    started_at: float | None = None
    """Wall-clock time (``time.time()``) the job started: the ranks' phase marks are on the same clock."""


LAUNCHERS = ("fork", "torchrun")
RANKS_FILE = "ranks.json"
"""The fork server's account of a cell's rank exits, beside the cell's result."""


def torchrun_command(cfg: CellConfig, cell_json: Path, cell_dir: Path, rdzv: Rendezvous, rdzv_id: str,
                     log_dir: Path, launcher_prefix: list[str] | None = None) -> list[str]:
    """The torchrun argument list (never a shell string), after ``launcher_prefix`` (``nsys profile ...``)."""
    nproc = cfg.world_size // cfg.nnodes
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={cfg.nnodes}", f"--nproc-per-node={nproc}",
           "--max-restarts=0", f"--log-dir={log_dir}", "--redirects=3", "--monitor-interval=0.5"]
    if cfg.nnodes == 1:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id={rdzv_id}"]
    else:
        # Static, not c10d: c10d ignores --node-rank and ranks nodes by sorted (hostname, pid), so
        # global rank 0 (which writes result.json) could land on a node that does not write
        # records, and any node whose hostname matches the endpoint may host the store. Static
        # makes the node rank the group rank and has node rank 0 host the store.
        cmd += ["--rdzv-backend=static", f"--rdzv-endpoint={rdzv.endpoint}", f"--rdzv-id={rdzv_id}",
                f"--node-rank={rdzv.node_rank}"]
    return [*(launcher_prefix or []), *cmd, "-m", "harness.run.worker", "--cell", str(cell_json),
            "--out", str(cell_dir)]


def _stderr_tail(log_dir: Path, rank: int | None, limit: int = 1500) -> str:
    files = sorted(log_dir.rglob("stderr.log"))
    if rank is not None:
        files = [f for f in files if f.parent.name == str(rank)] or files
    tails = []
    for f in files:
        text = f.read_text(errors="replace").strip()
        if text:
            tails.append(f"[rank {f.parent.name}] " + text[-limit:])
    return "\n".join(tails)[-limit * 2:]


def _failures(launcher_err: str) -> list[dict]:
    """Failed ranks from torchrun's summary: ``[{rank, exitcode, root}]``, the root cause marked."""
    out: list[dict] = []
    root = False
    for line in launcher_err.splitlines():
        s = line.strip()
        if s.startswith("Root Cause"):
            root = True
        key, _, rest = s.partition(":")
        key, value = key.strip(), rest.split()
        if key == "rank" and value and value[0].isdigit():
            out.append({"rank": int(value[0]), "exitcode": None, "root": root})
        elif key == "exitcode" and value and out and out[-1]["exitcode"] is None:
            out[-1]["exitcode"] = int(value[0]) if value[0].lstrip("-").isdigit() else None
    return out


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "exit unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}, exit {code}"
        except ValueError:
            return f"killed by signal {-code}, exit {code}"
    return f"exit {code}"


def _rank_exits(cell_dir: Path, launcher_err: str) -> list[dict]:
    """Failed ranks ``[{rank, exitcode, root}]``: the fork launcher's ``ranks.json``, else torchrun's summary."""
    ranks = cell_dir / RANKS_FILE
    if ranks.exists():
        return [e for e in json.loads(ranks.read_text())["exits"] if e["exitcode"] != 0]
    return _failures(launcher_err)


def _failed_rank(cell_dir: Path, launcher_err: str) -> tuple[int | None, str]:
    """The rank that failed first and how it died.

    torchrun lists other failures before its root cause, and its root cause is the first rank
    observed dead in a poll (ties go to the lowest rank), so a peer that failed *because* of
    the culprit can be named instead. Preference: a rank killed by a signal other than the
    launcher's SIGTERM that left no error report (killed from outside or a native crash), then
    the rank whose error report was written first, then torchrun's root cause.
    """
    failures = _rank_exits(cell_dir, launcher_err)
    reported = {int(p.stem.removeprefix("error-rank")): p.stat().st_mtime_ns
                for p in cell_dir.glob("error-rank*.json") if p.stem.removeprefix("error-rank").isdigit()}
    killed = [f for f in failures if f["exitcode"] is not None and f["exitcode"] < 0
              and f["exitcode"] != -signal.SIGTERM and f["rank"] not in reported]
    if killed:
        f = next((k for k in killed if k["root"]), killed[0])
        return f["rank"], _describe_exit(f["exitcode"])
    by_rank = {f["rank"]: f for f in failures}
    if reported:
        rank = min(reported, key=reported.__getitem__)
        return rank, _describe_exit(by_rank[rank]["exitcode"]) if rank in by_rank else "exit unknown"
    root = next((f for f in failures if f["root"]), failures[0] if failures else None)
    if root is None:
        return None, "exit unknown"
    return root["rank"], _describe_exit(root["exitcode"])


def _drop_empty_logs(cell_dir: Path) -> None:
    """torchrun writes a stdout and stderr file per rank whether or not the rank printed."""
    for log in [cell_dir / "launcher.log", *(cell_dir / "logs").rglob("*.log")]:
        drop_empty_log(log)


def run_cell_job(cfg: CellConfig, cell_dir: Path, timeout_s: float, rdzv: Rendezvous, *, rdzv_id: str,
                 env_extra: dict | None = None, launcher_prefix: list[str] | None = None,
                 stall_timeout_s: float | None = None, server: ForkServer | None = None,
                 capture_over: Callable[[], bool] | None = None) -> Outcome:
    """Run the cell; classify ok / oom / crashed / timeout. Ctrl-C kills the job, then re-raises.

    ``stall_timeout_s``: a rank inside the measured window that finishes no step for this long
    ends the cell as ``timeout`` (:mod:`harness.run.heartbeat`), before ``timeout_s``. ``server``:
    the sweep's fork server, which starts the ranks of a one-node cell (else torchrun does).
    ``capture_over``: polled like the stall watch; True once the ranks and their launcher are gone and
    only a tracer that outlived them is left (:class:`harness.run.nsys_capture.ReportWait`): the job is
    ended and its outcome follows from what the ranks wrote, not from the tracer's exit."""
    cell_dir.mkdir(parents=True, exist_ok=True)
    for stale in [cell_dir / "result.json", cell_dir / RANKS_FILE, *cell_dir.glob("error-rank*.json")]:
        stale.unlink(missing_ok=True)  # left by an interrupted attempt (--resume): never this job's outcome
    cell_json = cell_dir / "cell.json"
    write_json_atomic(cell_json, cfg.to_dict())
    log_dir = cell_dir / "logs"
    watch = StallWatch(cell_dir, stall_timeout_s) if stall_timeout_s else None
    heartbeat.clear(cell_dir)
    started_at, t0 = time.time(), time.monotonic()
    ended_tracer = False

    def watchdog() -> bool:
        nonlocal ended_tracer
        if watch is not None and watch.stalled():
            return True
        ended_tracer = capture_over is not None and capture_over()
        return ended_tracer
    try:
        if server is not None and cfg.nnodes == 1 and not launcher_prefix:
            rc = server.run({"nproc": cfg.world_size, "cell": str(cell_json), "out": str(cell_dir),
                             "log_dir": str(log_dir), "launcher_log": str(cell_dir / "launcher.log")},
                            timeout_s, watchdog if watch else None)
        else:
            env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env_extra or {})}
            cmd = torchrun_command(cfg, cell_json, cell_dir, rdzv, rdzv_id, log_dir, launcher_prefix)
            rc = run_job(cmd, cell_dir / "launcher.log", timeout_s, env,
                         watchdog=watchdog if watch or capture_over else None)
    except ForkServerDied as e:
        return Outcome("crashed", str(e), None, None, time.monotonic() - t0, started_at)
    finally:
        heartbeat.clear(cell_dir)
        _drop_empty_logs(cell_dir)
    wall = time.monotonic() - t0
    if rc is None and ended_tracer:  # the ranks had exited: their files say how
        rc = 1 if any(cell_dir.glob("error-rank*.json")) else 0
    if rc is None:
        return Outcome("timeout", watch.reason if watch and watch.reason else
                       f"no result within the cell timeout ({timeout_s:.0f} s); job killed "
                       f"(raise --cell-timeout if the cell is just slow)", None, None, wall, started_at)
    result_path = cell_dir / "result.json"
    if rc == 0 and (result_path.exists() or rdzv.node_rank != 0):
        result = json.loads(result_path.read_text()) if result_path.exists() else None
        return Outcome("ok", None, result, rc, wall, started_at)
    return replace(_classify_failure(cell_dir, log_dir, rc, wall), started_at=started_at)


def _classify_failure(cell_dir: Path, log_dir: Path, rc: int, wall: float) -> Outcome:
    errors = [json.loads(p.read_text()) for p in sorted(cell_dir.glob("error-rank*.json"))]
    if any(e["status"] == "oom" for e in errors):
        e = next(e for e in errors if e["status"] == "oom")
        return Outcome("oom", f"rank {e['rank']}: {e['error']}", None, rc, wall)
    if rc == 0 and not errors:
        return Outcome("crashed", f"every rank exited 0 but no {cell_dir / 'result.json'} was written "
                                  "(global rank 0 writes it; see the rank logs)", None, rc, wall)
    launcher_log = cell_dir / "launcher.log"  # absent when torchrun printed nothing
    launcher_err = launcher_log.read_text(errors="replace") if launcher_log.exists() else ""
    rank, how = _failed_rank(cell_dir, launcher_err)
    first = next((e for e in errors if e["rank"] == rank), None)
    what = first["error"] if first else "no error report from the rank (killed, or a native crash); see its stderr"
    tail = _stderr_tail(log_dir, rank)
    return Outcome("crashed", f"rank {rank if rank is not None else '?'} died ({how}): {what}\n{tail}".strip(),
                   None, rc, wall)
