"""Each pipelined cell's bubble: simulated from its schedule's action list against what its ranks waited.

The simulated bubble (``predicted.pipeline_bubble_by_rank``, :mod:`harness.model.pipeline_sim`) is each
pipeline rank's idle time over its busy time with equal forward, input-gradient and weight-gradient times;
the measured one (``metrics.pipeline.idle_over_busy_by_rank``, CPU ranks) is each rank's step time less its
CPU time, over its CPU time: the bubble and the transfers it waited for.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
from tabulate import tabulate

from harness.report.frame import strategy_label

COLUMNS = ["cell_id", "strategy", "schedule", "microbatches", "simulated", "measured"]


def bubble_frame(records: list[dict[str, Any]] | Any) -> pd.DataFrame:
    """One row per ok pipelined cell with both bubbles: per-rank lists (fractions)."""
    rows = []
    for r in records:
        if r.get("kind", "cell") != "cell" or r.get("status") != "ok":
            continue
        pipe = ((r.get("metrics") or {}).get("pipeline")) or {}
        simulated = (r.get("predicted") or {}).get("pipeline_bubble_by_rank")
        measured = pipe.get("idle_over_busy_by_rank")
        if simulated is None or measured is None or any(m is None for m in measured):
            continue
        cfg = r.get("config") or {}
        rows.append({"cell_id": r.get("cell_id"), "strategy": strategy_label(cfg), "schedule": cfg.get("pp_schedule"),
                     "microbatches": cfg.get("microbatches"), "simulated": simulated, "measured": measured})
    return pd.DataFrame(rows, columns=COLUMNS)


def _pct(xs: list[float]) -> str:
    return ", ".join(f"{100 * x:.0f}" for x in xs)


def bubble_section(df: pd.DataFrame) -> str | None:
    """The per-cell table, the mean |error| of the largest rank's bubble per schedule, and the schedule whose
    largest measured bubble is the smallest."""
    if df.empty:
        return None
    table: list[list[Any]] = []
    errors: dict[str, list[float]] = {}
    for _, r in df.iterrows():
        sim, meas = max(r["simulated"]), max(r["measured"])
        errors.setdefault(r["schedule"], []).append(abs(meas - sim))
        table.append([r["cell_id"], r["strategy"], r["microbatches"], _pct(r["simulated"]), _pct(r["measured"]),
                      f"{100 * sim:.0f}", f"{100 * meas:.0f}"])
    best = df.loc[df["measured"].map(max).idxmin()]
    lines = ["## Pipeline bubble: simulated from the schedule vs measured", "",
             tabulate(table, headers=["cell", "strategy", "microbatches", "simulated % by pipeline rank",
                                      "measured % by rank", "simulated max %", "measured max %"],
                      tablefmt="github", disable_numparse=True), "",
             "- mean |measured - simulated| of the largest bubble, by schedule: " + "; ".join(
                 f"{s} {100 * sum(e) / len(e):.1f} points ({len(e)} cells)" for s, e in errors.items()),
             f"- smallest measured bubble: {best['strategy']} (`{best['cell_id']}`), "
             f"{100 * max(best['measured']):.0f}% at its largest rank", "",
             "bubble = idle time / busy time of a rank. Simulated: the schedule's own action list "
             "(torch's `pipeline_order`; GPipe and 1F1B the model's) played out with equal F, I and W times and free "
             "transfers (harness/model/pipeline_sim.py). Measured (CPU ranks): (step time - the rank's CPU time) / "
             "its CPU time, median over the measured steps: it also holds the transfers and, with more ranks than "
             "cores, the wait for a core."]
    return "\n".join(lines)
