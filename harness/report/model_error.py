"""Predicted beside measured: the analytic model's error per cell and over the sweep.

Error % = 100 x (predicted - measured) / measured, signed (positive: the model expected a
slower step / more bytes / more memory). The sweep's mean and max are over absolute errors.

On CPU the sweep times the run's normaliser workload before and after each cell
(``metrics.machine_probe_s``); their mean over the run's calibration record (timed when the run
was calibrated) is the machine's slowdown around the cell. The step time is also held against
the prediction scaled by it, to tell the model's error from the machine's drift. On the CPU
references it tells them apart only in part: results/reference/model-cpu-tiny-mini-w2-w4-r4
21.5% raw against 21.4% adjusted, ``-r5`` 31.7% against 16.6%; much of the drift that moves a
cell is not what a 0.1 s probe between cells sees.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from tabulate import tabulate

from harness.model.comm import comm_for_routing
from harness.model.shape import CellShape
from harness.records.reader import calibration_medians, latest_per_cell, load_records, records_file
from harness.report.frame import get, num
from harness.spec import CellConfig
from harness.text import fmt_or
from harness.units import MIB

# (column, predicted key, measured key path) for the quantities held against the model
QUANTITIES = {
    "step_time": (("step_time_s",), ("step_time_s", "median")),
    "comm_bytes": (("comm_bytes_per_step",), ("comm_bytes_per_step",)),
    "model_state": (("model_state_bytes_per_rank",), ("model_state_bytes_per_rank",)),
    "peak_mem": (("peak_mem_gib",), ("peak_mem_gib",)),
}


def error_pct(predicted: float, measured: float) -> float:
    if math.isnan(predicted) or math.isnan(measured) or measured == 0:
        return math.nan
    return 100.0 * (predicted - measured) / measured


def machine_factor(record: dict[str, Any], normaliser: dict[Any, float | None]) -> float:
    """How much slower the machine ran the normaliser around this cell than when the run was
    calibrated (``normaliser``: :func:`harness.records.reader.calibration_medians`)."""
    probe = (record.get("metrics") or {}).get("machine_probe_s") or {}
    ref = normaliser.get(record.get("run_id"))
    if not ref or "before" not in probe or "after" not in probe:
        return math.nan
    return (probe["before"] + probe["after"]) / 2 / ref


def comm_exact(record: dict[str, Any]) -> str:
    """Whether a cell's collective bytes are the model's: ``yes`` when every rank's equal the prediction
    written before the run; ``routed`` for an expert-parallel cell whose all-to-all followed its learned
    router (the prediction assumed each rank receives as many rows as it sends) and whose every rank's
    bytes equal the model for the rows it recorded sending and receiving (``metrics.moe.ep``,
    :func:`harness.model.comm.comm_for_routing`); ``no`` otherwise."""
    measured, predicted = (record.get("metrics") or {}), (record.get("predicted") or {})
    if "comm_by_rank" not in predicted:  # older records: the per-step total only
        return "yes" if num(predicted.get("comm_bytes_per_step")) == num(measured.get("comm_bytes_per_step")) else "no"
    if measured.get("comm_by_rank") == predicted["comm_by_rank"]:
        return "yes"
    ep = (measured.get("moe") or {}).get("ep")
    if ep and measured.get("comm_by_rank") == comm_for_routing(CellShape.of(CellConfig.from_record(record["config"])),
                                                               ep):
        return "routed"
    return "no"


def model_frame(records: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """One row per ok cell with a prediction (its latest record): predicted, measured and error % per quantity."""
    rows = []
    normaliser = calibration_medians(records)
    for r in latest_per_cell(list(records))[0]:
        if r.get("kind", "cell") != "cell" or r.get("status") != "ok" or not r.get("predicted"):
            continue
        p, m = r["predicted"], r.get("metrics") or {}
        row: dict[str, Any] = {"cell_id": r.get("cell_id"),
                               "world_size": (r.get("config") or {}).get("world_size"),
                               "basis": (p.get("breakdown") or {}).get("basis")}
        for name, (pk, mk) in QUANTITIES.items():
            pv, mv = num(get(p, *pk)), num(get(m, *mk))
            row[f"{name}_predicted"], row[f"{name}_measured"] = pv, mv
            row[f"{name}_error_pct"] = error_pct(pv, mv)
        tensor = num(m.get("peak_tensor_gib"))
        if math.isfinite(tensor) and p.get("peak_tensor_gib") is not None:  # CPU: the measure the model predicts
            pv = num(p["peak_tensor_gib"])
            row.update(peak_mem_predicted=pv, peak_mem_measured=tensor, peak_mem_error_pct=error_pct(pv, tensor))
        row["peak_mem_basis"] = "tensor_bytes" if math.isfinite(tensor) else m.get("peak_mem_kind")
        row["machine_factor"] = factor = machine_factor(r, normaliser)
        row["step_time_adjusted_error_pct"] = error_pct(row["step_time_predicted"] * factor, row["step_time_measured"])
        row["comm_exact"] = comm_exact(r)
        rows.append(row)
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class ErrorSummary:
    n: int
    mean_abs_pct: float
    max_abs_pct: float
    worst_cell: str | None


def error_summary(df: pd.DataFrame, quantity: str = "step_time") -> ErrorSummary:
    """Mean and max absolute error % of one quantity over the cells that have both numbers."""
    if df.empty:
        return ErrorSummary(0, math.nan, math.nan, None)
    col = df[f"{quantity}_error_pct"].abs().dropna()
    if col.empty:
        return ErrorSummary(0, math.nan, math.nan, None)
    return ErrorSummary(len(col), float(col.mean()), float(col.max()), str(df.loc[col.idxmax(), "cell_id"]))


def model_section(df: pd.DataFrame) -> str:
    """Markdown: predicted vs measured per cell (:func:`model_frame`), then the sweep's mean and max errors."""
    if df.empty:
        return ""
    rows = []
    for _, r in df.iterrows():
        rows.append([r["cell_id"], fmt_or(r["step_time_measured"] * 1e3, ".1f", "-"), fmt_or(r["step_time_predicted"] * 1e3, ".1f", "-"),
                     fmt_or(r["step_time_error_pct"], "+.0f", "-"), fmt_or(r["machine_factor"], ".2f", "-"),
                     fmt_or(r["step_time_adjusted_error_pct"], "+.0f", "-"),
                     fmt_or(r["comm_bytes_measured"] / MIB, ".2f", "-"), fmt_or(r["comm_bytes_predicted"] / MIB, ".2f", "-"),
                     r["comm_exact"],
                     fmt_or(r["model_state_error_pct"], "+.2f", "-"), fmt_or(r["peak_mem_measured"], ".3f", "-"),
                     fmt_or(r["peak_mem_predicted"], ".3f", "-"), fmt_or(r["peak_mem_error_pct"], "+.0f", "-"),
                     r["peak_mem_basis"] or "-", r["basis"] or "-"])
    headers = ["cell", "step ms", "predicted ms", "error %", "machine x", "error adj. %", "comm MiB/step", "predicted MiB", "bytes exact",
               "model-state error %", "peak GiB", "predicted GiB", "peak error %", "peak measure", "compute basis"]
    lines = ["## Predicted vs measured (harness.model)", "",
             tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True), ""]
    for q, label in (("step_time", "step time"), ("comm_bytes", "comm bytes"), ("model_state", "model-state bytes"),
                     ("peak_mem", "peak memory")):
        s = error_summary(df, q)
        if s.n:
            lines.append(f"- {label}: mean |error| {s.mean_abs_pct:.1f}%, max {s.max_abs_pct:.1f}% "
                         f"(`{s.worst_cell}`) over {s.n} cells")
        adj = error_summary(df, "step_time_adjusted") if q == "step_time" else ErrorSummary(0, math.nan, math.nan, None)
        if adj.n:
            lines.append(f"- step time against the prediction x the machine's slowdown at the cell (machine x): "
                         f"mean |error| {adj.mean_abs_pct:.1f}%, max {adj.max_abs_pct:.1f}% (`{adj.worst_cell}`) "
                         f"over {adj.n} cells")
    lines += ["", "error % = 100 x (predicted - measured) / measured; the step time is the measured median. "
              "bytes exact: every rank's collective bytes equal the prediction (yes), or, for an expert-parallel "
              "cell with a learned router, the model for the rows each rank recorded sending and receiving "
              "(routed: the prediction assumed a rank receives as many as it sends). "
              "Peak memory is held against the measure the model predicts: live tensor bytes on CPU ranks "
              "(`metrics.peak_tensor_gib`, the model without the process), the allocator on GPU; older CPU "
              "records without it fall back to RSS against the model plus the process base. "
              "Predictions are written before the cell runs, from calibration files only "
              "(`harness calibrate`: matmul peak, workload passes, collective busbw). machine x = the run's "
              "normaliser workload timed before and after the cell (`metrics.machine_probe_s`, mean) over "
              "its time when the run was calibrated (CPU sweeps); error adj. % holds the step time against "
              "the prediction times machine x.", ""]
    return "\n".join(lines)


def model_error(run_dir: Path) -> dict:
    """``|predicted - measured| / measured`` step time over ok cell records with both
    (:func:`error_summary`, the numbers the sweep's summary.md shows).

    Returns ``{"n", "mean_pct", "max_pct", "worst_cell", "device_kind"}``, or ``{"reason"}`` when
    there is nothing to compare.
    """
    if records_file(run_dir) is None:
        return {"reason": f"no measured sweep with predictions at {run_dir}"}
    records = load_records(run_dir)
    s = error_summary(model_frame(records))
    if not s.n:
        return {"reason": f"no ok cell records with predicted.step_time_s in {run_dir}"}
    kinds = {(r.get("config") or {}).get("device_kind") for r in records if r.get("kind", "cell") == "cell"}
    return {"n": s.n, "mean_pct": s.mean_abs_pct, "max_pct": s.max_abs_pct, "worst_cell": s.worst_cell,
            "device_kind": ",".join(sorted(k for k in kinds if k))}
