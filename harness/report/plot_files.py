"""PNG plots from the report DataFrame (headless, matplotlib Agg backend).

Each plot is skipped, not written, when it has no data. Figures are built with
``matplotlib.figure.Figure`` (no pyplot global state) and saved atomically.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402  (backend must be chosen first)
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from harness.records.atomic import write_bytes_atomic  # noqa: E402
from harness.records.reader import latest_per_cell  # noqa: E402
from harness.report import figures  # noqa: E402
from harness.report.frame import device_title  # noqa: E402
from harness.report.run_frames import RunFrames  # noqa: E402

THROUGHPUT_PNG = "throughput_tokens_per_s_per_device.png"
PEAK_MEM_PNG = "peak_mem_gib.png"
SCALING_PNG = "scaling_efficiency.png"
LOSS_PNG = "loss_by_lr_rule.png"
THROUGHPUT_SPREAD_PNG = "throughput_p10_p90.png"
COMPOSITION_PNG = "step_composition.png"
PREDICTED_PNG = "predicted_vs_measured_step_time.png"
MEMORY_RANKS_PNG = "memory_per_rank.png"
SCALING_CURVES_PNG = "scaling_curves.png"
HISTORY_PNG = "history.png"


def _ok(df: pd.DataFrame, key: str) -> pd.DataFrame:
    """ok cells with a finite value in ``key``."""
    return df[(df["status"] == "ok") & np.isfinite(df[key].astype(float))]


def _bar_label(row: pd.Series, with_lr_rule: bool) -> str:
    n = f"{row['world_size']:.0f}" if np.isfinite(row["world_size"]) else "?"
    label = f"{row['strategy']}\n{row['precision']}\nw{n}"
    return f"{label}\n{row['lr_rule']}" if with_lr_rule else label


def _per_size_axes(fig: Figure, sizes: Sequence[Any]) -> list[Axes]:
    axes = fig.subplots(1, len(sizes), squeeze=False)[0]
    return list(axes)


def _bar_figure(df: pd.DataFrame, key: str, ylabel: str, title: str) -> Figure | None:
    """One bar subplot per size, bars = strategy x precision x world size, colour = precision."""
    data = _ok(df, key)
    if data.empty:
        return None
    sizes = list(data["size"].fillna("unknown size").unique())
    precisions = sorted(str(p) for p in data["precision"].unique())
    colours = {p: f"C{i}" for i, p in enumerate(precisions)}
    fig = Figure(figsize=(max(6.0, 2.0 + 1.2 * len(data)), 4.5), layout="constrained")
    for ax, size in zip(_per_size_axes(fig, sizes), sizes):
        part = data[data["size"].fillna("unknown size") == size]
        part = part.sort_values(["strategy", "precision", "world_size"])
        with_lr_rule = part["lr_rule"].nunique() > 1
        x = np.arange(len(part))
        ax.bar(x, part[key], color=[colours[str(p)] for p in part["precision"]])
        ax.set_xticks(x, [_bar_label(r, with_lr_rule) for _, r in part.iterrows()], fontsize=8)
        ax.set_title(f"size {size}")
        ax.set_xlabel("strategy / precision / world size" + (" / LR rule" if with_lr_rule else ""))
        ax.set_ylabel(ylabel)
    fig.suptitle(f"{title} on {device_title(df)}")
    return fig


def throughput_figure(df: pd.DataFrame) -> Figure | None:
    """Bar chart of tokens/s per device by strategy and precision."""
    return _bar_figure(df, "tokens_per_s_per_device", "throughput (tokens/s per device)",
                       "Throughput per device")


def peak_mem_figure(df: pd.DataFrame) -> Figure | None:
    """Bar chart of peak memory per rank (GiB) by strategy."""
    return _bar_figure(df, "peak_mem_gib", "peak memory (GiB)", "Peak memory")


def scaling_figure(df: pd.DataFrame) -> Figure | None:
    """Scaling efficiency tokens/s(N) / (N x tokens/s(1)) vs device count, if > 1 world size."""
    data = _ok(df, "scaling_efficiency")
    if data.empty or data["world_size"].nunique() < 2:
        return None
    fig = Figure(figsize=(6.5, 4.5), layout="constrained")
    ax = fig.subplots()
    keys = ["size", "strategy", "precision"]
    for key, part in data.groupby(keys, dropna=False, sort=True):
        part = part.sort_values("world_size")
        ax.plot(part["world_size"], part["scaling_efficiency"], marker="o",
                label="/".join(str(k) for k in key))
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="ideal")
    ax.set_xticks(sorted(data["world_size"].unique()))
    ax.set_xlabel("devices (world size)")
    ax.set_ylabel("scaling efficiency (tokens/s(N) / (N x tokens/s(1)))")
    ax.legend(fontsize=8)
    fig.suptitle(f"Scaling efficiency on {device_title(df)}")
    return fig


def _loss_curves(records: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """ok cells (their latest record) with a loss curve, by size, keeping only sizes with more than one LR rule."""
    by_size: dict[str, list[dict[str, Any]]] = {}
    for r in latest_per_cell(list(records))[0]:
        loss = (r.get("metrics") or {}).get("loss")
        if r.get("kind", "cell") == "cell" and r.get("status") == "ok" and loss:
            size = str((r.get("config") or {}).get("size") or "unknown size")
            by_size.setdefault(size, []).append(r)
    return {size: rs for size, rs in by_size.items()
            if len({(r.get("config") or {}).get("lr_rule") for r in rs}) > 1}


def loss_figure(df: pd.DataFrame, records: Sequence[dict[str, Any]]) -> Figure | None:
    """Training loss per step, one line per cell, labelled by LR rule; one subplot per size."""
    curves = _loss_curves(records)
    if not curves:
        return None
    fig = Figure(figsize=(6.5 * len(curves), 4.5), layout="constrained")
    for ax, (size, rs) in zip(_per_size_axes(fig, list(curves)), curves.items()):
        for r in rs:
            cfg = r.get("config") or {}
            loss = np.asarray(r["metrics"]["loss"], dtype=float)
            ax.plot(np.arange(1, len(loss) + 1), loss,
                    label=f"{cfg.get('lr_rule')} {cfg.get('precision')} w{cfg.get('world_size')}")
        ax.set_title(f"size {size}")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step (warmup + measured)")
        ax.set_ylabel("training loss (nats/token)")
        ax.legend(fontsize=8)
    fig.suptitle(f"Loss by LR rule on {device_title(df)}")
    return fig


def _save(fig: Figure, path: Path) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return write_bytes_atomic(path, buf.getvalue())


def write_plots(frames: RunFrames, out_dir: Path) -> list[Path]:
    """Write every plot that has data into ``out_dir``; return the written paths."""
    df = frames.cells
    builders: list[tuple[str, Callable[[], Figure | None]]] = [
        (THROUGHPUT_PNG, lambda: throughput_figure(df)),
        (PEAK_MEM_PNG, lambda: peak_mem_figure(df)),
        (SCALING_PNG, lambda: scaling_figure(df)),
        (LOSS_PNG, lambda: loss_figure(df, frames.records)),
        (THROUGHPUT_SPREAD_PNG, lambda: figures.throughput_errorbar_figure(df)),
        (COMPOSITION_PNG, lambda: figures.composition_figure(frames.composition)),
        (PREDICTED_PNG, lambda: figures.predicted_vs_measured_figure(frames.model)),
        (MEMORY_RANKS_PNG, lambda: figures.memory_figure(frames.memory_ranks)),
        (SCALING_CURVES_PNG, lambda: figures.scaling_curves_figure(df)),
    ]
    written = []
    for name, build in builders:
        fig = build()
        if fig is not None:
            written.append(_save(fig, Path(out_dir) / name))
    return written


def save_history_plot(frame: pd.DataFrame, changes: pd.DataFrame, path: Path) -> Path | None:
    """history.png of ``harness history`` (:func:`harness.report.figures.history_figure`), if it has data."""
    fig = figures.history_figure(frame, changes)
    return _save(fig, Path(path)) if fig is not None else None
