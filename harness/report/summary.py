"""Records -> summary.md text: per workload size a performance table, what to pick, outcomes, notes.

Pure: :func:`summary_markdown` returns a string and never prints or plots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
from tabulate import tabulate

from harness.report.checkpoint_table import checkpoint_section
from harness.report.frame import TIME_USE, device_title, text
from harness.report.lever_gains import levers_section
from harness.report.load_table import expert_load_section
from harness.report.model_attribution import attribution_section
from harness.report.model_error import model_section
from harness.report.pipeline_bubble import bubble_section
from harness.report.run_frames import RunFrames
from harness.report.stage_actions import actions_section
from harness.report.ties import spread_text, tied_with
from harness.text import first_line, fmt_or

FAILED_CELL = "-"


@dataclass(frozen=True)
class Column:
    """One numeric column of the summary table: frame column, scale, format, best direction."""

    header: str
    key: str
    scale: float
    fmt: str
    best: str  # "max" or "min"
    multi_device_only: bool = False
    """Rank only world_size > 1 cells: on 1 device efficiency is 1, comm and parity 0 by definition."""


SUMMARY_COLUMNS = [
    Column("tokens/s/dev", "tokens_per_s_per_device", 1.0, ",.0f", "max"),
    Column("step median (ms)", "step_time_median_s", 1e3, ".2f", "min"),
    Column("CV %", "step_time_cv", 100.0, ".1f", "min"),
    Column("TFLOP/s/dev", "tflops_per_device", 1.0, ".3g", "max"),
    Column("MFU % (PaLM)", "mfu_pct", 1.0, ".1f", "max"),
    Column("MFU cal. % (PaLM)", "mfu_calibrated_pct", 1.0, ".1f", "max"),
    Column("peak mem GiB", "peak_mem_gib", 1.0, ".2f", "min"),
    Column("model state MiB/rank", "model_state_mib_per_rank", 1.0, ".1f", "min"),
    Column("comm MiB/step", "comm_mib_per_step", 1.0, ".1f", "min", multi_device_only=True),
    Column("overlap %", "overlap_pct", 1.0, ".1f", "max"),
    Column("scaling eff.", "scaling_efficiency", 1.0, ".2f", "max", multi_device_only=True),
    Column("parity rel diff", "parity_max_rel_diff", 1.0, ".1e", "min", multi_device_only=True),
]

SPEED_KEYS = ("tokens_per_s_per_device", "step_time_median_s")
"""The columns a tie is marked in: with ``--rounds``, cells whose intervals overlap the fastest's."""

FORMULAS = """**Formulas**

- tokens/s = global tokens per step / median step time, global tokens per step = global batch x seq len
- tokens/s/dev = tokens/s / devices
- TFLOP/s per device = flops_per_token x tokens/s / devices / 1e12, flops_per_token by PaLM's count, 6N + 12 L d S (the full attention square; torchtitan counts the same for gpt2 and llama3; Megatron's causal count, 6N + 6 L d S, is lower: `harness workloads` lists all three)
- MFU % = 100 x TFLOP/s per device / datasheet peak TFLOP/s of the device at the cell's precision; MFU cal. % divides by the measured matmul peak instead
- scaling efficiency = tokens/s at N devices / (N x tokens/s at 1 device), same size, precision, scaling and LR rule
- CV % = 100 x std / mean of the measured step times
- with `--rounds N`: step median = the median round's median; ± = half the width of the median's interval over the rounds (order statistics, about 60% coverage: the 2nd to 4th of 5 rounds), as % of the median; (tie) = a cell whose interval overlaps the fastest's, scaled to equal tokens per device: not measurably slower
- B_simple = tr(Sigma) / |G|^2, the simple noise scale (McCandlish et al. 2018), in sequences like the global batch
- **bold** = best in its column: max for throughput, MFU, overlap and efficiency; min for time, CV, memory, comm and parity (1-device cells are not ranked for efficiency, comm and parity: 1, 0 and 0 by definition)"""



def _label(row: pd.Series) -> str:
    n = int(row["world_size"]) if np.isfinite(row["world_size"]) else "?"
    levers = text(row["levers"])
    levers = f" ({levers})" if levers and levers != "eager" else ""
    return f"{text(row['strategy'])}/{text(row['precision'])}{levers} on {n} device(s)"


def _best_values(df: pd.DataFrame) -> dict[str, float]:
    """Best value per summary column over ok rows; only where the values differ."""
    ok = df[df["status"] == "ok"]
    best: dict[str, float] = {}
    for col in SUMMARY_COLUMNS:
        rows = ok[ok["world_size"] > 1] if col.multi_device_only else ok
        values = rows[col.key].dropna()
        if values.nunique() >= 2:  # a tie across every row singles nothing out
            best[col.key] = float(values.max() if col.best == "max" else values.min())
    return best


