"""What ``torch.compile`` did in this process: frames compiled, graphs, graph breaks.

Read from dynamo's process-wide counters (``torch._dynamo.utils.counters``, what torch's own
tests and ``tlparse`` summaries read): a snapshot before and after a span of steps says how
many frames were (re)compiled in it. A compiled cell that compiles a frame inside its measured
window paid compile time in a timed step, and its record says so.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

COUNTED_STEPS_EAGER = ("the untimed steps that count collectives and (on CPU) live tensor bytes run under a "
                       "Python dispatch mode, under which torch runs compiled code eagerly: their comm bytes are "
                       "the same collectives, their peak_tensor_gib is the eager step's")


@dataclass(frozen=True)
class DynamoCounts:
    frames: int
    """Frames dynamo compiled (each recompilation counts again)."""
    graphs: int
    """Distinct FX graphs captured."""
    graph_breaks: int
    """Graph breaks hit while compiling (each splits a frame's graph)."""

    def since(self, before: DynamoCounts) -> DynamoCounts:
        return DynamoCounts(self.frames - before.frames, self.graphs - before.graphs,
                            self.graph_breaks - before.graph_breaks)


def dynamo_counts() -> DynamoCounts:
    """The counters now (all zero in a process that never compiled)."""
    from torch._dynamo.utils import counters  # noqa: PLC0415  (importing dynamo costs ~1 s; only compiled cells pay)

    return DynamoCounts(frames=int(counters["frames"]["total"]), graphs=int(counters["stats"]["unique_graphs"]),
                        graph_breaks=int(sum(counters["graph_break"].values())))


def frames_so_far() -> int:
    """Frames dynamo has compiled in this process, without importing dynamo where nothing did (0 then): what an
    eager cell's compile claim is checked against, at no cost to a process that never compiled."""
    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["frames"]["total"]) if utils is not None else 0


def compile_metrics(warmup_s: list[float], median_step_s: float, warmup: DynamoCounts,
                    measured: DynamoCounts) -> dict:
    """``metrics.compile``: compile time (what the warmup steps took beyond a measured step), the
    frames, graphs and graph breaks compiled in warmup, and any frame compiled in the measured window."""
    return {
        "compile_s": sum(max(0.0, t - median_step_s) for t in warmup_s),
        "frames_compiled": warmup.frames,
        "graphs": warmup.graphs,
        "graph_breaks": warmup.graph_breaks,
        "frames_compiled_in_measured_window": measured.frames,
        "recompiled_in_measured_window": measured.frames > 0,
        "counted_steps_eager": COUNTED_STEPS_EAGER,
    }
