"""Reading Nsight Systems reports back: the harness's NVTX ranges per rank, checked against the steps run.

Each ``.nsys-rep`` is exported to SQLite (``nsys export --type sqlite``) and its ``NVTX_EVENTS``
read with the standard library. The export's schema has held since 2021: event kinds are looked up
by name in ``ENUM_NSYS_EVENT_TYPE`` (``NvtxPushPopRange``, ``NvtxStartEndRange``, ``NvtxCategory``,
``NvtxDomainCreate``), never by number; a range's message is its ``text`` or, for registered strings,
``StringIds.value`` of its ``textId``.

``nsys stats``'s report names changed in 2023 (``nvtxsum`` became ``nvtx_sum``); the names the
installed nsys knows are read from ``nsys stats --help-reports``.
"""

from __future__ import annotations

import re
import sqlite3
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from harness.measure.nvtx_ranges import DOMAIN_NAME, PHASES

EXPORT_TIMEOUT_S = 300.0
NVTX_SUMMARY_NAMES: tuple[str, ...] = ("nvtx_sum", "nvtxsum")
"""The NVTX range summary of ``nsys stats``: 2023.x and later, then 2022.x and earlier."""
KERNEL_SUMMARY_NAMES: tuple[str, ...] = ("cuda_gpu_kern_sum", "gpukernsum")
NCCL_PREFIX = "nccl"


PID_BITS = 24
"""nsys's ``globalTid``/``globalPid`` carry the process id in bits 24-47."""


def pid_of(global_id: int) -> int:
    return (int(global_id) >> PID_BITS) & 0xFFFFFF


@dataclass(frozen=True)
class NvtxRange:
    name: str
    start_ns: int
    end_ns: int
    payload: int | None = None
    pid: int = 0

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


@dataclass
class RankCapture:
    """What one rank's report holds of the harness's ranges."""

    rank: int
    report: str
    ranges: int
    """All ``harness`` domain ranges in the report."""
    windows: int
    window_s: float | None
    steps_total: int
    """``step`` ranges anywhere: warmup, measured and the untimed extra steps."""
    steps_in_window: int
    """``step`` ranges inside the measured window: must equal the measured steps."""
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per phase inside the window: ``{"count": n, "total_s": s}``."""
    kernels: int | None = None
    """CUDA kernels recorded (None: the report traced no CUDA)."""
    nccl_kernels: int | None = None

    def as_dict(self) -> dict:
        return {"rank": self.rank, "report": self.report, "ranges": self.ranges, "windows": self.windows,
                "window_s": self.window_s, "steps_total": self.steps_total, "steps_in_window": self.steps_in_window,
                "phases": self.phases, "kernels": self.kernels, "nccl_kernels": self.nccl_kernels}


def export_sqlite(nsys: str, report: Path, timeout_s: float = EXPORT_TIMEOUT_S) -> Path:
    """``<report>.sqlite`` beside the report (exported once; an existing export is reused)."""
    out = report.with_suffix(".sqlite")
    if not out.exists():
        res = subprocess.run([nsys, "export", "--type", "sqlite", "--force-overwrite", "true", "--output", str(out),
                              str(report)], capture_output=True, text=True, timeout=timeout_s)
        if res.returncode != 0 or not out.exists():
            tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"nsys export of {report} failed (exit {res.returncode}): {tail[0]}")
    return out


def _event_ids(db: sqlite3.Connection) -> dict[str, int]:
    rows = db.execute("SELECT id, name FROM ENUM_NSYS_EVENT_TYPE").fetchall()
    return {name: int(i) for i, name in rows}


def _has_table(db: sqlite3.Connection, name: str) -> bool:
    return db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?", (name,)).fetchone() is not None


def read_ranges(sqlite_path: Path, domain: str = DOMAIN_NAME) -> list[NvtxRange]:
    """The closed ranges of NVTX domain ``domain``, in start order."""
    with sqlite3.connect(f"file:{sqlite_path}?mode=ro", uri=True) as db:
        if not _has_table(db, "NVTX_EVENTS"):
            return []
        ids = _event_ids(db)
        kinds = tuple(ids[k] for k in ("NvtxPushPopRange", "NvtxStartEndRange") if k in ids)
        domain_ids = [r[0] for r in db.execute("SELECT domainId FROM NVTX_EVENTS WHERE eventType=? AND text=?",
                                                (ids.get("NvtxDomainCreate", -1), domain))]
        if not kinds or not domain_ids:
            return []
        marks = ",".join("?" * len(kinds))
        dmarks = ",".join("?" * len(domain_ids))
        rows = db.execute(
            f"SELECT COALESCE(e.text, s.value), e.start, e.end, COALESCE(e.int64Value, e.uint64Value), e.globalTid "
            f"FROM NVTX_EVENTS e LEFT JOIN StringIds s ON s.id = e.textId "
            f"WHERE e.eventType IN ({marks}) AND e.domainId IN ({dmarks}) AND e.end IS NOT NULL ORDER BY e.start",
            (*kinds, *domain_ids)).fetchall()
    return [NvtxRange(str(name), int(start), int(end), None if payload is None else int(payload),
                      pid_of(tid) if tid is not None else 0)
            for name, start, end, payload, tid in rows if name is not None]


def _kernel_counts(sqlite_path: Path) -> dict[int, tuple[int, int]] | None:
    """``{pid: (kernels, NCCL kernels)}``, or None when the report traced no CUDA kernel."""
    with sqlite3.connect(f"file:{sqlite_path}?mode=ro", uri=True) as db:
        if not _has_table(db, "CUPTI_ACTIVITY_KIND_KERNEL"):
            return None
        rows = db.execute("SELECT k.globalPid, COUNT(*), SUM(lower(s.value) LIKE ?) FROM CUPTI_ACTIVITY_KIND_KERNEL k "
                          "LEFT JOIN StringIds s ON s.id = k.shortName GROUP BY k.globalPid",
                          (f"{NCCL_PREFIX}%",)).fetchall()
    return {pid_of(g): (int(n), int(nccl or 0)) for g, n, nccl in rows}


def ranks_of(ranges: list[NvtxRange]) -> dict[int, int]:
    """``{pid: rank}``: each rank's process marks its ``window`` range with its rank as payload."""
    return {r.pid: r.payload for r in ranges if r.name == "window" and r.payload is not None}


