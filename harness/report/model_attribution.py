"""Where the model's error sits: each predicted term held against what was measured for it.

**Step time** (profiled ok cells with a prediction). The measured step composition
(``metrics.trace.composition``, profiled steps) is scaled to the measured median step, so that
its parts sum to the time the error is taken against; each model term is then held against its
measured counterpart:

=================  ===========================  ============================================
term               predicted (``breakdown``)    measured (``composition.parts_s``)
=================  ===========================  ============================================
compute            ``compute_s``                ``matmul + attention + other_compute``
exposed comm       ``exposed_comm_s``           ``comm_exposed``
optimizer          ``optimizer_s``              ``optimizer``
bubble / idle      ``bubble_s``                 ``idle`` (a pipeline's bubble, else waiting)
data               not modelled (0)             ``data``
=================  ===========================  ============================================

contribution % = 100 x (predicted term - measured term) / measured median step. The terms
partition both steps, so a cell's contributions sum to its step-time error %.

**Peak memory** (CPU cells with ``metrics.peak_tensor_gib``): model states (exact by
construction), everything else the peak holds (activations, gathered or bucketed copies,
logits), both as % of the measured tensor peak, and the process base (RSS peak minus the tensor
peak, against the calibrated base) as % of the RSS peak.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
from tabulate import tabulate

from harness.records.reader import latest_per_cell
from harness.report.frame import get, num
from harness.text import fmt_or
from harness.units import GIB

TERMS = {  # term -> (predicted breakdown key or None, measured composition parts)
    "compute": ("compute_s", ("matmul", "attention", "other_compute")),
    "exposed comm": ("exposed_comm_s", ("comm_exposed",)),
    "optimizer": ("optimizer_s", ("optimizer",)),
    "bubble / idle": ("bubble_s", ("idle",)),
    "data": (None, ("data",)),
}
MEMORY_TERMS = ("model states", "activations and buffers", "process base")


def _ok_cells(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in latest_per_cell(list(records))[0]
            if r.get("kind", "cell") == "cell" and r.get("status") == "ok" and r.get("predicted")]


def step_attribution(records: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """One row per profiled cell: measured median (s), error %, and per term the predicted and
    measured seconds and the contribution % (columns ``<term> pred_s``, ``<term> meas_s``, ``<term> %``)."""
    rows = []
    for r in _ok_cells(records):
        comp, breakdown = get(r, "metrics", "trace", "composition"), get(r, "predicted", "breakdown")
        median = num(get(r, "metrics", "step_time_s", "median"))
        predicted = num(get(r, "predicted", "step_time_s"))
        if not (isinstance(comp, dict) and comp.get("parts_s") and isinstance(breakdown, dict)) \
                or not median > 0 or not np.isfinite(predicted):
            continue
        profiled = sum(num(v) for v in comp["parts_s"].values())
        scale = median / profiled if profiled > 0 else float("nan")
        row: dict[str, Any] = {"cell_id": r.get("cell_id"), "strategy": (r.get("config") or {}).get("strategy"),
                               "world_size": (r.get("config") or {}).get("world_size"), "measured_s": median,
                               "predicted_s": predicted, "error_pct": 100.0 * (predicted - median) / median}
        for term, (key, parts) in TERMS.items():
            pred = num(breakdown.get(key)) if key else 0.0
            meas = scale * sum(num(comp["parts_s"].get(p)) for p in parts)
            row[f"{term} pred_s"], row[f"{term} meas_s"] = pred, meas
            row[f"{term} %"] = 100.0 * (pred - meas) / median
        rows.append(row)
    return pd.DataFrame(rows)


def memory_attribution(records: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """One row per CPU cell with a tensor-bytes peak: per memory term predicted and measured GiB and error %."""
    rows = []
    for r in _ok_cells(records):
        m, p = r.get("metrics") or {}, r["predicted"]
        tensor, rss = num(m.get("peak_tensor_gib")), num(m.get("peak_mem_gib"))
        pred_tensor, pred_total = num(p.get("peak_tensor_gib")), num(p.get("peak_mem_gib"))
        if not (tensor > 0 and np.isfinite(pred_tensor)):
            continue
        states_m = num(m.get("model_state_bytes_per_rank")) / GIB
        states_p = num(p.get("model_state_bytes_per_rank")) / GIB
        terms = {"model states": (states_p, states_m, tensor),
                 "activations and buffers": (pred_tensor - states_p, tensor - states_m, tensor),
                 "process base": (pred_total - pred_tensor, rss - tensor, rss)}
        row: dict[str, Any] = {"cell_id": r.get("cell_id"), "peak_tensor_gib": tensor,
                               "error_pct": 100.0 * (pred_tensor - tensor) / tensor}
        for term, (pred, meas, of) in terms.items():
            row[f"{term} pred_gib"], row[f"{term} meas_gib"] = pred, meas
            row[f"{term} %"] = 100.0 * (pred - meas) / of
        rows.append(row)
    return pd.DataFrame(rows)


def attribution_section(steps: pd.DataFrame, mem: pd.DataFrame) -> str:
    """Markdown: per cell and on average, which term the step-time and peak-memory errors come from
    (:func:`step_attribution`, :func:`memory_attribution`)."""
    if steps.empty and mem.empty:
        return ""
    lines = ["## Where the model's error sits", ""]
    if not steps.empty:
        headers = ["cell", "step ms", "error %", *[f"{t} %" for t in TERMS]]
        rows = [[r["cell_id"], fmt_or(r["measured_s"] * 1e3, ".1f", "-"), fmt_or(r["error_pct"], "+.1f", "-"),
                 *[fmt_or(r[f"{t} %"], "+.1f", "-") for t in TERMS]] for _, r in steps.iterrows()]
        rows.append(["**mean (signed)**", "", fmt_or(steps["error_pct"].mean(), "+.1f", "-"),
                     *[fmt_or(steps[f"{t} %"].mean(), "+.1f", "-") for t in TERMS]])
        rows.append(["**mean abs**", "", fmt_or(steps["error_pct"].abs().mean(), ".1f", "-"),
                     *[fmt_or(steps[f"{t} %"].abs().mean(), ".1f", "-") for t in TERMS]])
        lines += ["Step time: each term's (predicted - measured) as % of the measured median step; the terms "
                  "sum to the error. Measured terms are the profiled step composition scaled to the median.", "",
                  tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True), ""]
    if not mem.empty:
        headers = ["cell", "tensor peak GiB", "error %", *[f"{t} %" for t in MEMORY_TERMS]]
        rows = [[r["cell_id"], fmt_or(r["peak_tensor_gib"], ".3f", "-"), fmt_or(r["error_pct"], "+.1f", "-"),
                 *[fmt_or(r[f"{t} %"], "+.1f", "-") for t in MEMORY_TERMS]] for _, r in mem.iterrows()]
        rows.append(["**mean abs**", "", fmt_or(mem["error_pct"].abs().mean(), ".1f", "-"),
                     *[fmt_or(mem[f"{t} %"].abs().mean(), ".1f", "-") for t in MEMORY_TERMS]])
        lines += ["Peak memory: model states and the rest of the peak as % of the measured tensor peak (they sum "
                  "to its error); the process base (RSS peak - tensor peak, against the calibrated base) as % of "
                  "the RSS peak.", "",
                  tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True), ""]
    return "\n".join(lines)
