"""One cell under Nsight Systems: its ranks started by ``nsys profile``, nothing nsys started left
running afterwards, and the reports read back and checked against the steps run.

Used by ``harness trace`` and ``harness bench --nsys``. The ranks start through torchrun (the fork
server cannot put nsys in front of a rank). The check's result goes in the record as
``metrics.nsys``; a capture with no ranges or fewer steps than were run is a one-line ``problem``.
"""

from __future__ import annotations

import secrets
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harness.errors import UsageError
from harness.measure import nsys as nsys_cmd
from harness.measure.nsys import NO_NSYS
from harness.measure.nsys_reports import RankCapture, capture_problem, read_capture
from harness.planner import PlannedCell
from harness.run.launch import Outcome
from harness.text import first_line

REPORT_WAIT_S = 30.0
"""How long a capture may go without progress once rank 0 is done before it is ended as hung
(``--nsys-wait``): no importer running and no byte read or written by its nsys processes. A healthy
agent's quiet stretches here lasted a few seconds; a hung one stayed quiet (and at a full core) for
good (docs/nsys.md, "A hung capture")."""

CAPTURE_ATTEMPTS = 3
"""Captures of one cell at most, on one node: the first and, while each ends hung, up to two more. A retry
right after a hung capture hung again in 7 of 11 captures beside a busy loop here and once on an idle CI
machine (docs/nsys.md): one retry left that to chance, each further one costs a capture (seconds on CPU)."""


@dataclass(frozen=True)
class NsysTool:
    """The nsys a sweep captures with, and how long a capture may outlive its ranks."""

    path: str
    version: str
    report_wait_s: float = REPORT_WAIT_S

    @classmethod
    def find(cls, report_wait_s: float = REPORT_WAIT_S) -> NsysTool | None:
        path = nsys_cmd.nsys_available()
        if path is None:
            return None
        res = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
        return cls(path, (res.stdout.strip().splitlines() or ["version unknown"])[0], report_wait_s)


def check_report_wait(report_wait_s: float) -> None:
    if not report_wait_s > 0:
        raise UsageError(f"--nsys-wait {report_wait_s:g}: the seconds a capture may go without progress once "
                         f"rank 0 is done must be > 0; give e.g. {REPORT_WAIT_S:g}")


def nsys_tool(spec, report_wait_s: float = REPORT_WAIT_S) -> NsysTool:
    """The nsys for ``--nsys`` / ``--tracer nsys``, or a UsageError saying why there is none to use."""
    if not spec.nvtx:
        raise UsageError("--nvtx off: an nsys capture is checked by the harness's NVTX ranges; drop --nvtx off")
    check_report_wait(report_wait_s)
    tool = NsysTool.find(report_wait_s)
    if tool is None:
        raise UsageError(NO_NSYS)
    return tool


class ReportWait:
    """The bounded wait of one capture, polled while its job runs.

    The job is over once rank 0 has written ``result`` (every rank has finished measuring) or no launcher
    or rank of the capture is left (a failure, or a node that writes no result). From then on only nsys
    works: its agent reads what the ranks recorded, then its importer writes the report. A capture is
    hung when, past that point, no importer runs and none of its nsys processes has read or written a
    byte for ``limit_s``: nsys 2022.4's agent can spin at a full core with no I/O and never write the
    report (docs/nsys.md, "A hung capture"), which would otherwise hold the cell until its timeout. A big
    healthy capture is never cut short for its size: it reads and writes all the while."""

    def __init__(self, tag: str, limit_s: float, result: Path) -> None:
        self.tag, self.limit_s, self.result = tag, limit_s, result
        self.seen = False
        self.over_at: float | None = None
        self.active_at = 0.0
        self.last: nsys_cmd.SessionActivity | None = None
        self.hung = False

    def _over(self) -> bool:
        if self.result.exists():
            return True
        if nsys_cmd.workload_alive(self.tag):
            self.seen = True
            return False
        return self.seen  # before nsys started the launcher, nothing is over yet

    def __call__(self) -> bool:
        now = time.monotonic()
        if self.over_at is None:
            if not self._over():
                return False
            self.over_at = self.active_at = now
        activity = nsys_cmd.session_activity(self.tag)
        if activity.importing or activity != self.last:
            self.active_at = now
        self.last = activity
        self.hung = now - self.active_at > self.limit_s
        return self.hung

    def waited_s(self, end: float) -> float:
        """Seconds from the job's end as polled (every ``harness.jobs.WATCH_POLL_S``) to ``end``: what
        the capture added after the ranks were done (0 when it ended within one poll)."""
        return 0.0 if self.over_at is None else round(max(0.0, end - self.over_at), 2)


@dataclass(frozen=True)
class Attempt:
    """What one capture's job gets: where it runs, nsys's command in front of its launcher, the
    environment that tags its processes, and the bounded wait to poll."""

    where: Path
    prefix: list[str]
    env: dict[str, str]
    over: ReportWait