def summarize(rank: int, report: str, ranges: list[NvtxRange],
              kernels: tuple[int | None, int | None] = (None, None)) -> RankCapture:
    """One rank's capture: the window, the steps inside it, each phase's count and time inside it."""
    windows = [r for r in ranges if r.name == "window"]
    window = windows[0] if windows else None

    def inside(r: NvtxRange) -> bool:
        return window is not None and window.start_ns <= r.start_ns and r.end_ns <= window.end_ns

    steps = [r for r in ranges if r.name == "step"]
    phases = {}
    for phase in PHASES:
        if phase in ("step", "window"):
            continue
        hits = [r for r in ranges if r.name == phase and inside(r)]
        if hits:
            phases[phase] = {"count": len(hits), "total_s": sum(r.seconds for r in hits)}
    return RankCapture(rank=rank, report=report, ranges=len(ranges), windows=len(windows),
                       window_s=window.seconds if window else None, steps_total=len(steps),
                       steps_in_window=sum(1 for r in steps if inside(r)), phases=phases,
                       kernels=kernels[0], nccl_kernels=kernels[1])


def read_capture(nsys: str, report: Path) -> dict[int, RankCapture]:
    """Export ``report`` and summarise the harness's ranges in it, per rank (a process per rank)."""
    db = export_sqlite(nsys, report)
    ranges = read_ranges(db)
    kernels = _kernel_counts(db)
    by_rank = {}
    for pid, rank in ranks_of(ranges).items():
        mine = [r for r in ranges if r.pid == pid]
        counts = (kernels or {}).get(pid, (0, 0)) if kernels is not None else (None, None)
        by_rank[rank] = summarize(rank, report.name, mine, counts)
    return by_rank


def capture_problem(captures: dict[int, RankCapture], ranks: range, measured_steps: int) -> str | None:
    """Why a capture cannot be trusted, in one line with the fix, or None when each of ``ranks`` has
    one window with exactly ``measured_steps`` steps in it."""
    if not captures:
        return (f"no '{DOMAIN_NAME}' NVTX window was recorded for any rank, so the timeline has no steps; "
                "check the record's metrics.nvtx (an nvtx package that nsys disabled: pip install 'nvtx<0.2.12' "
                "if the harness could not open the domain itself) and nsys's own output in the cell's logs")
    missing = [r for r in ranks if captures.get(r) is None]
    if missing:
        return (f"no '{DOMAIN_NAME}' NVTX ranges for rank(s) {', '.join(map(str, missing))} of "
                f"{', '.join(map(str, ranks))}; the capture missed them (see nsys's output in the cell's logs)")
    for rank in ranks:
        cap = captures[rank]
        assert cap is not None
        if cap.windows != 1:
            return f"{cap.report}: {cap.windows} measured-window ranges, expected 1; the capture is incomplete"
        if cap.steps_in_window != measured_steps:
            return (f"{cap.report}: {cap.steps_in_window} step ranges in the measured window, but {measured_steps} "
                    "steps were run; the capture lost ranges (nsys buffer full or the capture range ended early)")
    return None


def stats_report_names(nsys: str) -> dict[str, str]:
    """``{"nvtx": name, "kernels": name}`` of the summaries this nsys knows (2022.x and 2023+ differ)."""
    res = subprocess.run([nsys, "stats", "--help-reports"], capture_output=True, text=True, timeout=60)
    known = set(re.findall(r"^\s*([a-z_0-9]+)(?:\[|\s+--)", res.stdout, flags=re.MULTILINE))
    names = {}
    for key, candidates in (("nvtx", NVTX_SUMMARY_NAMES), ("kernels", KERNEL_SUMMARY_NAMES)):
        for name in candidates:
            if name in known:
                names[key] = name
                break
    return names


def stats_command(nsys: str, report_name: str, report: Path) -> list[str]:
    """``nsys stats`` of one summary, as a table on stdout (reads the ``.sqlite`` export beside the report)."""
    return [nsys, "stats", "--quiet", "--report", report_name, "--format", "column", "--output", "-", str(report)]
