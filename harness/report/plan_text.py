"""The plan as a table: every cell with its id, validity, reason and predicted memory."""

from __future__ import annotations

from tabulate import tabulate

from harness.text import fmt_or


def plan_table(cells) -> str:
    rows = []
    for c in cells:
        fits = {True: "yes", False: "NO (predicted OOM)", None: "?"}[c.fits] if c.valid else "-"
        rows.append([c.cell_id, "valid" if c.valid else "invalid",
                     fmt_or(c.est_mem_gib, ".2f", "-"),
                     fmt_or(c.capacity_gib, ".1f", "-"), fits, c.reason or ""])
    n_bad = sum(not c.valid for c in cells)
    head = f"{len(cells)} cells: {len(cells) - n_bad} valid, {n_bad} invalid"
    return head + "\n" + tabulate(rows, headers=["cell", "validity", "est. mem/rank GiB", "capacity GiB", "fits",
                                                 "reason"], tablefmt="github")
