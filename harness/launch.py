"""Launch one cell as its own torchrun job: isolation, timeout, outcome captured.

The job runs in a new process session so a timeout or Ctrl-C can kill the whole group
(torchrun and every rank): no orphans survive a cell.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from harness.config import CellConfig
from harness.results.atomic import write_json_atomic

KILL_GRACE_S = 5.0


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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def torchrun_command(cfg: CellConfig, cell_json: Path, cell_dir: Path, rdzv: Rendezvous, rdzv_id: str,
                     log_dir: Path, worker_prefix: list[str] | None = None) -> list[str]:
    """The torchrun argument list (never a shell string)."""
    nproc = cfg.world_size // cfg.nnodes
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={cfg.nnodes}", f"--nproc-per-node={nproc}",
           "--max-restarts=0", f"--log-dir={log_dir}", "--redirects=3", "--monitor-interval=0.5"]
    if cfg.nnodes == 1:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id={rdzv_id}"]
    else:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv.endpoint}", f"--rdzv-id={rdzv_id}",
                f"--node-rank={rdzv.node_rank}", "--rdzv-conf=join_timeout=120"]
    if worker_prefix:
        cmd += ["--no-python", *worker_prefix, sys.executable, "-m", "harness.worker"]
    else:
        cmd += ["-m", "harness.worker"]
    return cmd + ["--cell", str(cell_json), "--out", str(cell_dir)]


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the job's process group, then SIGKILL whatever is left (stopped ranks included)."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        return
    for sig in (signal.SIGCONT, signal.SIGTERM):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
    try:
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass  # still alive after the grace period: SIGKILL below
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    proc.wait()


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


def _failed_rank(cell_dir: Path, launcher_err: str) -> tuple[int | None, str]:
    """The root-cause rank and its exit (signal or code), from torchrun's failure summary."""
    rank = code = None
    for line in launcher_err.splitlines():
        s = line.strip()
        if s.startswith("rank") and ":" in s and rank is None:
            tail = s.split(":", 1)[1].split()[0]
            rank = int(tail) if tail.isdigit() else None
        if s.startswith("exitcode") and ":" in s and code is None:
            code = s.split(":", 1)[1].strip()
    return rank, code or "unknown"


def run_cell_job(cfg: CellConfig, cell_dir: Path, timeout_s: float, rdzv: Rendezvous, rdzv_id: str,
                 env_extra: dict | None = None, worker_prefix: list[str] | None = None) -> Outcome:
    """Run the cell; classify ok / oom / crashed / timeout. Ctrl-C kills the job, then re-raises."""
    cell_dir.mkdir(parents=True, exist_ok=True)
    cell_json = cell_dir / "cell.json"
    write_json_atomic(cell_json, cfg.to_dict())
    log_dir = cell_dir / "logs"
    cmd = torchrun_command(cfg, cell_json, cell_dir, rdzv, rdzv_id, log_dir, worker_prefix)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           **(env_extra or {})}
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), repo) if p)
    t0 = time.monotonic()
    with open(cell_dir / "launcher.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return Outcome("timeout", f"no result within the cell timeout ({timeout_s:.0f} s); job killed "
                                      f"(raise --cell-timeout if the cell is just slow)", None, None,
                           time.monotonic() - t0)
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            # Whatever happened, no rank of this job may outlive it.
            if proc.poll() is None:
                _kill_group(proc)
            else:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass  # group already gone: nothing left to reap
    wall = time.monotonic() - t0
    result_path = cell_dir / "result.json"
    if rc == 0 and (result_path.exists() or rdzv.node_rank != 0):
        result = json.loads(result_path.read_text()) if result_path.exists() else None
        return Outcome("ok", None, result, rc, wall)
    return _classify_failure(cell_dir, log_dir, rc, wall)


def _classify_failure(cell_dir: Path, log_dir: Path, rc: int, wall: float) -> Outcome:
    errors = [json.loads(p.read_text()) for p in sorted(cell_dir.glob("error-rank*.json"))]
    if any(e["status"] == "oom" for e in errors):
        e = next(e for e in errors if e["status"] == "oom")
        return Outcome("oom", f"rank {e['rank']}: {e['error']}", None, rc, wall)
    launcher_err = (cell_dir / "launcher.log").read_text(errors="replace")
    rank, code = _failed_rank(cell_dir, launcher_err)
    if errors and rank is None:
        rank = errors[0]["rank"]
    first = next((e for e in errors if e["rank"] == rank), errors[0] if errors else None)
    what = first["error"] if first else f"exit {code}"
    tail = _stderr_tail(log_dir, rank)
    return Outcome("crashed", f"rank {rank if rank is not None else '?'} died ({code}): {what}\n{tail}".strip(),
                   None, rc, wall)
