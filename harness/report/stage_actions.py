"""Where each pipeline rank's step goes, and what a schedule saved of 1F1B's wait on each rank.

Input: ``metrics.pipeline.actions_ms_by_rank`` (CPU ranks; :mod:`harness.parallel.pipeline_clock`): per rank the
mean measured step split into forward, backward (whole, or under a zero-bubble schedule its input-gradient and
weight-gradient parts), the gradient reduce, the waits on sends and receives, and the rest. A schedule's wait is
compared with 1F1B's in the same layout (size, strategy, precision, ranks, batch, microbatches) when the run holds
both: "zbv waited 70% less than 1f1b on rank 0" is a line of :func:`actions_section`.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
from tabulate import tabulate

from harness.parallel.schedules import STAGE_ACTIONS
from harness.report.frame import strategy_label

PARTS = (*STAGE_ACTIONS, "other")
LAYOUT_KEYS = ("arch", "size", "seq_len", "strategy", "precision", "world_size", "global_batch", "microbatches",
               "degrees", "sequence_parallel")
COLUMNS = ["cell_id", "strategy", "schedule", "layout", "rank", "step_ms", *PARTS]
SHORT = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W", "reduce_grad": "reduce",
         "p2p_wait": "wait", "other": "other"}


def actions_frame(records: list[dict[str, Any]] | Any) -> pd.DataFrame:
    """One row per rank of each ok pipelined cell with a measured split: its parts in ms and their sum (the step)."""
    rows = []
    for r in records:
        if r.get("kind", "cell") != "cell" or r.get("status") != "ok":
            continue
        split = (((r.get("metrics") or {}).get("pipeline")) or {}).get("actions_ms_by_rank")
        if not split:
            continue
        cfg = r.get("config") or {}
        layout = "|".join(str(cfg.get(k)) for k in LAYOUT_KEYS)
        for rank, parts in enumerate(split):
            if parts is None:
                continue
            row = {p: float(parts.get(p, 0.0)) for p in PARTS}
            rows.append({"cell_id": r.get("cell_id"), "strategy": strategy_label(cfg), "schedule": cfg.get("pp_schedule"),
                         "layout": layout, "rank": rank, "step_ms": sum(row.values()), **row})
    return pd.DataFrame(rows, columns=COLUMNS)


def wait_saved(df: pd.DataFrame, base: str = "1f1b") -> pd.DataFrame:
    """Per rank of each cell whose layout also ran ``base``: its wait, the base's, and the fraction it saved
    (1 - wait / base wait; negative when it waited longer). Empty without such pairs."""
    if df.empty:
        return pd.DataFrame(columns=["cell_id", "schedule", "rank", "wait_ms", "base_wait_ms", "saved"])
    ref = df[df["schedule"] == base].set_index(["layout", "rank"])["p2p_wait"]
    rows = []
    for _, r in df[df["schedule"] != base].iterrows():
        b = ref.get((r["layout"], r["rank"]))
        if b is None or not b > 0:
            continue
        rows.append({"cell_id": r["cell_id"], "schedule": r["schedule"], "rank": r["rank"], "wait_ms": r["p2p_wait"],
                     "base_wait_ms": float(b), "saved": 1 - r["p2p_wait"] / b})
    return pd.DataFrame(rows, columns=["cell_id", "schedule", "rank", "wait_ms", "base_wait_ms", "saved"])


def actions_section(df: pd.DataFrame) -> str | None:
    """The per-rank split of each cell and, per schedule, the wait it saved against 1F1B's on each rank."""
    if df.empty:
        return None
    table = [[r["cell_id"], r["strategy"], r["rank"], f"{r['step_ms']:.1f}",
              *(f"{r[p]:.1f}" for p in PARTS), f"{100 * r['p2p_wait'] / r['step_ms']:.0f}" if r["step_ms"] > 0 else "n/a"]
             for _, r in df.iterrows()]
    lines = ["## Pipeline stage actions: where each rank's step goes", "",
             tabulate(table, headers=["cell", "strategy", "rank", "step ms", *(f"{SHORT[p]} ms" for p in PARTS),
                                      "wait %"], tablefmt="github", disable_numparse=True), ""]
    saved = wait_saved(df)
    for (cell, schedule), g in saved.groupby(["cell_id", "schedule"], sort=False):
        per_rank = ", ".join(f"rank {r['rank']} {_saved_words(r['saved'])} ({r['wait_ms']:.1f} vs {r['base_wait_ms']:.1f} ms)"
                             for _, r in g.iterrows())
        lines.append(f"- {schedule} against 1f1b in the same layout (`{cell}`): {per_rank}")
    if not saved.empty:
        lines.append("")
    lines.append("F forward, B a whole backward, I and W its input- and weight-gradient parts (zero-bubble schedules), "
                 "reduce the gradient reduce after the last microbatch, wait the schedule's waits on sends and receives, "
                 "other the rest of the step (bookkeeping, posting transfers); ms per measured step, mean over them, "
                 "timed on the host around torch's stage calls (harness/parallel/pipeline_clock.py). With more ranks "
                 "than cores a rank also waits for a core, inside its actions as well as between them.")
    return "\n".join(lines)


def _saved_words(saved: float) -> str:
    return f"waited {100 * saved:.0f}% less" if saved >= 0 else f"waited {100 * -saved:.0f}% more"
