"""The expert load of a run's MoE cells: tokens per expert per step, and how uneven.

One row per measured MoE cell (``metrics.moe``, :mod:`harness.parallel.expert_load`): its routing,
the tokens each expert got per step (the mean over layers, so one row per cell stays readable),
the busiest expert over the mean, under expert parallel the share of routed tokens that left their
rank, and the same step's MFU counted on total parameters beside the active one. ``summary.md``
prints it under "Expert load".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd
from tabulate import tabulate


def expert_load_frame(records: Sequence[dict[str, Any]]) -> pd.DataFrame:
    rows = []
    for r in records:
        moe = (r.get("metrics") or {}).get("moe") if r.get("status") == "ok" else None
        if not moe or not moe.get("tokens_per_expert"):
            continue
        layers = moe["tokens_per_expert"]
        per_expert = [sum(col) / len(layers) for col in zip(*layers)]
        rows.append({"cell": r["cell_id"], "routing": moe["routing"],
                     **{f"e{i}": v for i, v in enumerate(per_expert)},
                     "imbalance_max_over_mean": moe["imbalance_max_over_mean"],
                     "imbalance_worst": moe["imbalance_max_over_mean_worst"],
                     "left_rank_share": (moe.get("ep") or {}).get("tokens_left_rank_share"),
                     "tflops_per_device": r["metrics"].get("tflops_per_device"),
                     "tflops_per_device_total_params": moe.get("tflops_per_device_total_params")})
    return pd.DataFrame(rows)


def expert_load_section(df: pd.DataFrame) -> str | None:
    if df.empty:
        return None
    experts = [c for c in df.columns if c.startswith("e") and c[1:].isdigit()]
    table = [[row["cell"], row["routing"], *(f"{row[e]:.1f}" for e in experts),
              f"{row['imbalance_max_over_mean']:.3f}", f"{row['imbalance_worst']:.3f}",
              "-" if pd.isna(row["left_rank_share"]) else f"{100 * row['left_rank_share']:.1f}",
              f"{row['tflops_per_device']:.4g}", f"{row['tflops_per_device_total_params']:.4g}"]
             for _, row in df.iterrows()]
    headers = ["cell", "routing", *experts, "max/mean", "worst max/mean", "left rank %", "TFLOP/s/dev (active)",
               "TFLOP/s/dev (total params, overstated)"]
    return "\n".join([
        "## Expert load (MoE)", "",
        "Tokens per expert per step over the global batch, the mean over layers (`metrics.moe.tokens_per_expert` "
        "has every layer); max/mean: the busiest expert over the mean, the mean over layers and steps, and the "
        "worst layer-step. `balanced` routing is a round robin: 1.000 by construction. left rank %: under expert "
        "parallel, the routed tokens sent to another rank's experts (`metrics.moe.ep.tokens_left_rank_share`; "
        "balanced routing: 100 x (1 - 1/ep)).", "",
        tabulate(table, headers=headers, tablefmt="github", disable_numparse=True)])
