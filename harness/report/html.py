"""report.html: a run's tables and plots in one file that opens from disk (no network, no scripts).

Tables are pandas ``to_html`` (escaped); plots are inlined as base64 PNG ``data:`` URIs. Pure:
:func:`report_html` returns the text; :func:`harness.report.write_report` writes it.
"""

from __future__ import annotations

import base64
import html

import pandas as pd

from harness.report.frame import device_title
from harness.report.run_frames import RunFrames

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 3px 6px; text-align: right; }
th { background: #f0f0f0; }
td:first-child, th:first-child { text-align: left; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0 1.5em; }
.note { color: #555; font-size: 0.9em; }
"""

SUMMARY_COLUMNS = {
    "cell_id": "cell", "status": "status", "tokens_per_s_per_device": "tokens/s/dev",
    "step_time_median_s": "step median (ms)", "step_time_cv": "CV %", "tflops_per_device": "TFLOP/s/dev",
    "mfu_pct": "MFU % (PaLM)", "mfu_calibrated_pct": "MFU cal. % (PaLM)", "peak_mem_gib": "peak mem GiB",
    "comm_mib_per_step": "comm MiB/step", "overlap_pct": "overlap %", "scaling_efficiency": "scaling eff.",
    "parity_max_rel_diff": "parity rel diff",
}


def _readable(x: float) -> str:
    """Whole numbers with thousands separators from 1,000 up (9,631 rather than 9.63e+03), three
    significant digits below, scientific only for the very small (parity differences)."""
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.3g}"


def _table(df: pd.DataFrame, float_format: str | None = None) -> str:
    if df.empty:
        return '<p class="note">no data</p>'
    return df.to_html(index=False, na_rep="n/a", escape=True, border=0,
                      float_format=_readable if float_format is None else float_format.format)


def summary_table(df: pd.DataFrame) -> pd.DataFrame:
    """The summary columns of the cells frame, step time in ms and CV in %."""
    out = df[list(SUMMARY_COLUMNS)].copy()
    out["step_time_median_s"] = out["step_time_median_s"] * 1e3
    out["step_time_cv"] = out["step_time_cv"] * 100
    return out.rename(columns=SUMMARY_COLUMNS)


def composition_table(comp: pd.DataFrame) -> pd.DataFrame:
    """Cells x parts of the composition frame, ms per step, with the basis (measured from which trace,
    or predicted)."""
    if comp.empty:
        return comp
    wide = comp.pivot_table(index=["cell_id", "basis", "source"], columns="part", values="seconds",
                            sort=False) * 1e3
    wide["total"] = wide.sum(axis=1)
    wide.columns.name = None  # else to_html draws the pivot's "part" as a header row over an empty column
    return wide.reset_index().rename(columns={"cell_id": "cell", "total": "step (ms)"})


def report_html(frames: RunFrames, plots: dict[str, bytes], title: str) -> str:
    """The whole report; ``plots`` maps a file name to its PNG bytes."""
    cells, model, ops = frames.cells, frames.model, frames.top_ops
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="note">Device: {html.escape(device_title(cells))}. Built from records.jsonl only '
        "(docs/records.md); summary.md has the same numbers and the formulas.</p>",
        "<h2>Cells</h2>", _table(summary_table(cells)),
        "<h2>Step composition (ms per step)</h2>",
        '<p class="note">measured: profiled steps after the measured window (metrics.trace.composition, '
        "mean over ranks; source cpu-ops or gpu-kernels); predicted: the analytic model's breakdown.</p>",
        _table(composition_table(frames.composition), "{:,.1f}"),
    ]
    if not ops.empty:
        parts.append("<h2>Top ops per profiled cell (self time per step)</h2>")
        for cell, group in ops.groupby("cell_id", sort=False):
            table = group.drop(columns="cell_id").assign(self_ms=group["self_s"] * 1e3).drop(columns="self_s")
            parts += [f"<h3>{html.escape(str(cell))}</h3>", _table(table, "{:,.2f}")]
    if not model.empty:
        cols = {"cell_id": "cell", "step_time_predicted": "predicted step (ms)",
                "step_time_measured": "measured step (ms, median)", "step_time_error_pct": "step error %",
                "comm_bytes_error_pct": "comm bytes error %", "peak_mem_error_pct": "peak memory error %"}
        table = model[[c for c in cols if c in model]].copy()
        for c in ("step_time_predicted", "step_time_measured"):
            if c in table:
                table[c] = table[c] * 1e3
        parts += ["<h2>Predicted vs measured</h2>",
                  '<p class="note">error % = 100 x (predicted - measured) / measured (harness.model; summary.md '
                  "has the formulas).</p>", _table(table.rename(columns=cols))]
    parts.append("<h2>Plots</h2>")
    for name, png in plots.items():
        data = base64.b64encode(png).decode("ascii")
        parts.append(f'<h3>{html.escape(name)}</h3><img alt="{html.escape(name)}" src="data:image/png;base64,{data}">')
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
