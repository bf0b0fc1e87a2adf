"""The plots read instead of tables: throughput with p10-p90 bars, step composition, predicted vs
measured, memory per rank against capacity, scaling curves, and the throughput history.

Each builder takes frames (no records, no files) and returns a ``matplotlib.figure.Figure`` or
None when it has no data; :mod:`harness.report.plot_files` saves them.
"""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from harness.measure.step_composition import PARTS  # noqa: E402
from harness.report.frame import device_title  # noqa: E402

PART_COLOURS = {
    "matmul": "#4C72B0", "attention": "#64B5CD", "other_compute": "#55A868", "compute": "#55A868",
    "comm_exposed": "#C44E52", "optimizer": "#8172B2", "data": "#8C8C8C", "idle": "#DDDDDD", "bubble": "#CCB974",
}
STACK_ORDER = (*PARTS[:3], "compute", "comm_exposed", "optimizer", "bubble", "data", "idle")


def _label(row: pd.Series) -> str:
    n = f"{row['world_size']:.0f}" if np.isfinite(row["world_size"]) else "?"
    return f"{row['size']} {row['strategy']}\n{row['precision']} w{n}"


def _cell_tick(cell_id: str, width: int = 14) -> str:
    """A cell id wrapped at its hyphens into lines of at most ``width`` characters (a token longer
    than that keeps its own line), so that neighbouring ticks do not run into each other."""
    lines: list[str] = []
    for token in str(cell_id).split("-"):
        if lines and len(lines[-1]) + 1 + len(token) <= width:
            lines[-1] += "-" + token
        else:
            lines.append(token)
    return "\n".join(lines)


def throughput_errorbar_figure(df: pd.DataFrame) -> Figure | None:
    """tokens/s per device per cell at the median step, error bars from the p90 and p10 step times
    (cells without p10/p90 are left out: the plain throughput bars show them)."""
    finite = [np.isfinite(df[k].astype(float)) for k in ("tokens_per_s_per_device", "step_time_p10_s",
                                                         "step_time_p90_s", "step_time_median_s")]
    data = df[(df["status"] == "ok") & finite[0] & finite[1] & finite[2] & finite[3]]
    if data.empty:
        return None
    data = data.sort_values(["size", "strategy", "precision", "world_size"])
    # tokens/s/dev is inversely proportional to step time: the slow p90 step gives the low end.
    scale = data["tokens_per_s_per_device"] * data["step_time_median_s"]
    low = data["tokens_per_s_per_device"] - scale / data["step_time_p90_s"]
    high = scale / data["step_time_p10_s"] - data["tokens_per_s_per_device"]
    fig = Figure(figsize=(max(6.0, 2.0 + 1.1 * len(data)), 4.5), layout="constrained")
    ax = fig.subplots()
    x = np.arange(len(data))
    precisions = sorted(str(p) for p in data["precision"].unique())
    colours = {p: f"C{i}" for i, p in enumerate(precisions)}
    ax.bar(x, data["tokens_per_s_per_device"], color=[colours[str(p)] for p in data["precision"]],
           yerr=np.vstack([low.clip(lower=0), high.clip(lower=0)]), capsize=4)
    ax.set_xticks(x, [_label(r) for _, r in data.iterrows()], fontsize=8)
    ax.set_ylabel("tokens/s per device (median step; bars: p90..p10 step)")
    fig.suptitle(f"Throughput per device with p10-p90 spread on {device_title(df)}")
    return fig


def composition_figure(comp: pd.DataFrame) -> Figure | None:
    """One stacked bar per cell: ms per step by part; predicted bars (the model's breakdown, for
    cells not profiled) are hatched and labelled ``predicted``."""
    if comp.empty:
        return None
    cells = list(dict.fromkeys(comp["cell_id"]))
    fig = Figure(figsize=(max(6.5, 2.5 + 1.3 * len(cells)), 5.0), layout="constrained")
    ax = fig.subplots()
    seen: set[str] = set()
    for i, cell in enumerate(cells):
        part = comp[comp["cell_id"] == cell].set_index("part")
        basis = part["basis"].iloc[0]
        bottom = 0.0
        for name in STACK_ORDER:
            if name not in part.index or not math.isfinite(part.loc[name, "seconds"]):
                continue
            ms = float(part.loc[name, "seconds"]) * 1e3
            label = name.replace("_", " ") if name not in seen else None
            seen.add(name)
            ax.bar(i, ms, bottom=bottom, color=PART_COLOURS[name], label=label,
                   hatch="//" if basis == "predicted" else None, edgecolor="white")
            bottom += ms
        ax.text(i, bottom, basis if basis == "predicted" else part["source"].iloc[0], ha="center",
                va="bottom", fontsize=7)
    ax.set_xticks(range(len(cells)), [_cell_tick(c) for c in cells], fontsize=7)
    ax.set_ylabel("ms per step")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle("Step composition: measured (profiled steps) or predicted (hatched, harness.model)")
    return fig


