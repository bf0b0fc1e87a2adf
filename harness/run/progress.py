"""Sweep progress: cells done/total, current cell, elapsed and ETA.

A tqdm bar on a terminal; plain lines (one per cell) when stdout is not a TTY (CI, logs).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm


def _hms(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Progress:
    def __init__(self, total: int, stream: TextIO | None = None, tty: bool | None = None) -> None:
        self.total = total
        self.done = 0
        self.stream = stream or sys.stdout
        self.t0 = time.monotonic()
        self.tty = self.stream.isatty() if tty is None else tty
        self._bar = None
        if self.tty and total:
            self._bar = tqdm(total=total, file=self.stream, unit="cell", dynamic_ncols=True)

    def eta_s(self) -> float | None:
        if self.done == 0:
            return None
        return (time.monotonic() - self.t0) / self.done * (self.total - self.done)

    def start(self, cell_id: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(cell_id)
        else:
            print(f"[{self.done + 1}/{self.total}] {cell_id} ... (elapsed {_hms(time.monotonic() - self.t0)})",
                  file=self.stream, flush=True)

    def finish(self, cell_id: str, status: str, detail: str = "") -> None:
        self.done += 1
        eta = self.eta_s()
        line = f"[{self.done}/{self.total}] {cell_id}: {status}" + (f" {detail}" if detail else "")
        line += f" | elapsed {_hms(time.monotonic() - self.t0)}" + (f" eta {_hms(eta)}" if eta is not None else "")
        if self._bar is not None:
            self._bar.write(line)
            self._bar.update(1)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
