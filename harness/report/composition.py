"""Records -> step composition rows: measured where the cell was profiled, else the model's.

Measured: ``metrics.trace.composition`` (per profiled step, mean over ranks; parts of
:data:`harness.measure.step_composition.PARTS`). Predicted: ``predicted.breakdown`` (the analytic
model's compute, optimizer, exposed communication and pipeline bubble). Pure: DataFrames only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

from harness.measure.step_composition import PARTS
from harness.records.reader import latest_per_cell
from harness.report.frame import get, num

PREDICTED_PARTS = {"compute": "compute_s", "optimizer": "optimizer_s", "comm_exposed": "exposed_comm_s",
                   "bubble": "bubble_s"}
COLUMNS = ["cell_id", "strategy", "precision", "world_size", "basis", "source", "part", "seconds", "share_pct"]


def composition_frame(records: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """Long frame, one row per (ok cell, part): ``basis`` is ``measured`` or ``predicted``, ``source``
    ``cpu-ops`` / ``gpu-kernels`` / ``harness.model``; ``seconds`` per step, ``share_pct`` of the step."""
    rows: list[dict[str, Any]] = []
    for r in latest_per_cell(list(records))[0]:
        if r.get("kind", "cell") != "cell" or r.get("status") != "ok":
            continue
        cfg = r.get("config") or {}
        base = {"cell_id": r.get("cell_id"), "strategy": cfg.get("strategy"), "precision": cfg.get("precision"),
                "world_size": cfg.get("world_size")}
        measured = get(r, "metrics", "trace", "composition")
        breakdown = get(r, "predicted", "breakdown")
        if isinstance(measured, dict) and measured.get("parts_s"):
            step = num(measured.get("step_s"))
            for part in PARTS:
                s = num(measured["parts_s"].get(part))
                rows.append({**base, "basis": "measured", "source": measured.get("source"), "part": part,
                             "seconds": s, "share_pct": 100.0 * s / step if step > 0 else float("nan")})
        elif isinstance(breakdown, dict) and num(get(r, "predicted", "step_time_s")) > 0:
            step = num(get(r, "predicted", "step_time_s"))
            for part, key in PREDICTED_PARTS.items():
                s = num(breakdown.get(key))
                rows.append({**base, "basis": "predicted", "source": "harness.model", "part": part,
                             "seconds": s, "share_pct": 100.0 * s / step})
    return pd.DataFrame(rows, columns=COLUMNS)


def top_ops_frame(records: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """``metrics.trace.top_ops`` of every profiled ok cell, one row per op."""
    rows = []
    for r in latest_per_cell(list(records))[0]:
        ops = get(r, "metrics", "trace", "top_ops")
        if r.get("kind", "cell") == "cell" and r.get("status") == "ok" and isinstance(ops, list):
            rows += [{"cell_id": r.get("cell_id"), **op} for op in ops]
    return pd.DataFrame(rows, columns=["cell_id", "name", "kind", "calls", "self_s", "share_pct"])