def predicted_vs_measured_figure(model: pd.DataFrame) -> Figure | None:
    """Predicted against measured step time per cell, with the y = x line."""
    if model.empty or "step_time_predicted" not in model:
        return None
    data = model[np.isfinite(model["step_time_predicted"]) & np.isfinite(model["step_time_measured"])]
    if data.empty:
        return None
    fig = Figure(figsize=(5.5, 5.0), layout="constrained")
    ax = fig.subplots()
    ms_p, ms_m = data["step_time_predicted"] * 1e3, data["step_time_measured"] * 1e3
    ax.scatter(ms_m, ms_p)
    for cell, xm, yp in zip(data["cell_id"], ms_m, ms_p):
        ax.annotate(str(cell), (xm, yp), fontsize=6, xytext=(3, 3), textcoords="offset points")
    hi = float(max(ms_p.max(), ms_m.max())) * 1.1
    ax.plot([0, hi], [0, hi], color="grey", linestyle="--", label="y = x")
    ax.set_xlim(0, hi)
    ax.set_ylim(0, hi)
    ax.set_xlabel("measured step time (ms, median)")
    ax.set_ylabel("predicted step time (ms, harness.model)")
    ax.legend()
    fig.suptitle("Predicted vs measured step time")
    return fig


def memory_figure(mem: pd.DataFrame) -> Figure | None:
    """Peak memory of every rank per cell, with the device capacity where it is known (GPU)."""
    if mem.empty:
        return None
    cells = list(dict.fromkeys(mem["cell_id"]))
    fig = Figure(figsize=(max(6.0, 2.0 + 1.2 * len(cells)), 4.5), layout="constrained")
    ax = fig.subplots()
    width = 0.8
    for i, cell in enumerate(cells):
        part = mem[mem["cell_id"] == cell]
        n = len(part)
        offsets = (np.arange(n) - (n - 1) / 2) * width / max(n, 1)
        ax.bar(i + offsets, part["peak_mem_gib"], width=width / max(n, 1), color="C0")
        cap = part["capacity_gib"].iloc[0]
        if math.isfinite(cap):
            ax.hlines(cap, i - width / 2, i + width / 2, color="C3", linestyle="--",
                      label="device capacity" if i == 0 else None)
    ax.set_xticks(range(len(cells)), [_cell_tick(c) for c in cells], fontsize=7)
    ax.set_ylabel("peak memory per rank (GiB)")
    kind = ", ".join(sorted(str(k) for k in mem["kind"].dropna().unique()))
    note = "" if np.isfinite(mem["capacity_gib"]).any() else " (capacity unknown: CPU ranks share host RAM)"
    if np.isfinite(mem["capacity_gib"]).any():
        ax.legend(fontsize=8)
    fig.suptitle(f"Peak memory per rank, {kind}{note}")
    return fig


def scaling_curves_figure(df: pd.DataFrame) -> Figure | None:
    """tokens/s against device count, one line per strategy within size/precision/scaling/LR rule
    (the fastest cell per device count), from the 1-device reference, with the ideal N x tokens/s(1)."""
    data = df[(df["status"] == "ok") & np.isfinite(df["tokens_per_s"].astype(float))]
    if data.empty or data["world_size"].nunique() < 2:
        return None
    keys = ["size", "precision", "scaling", "lr_rule"]
    varying = [k for k in keys if data[k].nunique() > 1]
    fig = Figure(figsize=(7.0, 4.8), layout="constrained")
    ax = fig.subplots()
    for group_key, group in data.groupby(keys, sort=True, dropna=False):
        name = "/".join(str(v) for k, v in zip(keys, group_key) if k in varying or k == "size")
        single = group[group["world_size"] == 1]
        ref = float(single["tokens_per_s"].max()) if not single.empty else math.nan
        for strategy, part in group[group["world_size"] > 1].groupby("strategy", sort=True):
            best = part.groupby("world_size")["tokens_per_s"].max()
            if math.isfinite(ref):
                best = pd.concat([pd.Series({1.0: ref}), best])
            ax.plot(best.index, best.values, marker="o", label=f"{name} {strategy}")
        if math.isfinite(ref):
            ws = np.array(sorted(group["world_size"].unique()))
            ax.plot(ws, ws * ref, color="grey", linestyle="--", linewidth=1, label=f"{name} ideal")
    ax.set_xticks(sorted(data["world_size"].unique()))
    ax.set_xlabel("devices (world size)")
    ax.set_ylabel("tokens/s (all devices)")
    ax.legend(fontsize=7)
    fig.suptitle(f"Scaling curves (dashed: N x tokens/s at 1 device) on {device_title(df)}")
    return fig


def history_figure(frame: pd.DataFrame, changes: pd.DataFrame) -> Figure | None:
    """tokens/s per device of each cell over runs, a vertical line at each detected step."""
    if frame.empty:
        return None
    fig = Figure(figsize=(8.0, 4.5), layout="constrained")
    ax = fig.subplots()
    for cell, part in frame.groupby("cell_id", sort=True):
        part = part.sort_values("position")
        ax.plot(part["position"], part["tokens_per_s_per_device"], marker="o", label=str(cell))
    for row in changes.itertuples(index=False):
        ax.axvline(row.position - 0.5, color="C3", linestyle="--")
        ax.annotate(f"{row.ratio - 1:+.0%}", (row.position - 0.5, ax.get_ylim()[1]), fontsize=8, color="C3",
                    ha="left", va="top")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("run (commit order)")
    ax.set_ylabel("tokens/s per device (median)")
    ax.legend(fontsize=7)
    fig.suptitle("Throughput history; dashed: detected steps")
    return fig

