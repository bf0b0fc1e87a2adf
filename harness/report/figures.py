"""The plots read instead of tables: throughput with p10-p90 bars, step composition, predicted vs
measured, memory per rank against capacity, scaling curves, and the throughput history.

Each builder takes frames (no records, no files) and returns a ``matplotlib.figure.Figure`` or
None when it has no data; :mod:`harness.report.plot_files` saves them.
"""

from __future__ import annotations

import math
import textwrap

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from harness.measure.step_composition import PARTS  # noqa: E402
from harness.report.frame import device_title, text  # noqa: E402

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


MEMORY_PANELS = {
    "tensor": ("live tensor bytes at the rank's peak (GiB)",
               "CPU: live tensor bytes at each rank's peak (process base left out): model states (exact) "
               "+ the rest (activations, buffers)", ""),
    "tensor_max": ("GiB (bars: per rank; line: max over ranks)",
                   "CPU: model states per rank; line: tensor peak, max over ranks (per-rank tensor bytes "
                   "not recorded)", ""),
    "rss": ("process RSS peak per rank (GiB)",
            "CPU: process RSS per rank, includes the process base (record without tensor bytes)",
            "RSS peak (with the process base)"),
    "cuda_allocated": ("CUDA allocator peak per rank (GiB)", "GPU: CUDA allocator peak per rank",
                       "allocator peak"),
}
"""Per panel of the memory plot: y label, title and bar label (the tensor panels label their parts);
a kind not named here gets the recorded peak of its kind."""


def _panel(row: pd.Series) -> str:
    """A row's panel: its tensor basis on CPU, else the kind of its recorded peak."""
    basis = text(row.get("basis"))
    return basis if basis in ("tensor", "tensor_max") else text(row.get("kind")) or "unknown kind"


def _rank_axis(ax, part: pd.DataFrame) -> tuple[np.ndarray, dict[str, tuple[float, float]]]:
    """x of each row (a cell's ranks side by side, one empty slot between cells, at least three slots
    a cell so that the labels of one-rank cells do not run into each other), the ranks as tick
    labels and the cells as labels below them; returns the x and each cell's (first, last) x."""
    x: list[float] = []
    spans: dict[str, tuple[float, float]] = {}
    at = 0.0
    for cell in dict.fromkeys(part["cell_id"]):
        n = int((part["cell_id"] == cell).sum())
        pad = max(0, 2 - n) / 2
        x += list(at + pad + np.arange(n))
        spans[cell] = (at + pad, at + pad + n - 1)
        at += max(n, 2) + 1
    xs = np.asarray(x, dtype=float)
    ax.set_xticks(xs, [f"r{r:.0f}" for r in part["rank"]], fontsize=6, rotation=90 if len(xs) > 60 else 0)
    # a cell's label sits under its ranks' labels; its tick may fall on a rank's (odd world size)
    ax.xaxis.remove_overlapping_locs = False
    ax.set_xticks([(a + b) / 2 for a, b in spans.values()], [_cell_tick(c) for c in spans], minor=True, fontsize=7)
    ax.tick_params(axis="x", which="minor", length=0, pad=12)
    ax.set_xlim(-0.75, at - 1.25)
    return xs, spans


def memory_figure(mem: pd.DataFrame) -> Figure | None:
    """Memory of every rank at its peak, one panel per basis and size
    (:func:`harness.report.frame.memory_rank_frame`).

    CPU cells with tensor bytes: model states (``model_state_gib``) stacked under the rest of the
    live tensor peak (``tensor_gib - model_state_gib``), the quantity ``predicted.peak_tensor_gib``
    predicts (drawn as a dashed line, the model's max over ranks); the process base is left out.
    Only the max over ranks recorded: model states per rank and the max as a line. GPU cells: the
    allocator's peak per rank, with the device capacity. Other records: the recorded peak (RSS
    on CPU, which includes the process base).
    """
    if mem.empty:
        return None
    keys = pd.Series([_panel(row) for _, row in mem.iterrows()], index=mem.index)
    sizes = mem["size"].map(text) if "size" in mem else pd.Series("", index=mem.index)
    panels = dict(iter(mem.groupby([keys, sizes], sort=False)))
    rank = {k: i for i, k in enumerate(MEMORY_PANELS)}
    order = sorted(panels, key=lambda k: (rank.get(k[0], len(rank)), k[0], k[1]))
    slots = max(sum(max(n, 2) + 1 for n in p.groupby("cell_id").size()) for p in panels.values())
    width_in = min(30.0, max(8.0, 2.5 + 0.3 * slots))
    fig = Figure(figsize=(width_in, 4.2 * len(order)), layout="constrained")
    for ax, (key, size) in zip(fig.subplots(len(order), 1, squeeze=False)[:, 0], order):
        part = panels[(key, size)]
        ylabel, title, bar_label = MEMORY_PANELS.get(
            key, (f"peak per rank (GiB, {key})", f"Recorded peak per rank ({key})", f"peak ({key})"))
        x, spans = _rank_axis(ax, part)
        if key == "tensor":
            states = part["model_state_gib"].to_numpy(float)
            ax.bar(x, states, color="C0", label="model states (exact)")
            ax.bar(x, part["tensor_gib"].to_numpy(float) - states, bottom=states, color="C1",
                   label="rest of the tensor peak")
        elif key == "tensor_max":
            ax.bar(x, part["model_state_gib"], color="C0", label="model states (exact, per rank)")
            _cell_lines(ax, part, spans, "tensor_gib", "tensor peak, max over ranks", "C1", "-")
        else:
            ax.bar(x, part["peak_mem_gib"], color="C0", label=bar_label)
        if key in ("tensor", "tensor_max"):
            _cell_lines(ax, part, spans, "predicted_tensor_gib", "model: predicted tensor peak (max over ranks)",
                        "black", "--")
        _cell_lines(ax, part, spans, "capacity_gib", "device capacity", "C3", "--")
        ax.set_ylabel(ylabel)
        # about 10 characters of 9-point text per inch of the axes (the legend takes ~3 inches)
        ax.set_title(textwrap.fill(f"size {size}: {title}" if size else title, int(10 * (width_in - 3))),
                     fontsize=9)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle("Memory per rank at its peak")
    return fig


def _cell_lines(ax, part: pd.DataFrame, spans: dict[str, tuple[float, float]], column: str, label: str,
                colour: str, style: str) -> None:
    """One horizontal line per cell across its ranks at the cell's ``column`` (finite values only)."""
    if column not in part:
        return
    value = part.groupby("cell_id", sort=False)[column].first()
    cells = [c for c in spans if math.isfinite(float(value.get(c, math.nan)))]
    if cells:
        ax.hlines([float(value[c]) for c in cells], [spans[c][0] - 0.4 for c in cells],
                  [spans[c][1] + 0.4 for c in cells], colors=colour, linestyles=style, label=label)


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

