"""``harness history``: each cell's throughput over runs, and the runs where it shifted.

Cells are followed by fingerprint (docs/records.md) across runs given in order (commit order:
the CLI sorts them). A cell's value in a run is its median tokens/s per device (the latest
record of the cell in that run, ``ok`` only). :func:`harness.compare.changepoint.detect_steps`
names the first run after each shift, with its size and confidence.

Pure: :func:`history_frame` and :func:`find_changes` return DataFrames, :func:`history_markdown`
formats them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
from tabulate import tabulate

from harness.compare.changepoint import detect_steps
from harness.compare.stats import bootstrap_ratio_ci
from harness.records.reader import latest_per_cell

MIN_RUNS = 6
"""Fewer runs of a cell than this (two segments of 3) are listed but not searched for steps."""


@dataclass(frozen=True)
class Run:
    """One run directory's records and where it sits in the order."""

    label: str
    records: Sequence[dict[str, Any]]

    def _env(self) -> dict[str, Any]:
        return next((r.get("env") or {} for r in self.records if r.get("kind", "cell") == "cell"), {})

    @property
    def git_sha(self) -> str | None:
        return self._env().get("git_sha")

    @property
    def run_id(self) -> str:
        return str(next((r.get("run_id") for r in self.records if r.get("run_id")), self.label))


def history_frame(runs: Sequence[Run]) -> pd.DataFrame:
    """One row per (cell fingerprint, run) with an ok record: ``fingerprint``, ``cell_id``,
    ``position`` (index in ``runs``), ``run``, ``run_id``, ``git_sha``, ``tokens_per_s_per_device``."""
    rows = []
    for position, run in enumerate(runs):
        for r in latest_per_cell(list(run.records))[0]:
            if r.get("kind", "cell") != "cell" or r.get("status") != "ok":
                continue
            value = (r.get("metrics") or {}).get("tokens_per_s_per_device")
            if value is None or not math.isfinite(float(value)) or float(value) <= 0:
                continue
            rows.append({"fingerprint": r.get("fingerprint"), "cell_id": r.get("cell_id"), "position": position,
                         "run": run.label, "run_id": run.run_id, "git_sha": run.git_sha,
                         "tokens_per_s_per_device": float(value)})
    columns = ["fingerprint", "cell_id", "position", "run", "run_id", "git_sha", "tokens_per_s_per_device"]
    return pd.DataFrame(rows, columns=columns)


def find_changes(frame: pd.DataFrame, alpha: float = 0.01, min_shift: float = 0.05, n_permutations: int = 1999,
                 seed: int = 0) -> pd.DataFrame:
    """One row per detected step: ``cell_id``, ``fingerprint``, the first run after it (``run``,
    ``run_id``, ``git_sha``, ``position``), ``before``/``after`` medians, ``ratio`` after/before,
    its 95% bootstrap CI over the runs of the two segments, ``p_value`` and ``confidence``."""
    rows = []
    for fp, part in frame.groupby("fingerprint", sort=False):
        part = part.sort_values("position")
        if len(part) < MIN_RUNS:
            continue
        values = part["tokens_per_s_per_device"].to_numpy()
        changes = detect_steps(values, alpha=alpha, min_shift=min_shift, n_permutations=n_permutations, seed=seed)
        bounds = [0, *[c.index for c in changes], len(values)]
        for i, c in enumerate(changes):
            before, after = values[bounds[i]:c.index], values[c.index:bounds[i + 2]]
            low, high = bootstrap_ratio_ci(before, after, 2000, seed)
            first = part.iloc[c.index]
            rows.append({"cell_id": first["cell_id"], "fingerprint": fp, "run": first["run"],
                         "run_id": first["run_id"], "git_sha": first["git_sha"], "position": int(first["position"]),
                         "before": c.before_median, "after": c.after_median, "ratio": c.ratio, "ci_low": low,
                         "ci_high": high, "p_value": c.p_value, "confidence": c.confidence})
    columns = ["cell_id", "fingerprint", "run", "run_id", "git_sha", "position", "before", "after", "ratio",
               "ci_low", "ci_high", "p_value", "confidence"]
    return pd.DataFrame(rows, columns=columns)


def history_markdown(frame: pd.DataFrame, changes: pd.DataFrame, runs: Sequence[Run], order: str,
                     alpha: float, min_shift: float) -> str:
    """history.md: the runs in order, the steps found, and each cell's series."""
    out = ["# Throughput history", "",
           f"{len(runs)} runs in {order} order; per cell (fingerprint), median tokens/s per device of each run. "
           f"A step is a shift of at least {min_shift:.0%} that a permutation test puts at p < {alpha} "
           "(`harness/compare/changepoint.py`).", "", "## Steps", ""]
    if changes.empty:
        out += ["No step found in any cell."]
    else:
        rows = [[r.cell_id, f"{r.run} ({(r.git_sha or '?')[:10]})", f"{r.before:,.1f}", f"{r.after:,.1f}",
                 f"{(r.ratio - 1):+.1%}", f"[{r.ci_low:.3f}, {r.ci_high:.3f}]", f"{r.confidence:.2%} (p {r.p_value:.2g})"]
                for r in changes.itertuples(index=False)]
        out += [tabulate(rows, headers=["cell", "first run after the step", "before tok/s/dev", "after tok/s/dev",
                                        "change", "95% CI after/before", "confidence"],
                         tablefmt="github", disable_numparse=True)]
    out += ["", "## Runs", ""]
    out += [f"{i}. `{run.label}` (run {run.run_id}, commit {(run.git_sha or 'unknown')[:10]})"
            for i, run in enumerate(runs)]
    out += ["", "## Series (tokens/s per device)", ""]
    for cell_id, part in frame.groupby("cell_id", sort=True):
        values = ", ".join(f"{v:,.0f}" for v in part.sort_values("position")["tokens_per_s_per_device"])
        short = " (too few runs to search for steps)" if len(part) < MIN_RUNS else ""
        out += [f"- `{cell_id}`: {values}{short}"]
    return "\n".join(out).rstrip() + "\n"
