"""What each lever bought: every ok cell that pulls a lever beside the same cell without it.

One row per (cell, lever) whose counterpart (every config field equal, that one lever unpulled)
finished in the same records:

* ``speedup``: counterpart median step time / this cell's (> 1: the lever made the step faster);
* ``peak mem %``: change of the peak (tensor bytes on CPU, where RSS cannot tell activations
  apart; the allocator's peak on a GPU) against the counterpart, and what the model predicted
  for the same change (``predicted.peak_tensor_gib`` or ``peak_mem_gib``): the activation
  checkpointing rows hold the memory model's recompute choices against measurement;
  On CPU a compiled cell's tensor bytes are counted on a step torch runs eagerly (a Python
  dispatch mode is active), so compile rows show no measured memory change there (``n/a``);
* ``compile s``: compile time of a compiled cell (``metrics.compile.compile_s``), and whether a
  frame was compiled inside the measured window (then its step times are not steady state).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
from tabulate import tabulate

from harness.records.reader import latest_per_cell
from harness.records.record import FINGERPRINT_LEVERS, pulled_levers
from harness.report.frame import get, num
from harness.text import fmt_or

COLUMNS = ["cell_id", "lever", "vs", "speedup", "step_time_pct", "peak_mem_pct", "predicted_peak_mem_pct",
           "peak_measure", "compile_s", "recompiled"]


def _key(config: dict[str, Any]) -> str:
    """Every field but the levers: two configs with equal keys differ in levers only."""
    return json.dumps({k: v for k, v in config.items() if k not in FINGERPRINT_LEVERS}, sort_keys=True, default=str)


def _peak(r: dict[str, Any], side: str) -> tuple[float, str]:
    src = r.get(side) or {}
    tensor = num(src.get("peak_tensor_gib"))
    return (tensor, "tensor bytes") if np.isfinite(tensor) else (num(src.get("peak_mem_gib")), "peak_mem_gib")


def _pct(new: float, old: float) -> float:
    return 100.0 * (new - old) / old if old and np.isfinite(old) and np.isfinite(new) else np.nan


def lever_frame(records: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """One row per (ok cell, lever it pulls) with a finished counterpart; columns :data:`COLUMNS`."""
    ok = [r for r in latest_per_cell(list(records))[0]
          if r.get("kind", "cell") == "cell" and r.get("status") == "ok" and r.get("config")]
    rows = []
    for r in ok:
        for lever in pulled_levers(r["config"]):
            want = {**pulled_levers(r["config"])}
            del want[lever]
            base = next((b for b in ok if _key(b["config"]) == _key(r["config"])
                         and pulled_levers(b["config"]) == want), None)
            if base is None:
                continue
            t, t0 = num(get(r, "metrics", "step_time_s", "median")), num(get(base, "metrics", "step_time_s", "median"))
            (m, measure), (m0, _) = _peak(r, "metrics"), _peak(base, "metrics")
            (p, _), (p0, _) = _peak(r, "predicted"), _peak(base, "predicted")
            label = {"compile": "compile", "ac": f"ac {r['config']['ac']}", "optimizer": r["config"]["optimizer"]}[lever]
            if lever == "compile" and measure == "tensor bytes":  # counted on an eager step: no compile effect
                m = np.nan
            rows.append({"cell_id": r["cell_id"], "lever": label, "vs": base["cell_id"],
                         "speedup": t0 / t if t else np.nan, "step_time_pct": _pct(t, t0),
                         "peak_mem_pct": _pct(m, m0), "predicted_peak_mem_pct": _pct(p, p0), "peak_measure": measure,
                         "compile_s": num(get(r, "metrics", "compile", "compile_s")) if lever == "compile" else np.nan,
                         "recompiled": get(r, "metrics", "compile", "recompiled_in_measured_window")
                         if lever == "compile" else None})
    return pd.DataFrame(rows, columns=COLUMNS)


def compile_speedup(records: Sequence[dict[str, Any]], device_name: str) -> tuple[float | None, int]:
    """The median speedup of ``torch.compile`` over the compiled cells measured on ``device_name`` beside their eager
    counterparts (:func:`lever_frame`), and how many pairs; (None, 0) when there are none."""
    on_device = [r for r in records if get(r, "env", "device_name") == device_name]
    df = lever_frame(on_device)
    gains = df[(df["lever"] == "compile") & df["speedup"].notna()]["speedup"]
    return (float(gains.median()), len(gains)) if len(gains) else (None, 0)


def levers_section(df: pd.DataFrame) -> str:
    """``## What each lever bought`` from :func:`lever_frame` (empty when no lever was measured beside
    its counterpart)."""
    if df.empty:
        return ""
    rows = [[r.cell_id, r.lever, fmt_or(r.speedup, ".2f") + "x", fmt_or(r.step_time_pct, "+.1f"), fmt_or(r.peak_mem_pct, "+.1f"),
             fmt_or(r.predicted_peak_mem_pct, "+.1f"), fmt_or(r.compile_s, ".1f"),
             {True: "yes: not steady", False: "no", None: ""}[r.recompiled]]
            for r in df.sort_values(["lever", "cell_id"]).itertuples()]
    measure = ", ".join(sorted(df["peak_measure"].unique()))
    table = tabulate(rows, headers=["cell", "lever", "speedup", "step time %", "peak mem %", "predicted peak %",
                                    "compile s", "recompiled in window"], tablefmt="github", disable_numparse=True)
    return "\n".join([
        "## What each lever bought", "",
        f"Each cell against the same cell without that lever (speedup = its median step time over this "
        f"one's; peak memory on {measure}; predicted = the model's change for the same pair).", "", table])
