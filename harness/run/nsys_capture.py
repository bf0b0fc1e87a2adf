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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harness.errors import UsageError
from harness.measure import nsys as nsys_cmd
from harness.measure.nsys import NO_NSYS
from harness.measure.nsys_reports import RankCapture, capture_problem, read_capture
from harness.planner import PlannedCell
from harness.run.launch import Outcome


@dataclass(frozen=True)
class NsysTool:
    """The nsys a sweep captures with."""

    path: str
    version: str

    @classmethod
    def find(cls) -> NsysTool | None:
        path = nsys_cmd.nsys_available()
        if path is None:
            return None
        res = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
        return cls(path, (res.stdout.strip().splitlines() or ["version unknown"])[0])


def nsys_tool(spec) -> NsysTool:
    """The nsys for ``--nsys`` / ``--tracer nsys``, or a UsageError saying why there is none to use."""
    if not spec.nvtx:
        raise UsageError("--nvtx off: an nsys capture is checked by the harness's NVTX ranges; drop --nvtx off")
    tool = NsysTool.find()
    if tool is None:
        raise UsageError(NO_NSYS)
    return tool


def _local_ranks(cell: PlannedCell, node_rank: int) -> range:
    assert cell.config is not None, f"valid cell {cell.cell_id} has no config"
    per_node = cell.config.world_size // cell.config.nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def captured_job(tool: NsysTool, job: Callable[[list[str], dict[str, str]], Outcome], cell: PlannedCell,
                 cell_dir: Path, device_kind: str, node_rank: int = 0) -> tuple[Outcome, dict]:
    """Run ``job(launcher_prefix, env)`` under one nsys session; return its outcome and ``metrics.nsys``.

    Whatever ends the job (its end, a failure, Ctrl-C, SIGTERM), the session's processes are
    ended before this returns or raises (:func:`harness.measure.nsys.end_sessions`)."""
    cfg = cell.config
    assert cfg is not None, f"valid cell {cell.cell_id} has no config"
    tag = secrets.token_hex(4)
    report = nsys_cmd.report_path(cell_dir / "nsys", cell.cell_id, cfg.nnodes, node_rank)
    report.parent.mkdir(parents=True, exist_ok=True)
    try:
        outcome = job(nsys_cmd.nsys_command(tool.path, report, tag, device_kind,
                                            "all" if device_kind == "cuda" else None), {nsys_cmd.TAG_ENV: tag})
    finally:
        leftover = nsys_cmd.end_sessions(tag)
    ranks = _local_ranks(cell, node_rank)
    captures: dict[int, RankCapture] = {}
    problem = None
    if not report.exists():
        problem = f"nsys wrote no {report.name}; see nsys's output in the cell's logs ({cell_dir / 'launcher.log'})"
    else:
        try:
            captures = read_capture(tool.path, report)
        except (RuntimeError, subprocess.TimeoutExpired, sqlite3.Error) as exc:
            problem = f"{report.name}: could not be read back: {exc}"
    if problem is None and outcome.status == "ok":
        problem = capture_problem(captures, ranks, cfg.steps)
    return outcome, {
        "tool": tool.version, "report": str(report), "measured_steps": cfg.steps,
        "ranks": [captures[r].as_dict() if r in captures else {"rank": r, "ranges": 0} for r in ranks],
        "processes_ended_after": len(leftover), "problem": problem,
    }