def _key_columns(df: pd.DataFrame) -> list[tuple[str, str]]:
    """Row keys: strategy, precision, world size, plus levers / scaling / LR rule when they vary."""
    keys = [("strategy", "strategy"), ("precision", "precision"), ("world size", "world_size")]
    keys += [(h, k) for h, k in (("levers", "levers"), ("scaling", "scaling"), ("LR rule", "lr_rule"))
             if df[k].nunique() > 1]
    return keys


def _key_cells(row: pd.Series, keys: list[tuple[str, str]]) -> list[str]:
    return [fmt_or(row[k], ".0f") if k == "world_size" else text(row[k]) for _, k in keys]


def _size_table(df: pd.DataFrame) -> str:
    """Performance table of one workload size: strategy x precision x world size."""
    best = _best_values(df)
    keys = _key_columns(df)
    ok = df[df["status"] == "ok"]
    fastest = _pick(ok, "tokens_per_s_per_device", "max")
    ties = set(tied_with(ok, fastest).index) if fastest is not None else set()
    rows = []
    for idx, row in df.sort_values([k for _, k in keys]).iterrows():
        if row["status"] != "ok":
            status = f"{row['status']}: {first_line(row['error'])}"
            rows.append(_key_cells(row, keys) + [FAILED_CELL] * len(SUMMARY_COLUMNS) + [status])
            continue
        cells = []
        for col in SUMMARY_COLUMNS:
            text = fmt_or(row[col.key] * col.scale, col.fmt)
            is_best = best.get(col.key) == row[col.key]
            if col.key == "step_time_median_s":
                text += spread_text(row)
            if col.key in SPEED_KEYS and ties and (is_best or idx in ties):
                is_best, text = True, f"{text} (tie)"
            if col.multi_device_only and row["world_size"] <= 1:
                is_best = False
            cells.append(f"**{text}**" if is_best else text)
        rows.append(_key_cells(row, keys) + cells + ["ok"])
    headers = [h for h, _ in keys] + [c.header for c in SUMMARY_COLUMNS] + ["status"]
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)


def _pick(df: pd.DataFrame, key: str, best: str) -> pd.Series | None:
    values = df[key].dropna()
    if values.empty:
        return None
    return df.loc[values.idxmax() if best == "max" else values.idxmin()]


def what_to_pick(df: pd.DataFrame) -> str:
    """Generated recommendation for one size: fastest, leanest in memory, best scaling."""
    ok = df[df["status"] == "ok"]
    if ok.empty:
        return "**What to pick:** no cell finished; see the status column."
    parts = []
    fastest = _pick(ok, "tokens_per_s_per_device", "max")
    if fastest is not None:
        tied = tied_with(ok, fastest)
        tie = "" if tied.empty else (
            f", tied with {', '.join(_label(r) for _, r in tied.iterrows())} (their round intervals overlap: "
            f"not measurably different on this machine)")
        parts.append(f"fastest is {_label(fastest)} at "
                     f"{fastest['tokens_per_s_per_device']:,.0f} tokens/s/dev{tie}")
    leanest = _pick(ok, "peak_mem_gib", "min")
    if leanest is not None:
        parts.append(f"leanest in memory is {_label(leanest)} at "
                     f"{leanest['peak_mem_gib']:.2f} GiB peak")
    scaling = _pick(ok[ok["world_size"] > 1], "scaling_efficiency", "max")
    if scaling is not None:
        parts.append(f"best scaling is {_label(scaling)} at efficiency "
                     f"{scaling['scaling_efficiency']:.2f}")
    text = "; ".join(parts) if parts else "no throughput, memory or scaling data measured"
    return f"**What to pick:** {text}."


def _has_outcomes(df: pd.DataFrame) -> bool:
    """Loss outcomes exist and vary over more than one LR rule or precision."""
    ok = df[df["status"] == "ok"]
    outcome = ok[["final_loss", "steps_to_target", "gns_b_simple"]].notna().any(axis=None)
    return bool(outcome) and (ok["lr_rule"].nunique() > 1 or ok["precision"].nunique() > 1)


def _amp_speedup(ok: pd.DataFrame, row: pd.Series) -> float:
    """tokens/s/dev of this cell / tokens/s/dev of the fp32 cell with the same other keys."""
    mask = ok["precision"] == "fp32"
    for key in ("strategy", "scaling", "lr_rule", "world_size"):
        # None == None is False in pandas; a key absent on both sides still matches.
        mask &= ok[key].isna() if pd.isna(row[key]) else ok[key] == row[key]
    match = ok[mask]
    if match.empty:
        return math.nan
    return float(row["tokens_per_s_per_device"] / match["tokens_per_s_per_device"].iloc[0])


def critical_batch_hint(global_batch: float, b_simple: float) -> str:
    """Compare the global batch with B_simple, the critical batch estimate (McCandlish 2018)."""
    if not (np.isfinite(global_batch) and np.isfinite(b_simple)):
        return "n/a"
    if global_batch < b_simple:
        return "batch below B_simple: larger batch would still scale"
    return "batch above B_simple: diminishing returns"


