"""A rank's progress through the measured steps, for the launcher's stall watchdog.

Each rank touches ``<cell dir>/heartbeat-rank<r>`` when its measured window opens and after each
measured step (between steps, never inside the timer), and writes ``done`` into it when the
window closes. ``harness bench --stall-timeout S`` kills a cell in which a rank inside the window
has not finished a step for S seconds: a rank stopped inside a collective (and every peer waiting
on it) is caught in S seconds instead of the whole ``--cell-timeout``, which must stay long enough
for the slowest healthy start-up and compile. Start-up and the untimed steps after the window are
left to the cell timeout.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from harness.records.atomic import write_json_atomic

LAST_BEAT = "heartbeat-last.json"

PREFIX = "heartbeat-rank"
DONE = "done"


class Heartbeat:
    """The worker's side: one file per rank."""

    def __init__(self, cell_dir: Path, rank: int) -> None:
        self.path = cell_dir / f"{PREFIX}{rank}"

    def open_window(self) -> None:
        self.path.write_text("measuring")

    def beat(self) -> None:
        os.utime(self.path)

    def close_window(self) -> None:
        self.path.write_text(DONE)


def heartbeat_files(cell_dir: Path) -> list[Path]:
    return sorted(cell_dir.glob(f"{PREFIX}*"))


class StallWatch:
    """The launcher's side: :meth:`stalled` is polled while the job runs; ``reason`` says which rank."""

    def __init__(self, cell_dir: Path, stall_s: float) -> None:
        self.cell_dir, self.stall_s = cell_dir, stall_s
        self.reason: str | None = None

    def stalled(self) -> bool:
        now = time.time()
        idle: dict[str, float] = {}
        for path in heartbeat_files(self.cell_dir):
            try:
                if path.read_text() != DONE:
                    idle[path.name.removeprefix(PREFIX)] = now - path.stat().st_mtime
            except FileNotFoundError:
                continue
        stuck = sorted((r for r, s in idle.items() if s > self.stall_s), key=int)
        if not stuck:
            return False
        # A rank stopped inside a collective stalls its peers too: every stalled rank is named.
        self.reason = (f"no measured step finished for {max(idle[r] for r in stuck):.0f} s on rank"
                       f"{'s' if len(stuck) > 1 else ''} {', '.join(stuck)} (--stall-timeout {self.stall_s:g}): "
                       f"a rank stopped, or stuck in a collective; job killed")
        return True


def clear(cell_dir: Path) -> None:
    """The files are the job's working state, never a result: removed before and after each job. When the last
    measured step ended is kept (``heartbeat-last.json``): a cell resumed from its checkpoint counts the time its
    cut attempt ran after the save (:mod:`harness.run.resume`)."""
    files = heartbeat_files(cell_dir)
    beats = []
    for path in files:
        with contextlib.suppress(FileNotFoundError):  # a rank's file removed meanwhile: it has no beat to keep
            beats.append(path.stat().st_mtime)
    if beats:
        write_json_atomic(cell_dir / LAST_BEAT, {"epoch": max(beats)})
    for path in files:
        path.unlink(missing_ok=True)