def _local_ranks(cell: PlannedCell, node_rank: int) -> range:
    assert cell.config is not None, f"valid cell {cell.cell_id} has no config"
    per_node = cell.config.world_size // cell.config.nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def _attempt(tool: NsysTool, job: Callable[[Attempt], Outcome], where: Path, report: Path,
             device_kind: str) -> tuple[Outcome, dict]:
    """One capture: the job under a fresh nsys session, whatever is left of the session ended afterwards."""
    tag = secrets.token_hex(4)
    report.parent.mkdir(parents=True, exist_ok=True)
    wait = ReportWait(tag, tool.report_wait_s, where / "result.json")
    cmd = nsys_cmd.nsys_command(tool.path, report, tag, device_kind, "all" if device_kind == "cuda" else None)
    t0 = time.monotonic()
    try:
        outcome = job(Attempt(where, cmd, {nsys_cmd.TAG_ENV: tag}, wait))
        end = time.monotonic()
    finally:
        leftover = nsys_cmd.end_sessions(tag)
        cleared = nsys_cmd.clear_stale_state() if wait.hung or leftover else []
    return outcome, {"report": str(report), "hung": wait.hung, "report_wait_s": wait.waited_s(end),
                     "wall_s": round(end - t0, 2), "processes_ended_after": len(leftover), "cleared": cleared}


def retry_suffix(attempt: int) -> str:
    """The name part of capture ``attempt`` (2, 3, ...): its folder ``nsys-<suffix>`` and report ``<id>.<suffix>.nsys-rep``
    (``retry``, ``retry2``, ...: the first retry keeps its name from before there were more)."""
    return "retry" if attempt == 2 else f"retry{attempt - 1}"


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def captured_job(tool: NsysTool, job: Callable[[Attempt], Outcome], cell: PlannedCell, cell_dir: Path,
                 device_kind: str, node_rank: int = 0) -> tuple[Outcome, dict]:
    """Run ``job`` under nsys; return its outcome and ``metrics.nsys``.

    Whatever ends the job (its end, a failure, Ctrl-C, SIGTERM), the session's processes are ended
    before this returns or raises (:func:`harness.measure.nsys.end_sessions`). A capture that has not
    made progress for ``tool.report_wait_s`` once rank 0 was done (:class:`ReportWait`) is ended and, on one node, taken
    once more in ``cell_dir/nsys-retry`` (then ``nsys-retry2``, up to :data:`CAPTURE_ATTEMPTS` captures; the cell's
    outcome stays the first run's, only the trace is redone); a last hang is the capture's problem line, never the
    cell's timeout."""
    cfg = cell.config
    assert cfg is not None, f"valid cell {cell.cell_id} has no config"
    report = nsys_cmd.report_path(cell_dir / "nsys", cell.cell_id, cfg.nnodes, node_rank)
    outcome, first = _attempt(tool, job, cell_dir, report, device_kind)
    attempts, last = [first], outcome
    while attempts[-1]["hung"] and last.status == "ok" and cfg.nnodes == 1 and len(attempts) < CAPTURE_ATTEMPTS:
        _say(f"{cell.cell_id}: nsys made no progress on its report for {tool.report_wait_s:g} s after rank 0 was done "
             f"(a hung capture, docs/nsys.md); ended it and capturing once more (the measurement is the first run's)")
        suffix = retry_suffix(len(attempts) + 1)
        retry = report.with_name(report.name.removesuffix(".nsys-rep") + f".{suffix}.nsys-rep")
        last, again = _attempt(tool, job, cell_dir / f"nsys-{suffix}", retry, device_kind)
        attempts.append(again)
    report = Path(attempts[-1]["report"])
    ranks = _local_ranks(cell, node_rank)
    captures: dict[int, RankCapture] = {}
    problem = None
    if attempts[-1]["hung"]:
        problem = (f"nsys made no progress on {report.name} for {tool.report_wait_s:g} s after rank 0 was done, in "
                   f"{len(attempts)} attempt(s){'' if cfg.nnodes == 1 else ' (not retried across nodes)'}; "
                   f"the capture was ended (docs/nsys.md, 'A hung capture')")
    elif not report.exists():
        problem = f"nsys wrote no {report.name}; see nsys's output in the cell's logs ({cell_dir / 'launcher.log'})"
    else:
        try:
            captures = read_capture(tool.path, report)
        except (RuntimeError, subprocess.TimeoutExpired, sqlite3.Error) as exc:
            problem = f"{report.name}: could not be read back: {exc}"
    if problem is None and last.status == "ok":
        problem = capture_problem(captures, ranks, cfg.steps)
    elif problem is None and last is not outcome:
        problem = f"the capture's attempt {len(attempts)} (a retry) ended {last.status}: {first_line(last.error or '')}"
    return outcome, {
        "tool": tool.version, "report": str(report), "measured_steps": cfg.steps,
        "ranks": [captures[r].as_dict() if r in captures else {"rank": r, "ranges": 0} for r in ranks],
        "processes_ended_after": sum(a["processes_ended_after"] for a in attempts), "problem": problem,
        "attempts": attempts,
        # the first capture's wait past the ranks' end when it hung, then the whole retry (its own wait included)
        "seconds_lost": round((first["report_wait_s"] if first["hung"] else 0.0)
                              + sum(a["wall_s"] for a in attempts[1:]), 2),
    }