def _steps_to_target(row: pd.Series) -> str:
    if np.isfinite(row["steps_to_target"]):
        return f"{row['steps_to_target']:.0f}"
    return "not reached" if np.isfinite(row["target_loss"]) else "n/a"


def _outcome_table(df: pd.DataFrame) -> str:
    """Loss outcomes of one size: precision x scaling x LR rule x world size."""
    ok = df[df["status"] == "ok"]
    rows = []
    order = ["precision", "scaling", "lr_rule", "world_size", "strategy"]
    for _, row in ok.sort_values(order).iterrows():
        rows.append([
            text(row["precision"]), text(row["scaling"]), text(row["lr_rule"]),
            fmt_or(row["world_size"], ".0f"), text(row["strategy"]), fmt_or(row["tokens_per_s_per_device"], ",.0f"),
            fmt_or(_amp_speedup(ok, row), ".2f"), _steps_to_target(row),
            fmt_or(row["time_to_target_s"], ".1f"), fmt_or(row["final_loss"], ".4f"),
            fmt_or(row["gns_b_simple"], ".1f"), fmt_or(row["global_batch"], ".0f"),
            critical_batch_hint(row["global_batch"], row["gns_b_simple"]),
        ])
    headers = ["precision", "scaling", "LR rule", "world size", "strategy", "tokens/s/dev",
               "AMP speedup vs fp32", "steps to target", "time to target s", "final loss",
               "B_simple", "global batch", "critical-batch hint"]
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)


def _flags(df: pd.DataFrame) -> list[str]:
    """Notes: cells run more than once, unstable timing, failed parity, and MFU that could not be computed honestly."""
    flags = [f"- `{row['cell_id']}`: {row['attempts']:.0f} attempts; the tables show the latest ({row['status']})"
             for _, row in df.iterrows() if row["attempts"] > 1]
    flags += [f"- `{row['cell_id']}`: {text(row['unstable_reason'])}"
              for _, row in df.iterrows() if text(row["unstable_reason"])]
    flags += [f"- `{row['cell_id']}`: **parity failed**: {text(row['parity_reason'])}"
              for _, row in df.iterrows() if row["parity_ok"] is False]
    no_mfu = df[(df["status"] == "ok") & df["mfu_pct"].isna()]
    reasons = no_mfu["mfu_reason"].map(text)
    for reason, group in no_mfu.groupby(reasons, sort=False):
        if reason:
            reason = reason.removeprefix("n/a: ")  # the flag already says n/a
            flags.append(f"- MFU n/a for {len(group)} cell(s): {reason}")
    return flags


def time_line(df: pd.DataFrame) -> str | None:
    """One line: how much of the run's time in cells was measured steps, and where the rest went."""
    known = df.dropna(subset=["time_probe_s"])
    if known.empty:
        return None
    t = {col: float(known[col].fillna(0.0).sum()) for col in TIME_USE}
    total = sum(t.values())
    if total <= 0:
        return None
    failed = f", {t['time_job_s']:,.0f} s in cells without a result" if t["time_job_s"] else ""
    return (f"Time: {len(known)} cells took {total:,.0f} s; {t['time_measured_s']:,.0f} s "
            f"({100 * t['time_measured_s'] / total:.0f}%) were measured steps, {t['time_startup_s']:,.0f} s start-up "
            f"(launch, imports, process group, model build), {t['time_warmup_s']:,.0f} s warmup, "
            f"{t['time_untimed_s']:,.0f} s untimed steps and results, {t['time_teardown_s']:,.0f} s teardown, "
            f"{t['time_probe_s']:,.0f} s machine probes{failed} (`metrics.overhead`).")


def summary_markdown(frames: RunFrames) -> str:
    """The run summary: per size a performance table, what to pick, outcome table, notes."""
    df = frames.cells
    lines = [f"# Benchmark summary, produced on {device_title(df)}", ""]
    if df.empty:
        return "\n".join(lines + ["No cell records.", ""])
    spent = time_line(df)
    if spent:
        lines += [spent, ""]
    for size in df["size"].fillna("unknown size").unique():
        part = df[df["size"].fillna("unknown size") == size]
        lines += [f"## Size: {size}", "", _size_table(part), "", what_to_pick(part), ""]
        if _has_outcomes(part):
            lines += [f"### Loss outcomes: {size}", "", _outcome_table(part), ""]
    sections = (model_section(frames.model), attribution_section(frames.step_attribution, frames.memory_attribution),
                levers_section(frames.levers), expert_load_section(frames.expert_load),
                bubble_section(frames.pipeline_bubble), actions_section(frames.stage_actions),
                checkpoint_section(frames.records))
    for section in sections:  # each only where the run has what it reads
        if section:
            lines += [section, ""]
    lines += [FORMULAS, ""]
    flags = _flags(df)
    if flags:
        lines += ["**Flags**", "", *flags, ""]
    return "\n".join(lines)
