"""Where a cell's wall time goes: wall-clock marks at the end of each phase of a rank's life.

A rank marks the end of each phase with ``time.time()`` (comparable across the processes of one
node, unlike ``perf_counter``); the process's own start time comes from the kernel
(``psutil.Process().create_time()``, 10 ms resolution). The launcher's start and end of the job
close the timeline, and :func:`harness.run.formulas.overhead_parts` turns the marks into seconds
per phase that sum to the job's wall time.
"""

from __future__ import annotations

import json
import os
import time

import psutil

PHASES = ("imports", "process_group", "build", "warmup", "measured", "extra_steps", "profile", "result")
"""The marks a worker takes, in order; each is the end of the phase it names:

* ``imports``: the worker's entry point is running (Python and every import done);
* ``process_group``: ``init_process_group`` returned;
* ``build``: model built, parallelized, optimizer made;
* ``warmup``, ``measured``: the end of the warmup and of the measured steps;
* ``extra_steps``: the untimed steps after the window (communication count, tensor bytes);
* ``profile``: the profiled steps (``--profile``; absent otherwise);
* ``result``: every rank's measurements gathered and the result built (rank 0)."""


LAUNCHER_MARKS_ENV = "HARNESS_LAUNCHER_MARKS"
"""Set by :mod:`harness.run.fork_server` in a forked rank: the process start and imports of the
server it was forked from, which are the rank's own start-up (before the job, for every cell but the
one that started the server)."""


class PhaseMarks:
    def __init__(self, marks: dict[str, float] | None = None) -> None:
        self.marks: dict[str, float] = dict(marks) if marks else {"process_start": psutil.Process().create_time()}

    @classmethod
    def of_this_process(cls) -> PhaseMarks:
        """Called by an entry point once its imports are done: this process's start and imports, or
        those of the launcher that forked it (the fork is then part of the next phase)."""
        inherited = os.environ.get(LAUNCHER_MARKS_ENV)
        if inherited:
            return cls(json.loads(inherited))
        marks = cls()
        marks.mark("imports")
        return marks

    def mark(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; one of {', '.join(PHASES)}")
        self.marks[phase] = time.time()
