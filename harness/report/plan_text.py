"""The plan as a table: every cell with its id, validity, reason and predicted memory."""

from __future__ import annotations

from tabulate import tabulate


def plan_table(cells) -> str:
    rows = []
    for c in cells:
        fits = {True: "yes", False: "NO (predicted OOM)", None: "?"}[c.fits] if c.valid else "-"
        rows.append([c.cell_id, "valid" if c.valid else "invalid",
                     f"{c.est_mem_gib:.2f}" if c.est_mem_gib is not None else "-",
                     f"{c.capacity_gib:.1f}" if c.capacity_gib is not None else "-", fits, c.reason or ""])
    n_bad = sum(not c.valid for c in cells)
    head = f"{len(cells)} cells: {len(cells) - n_bad} valid, {n_bad} invalid"
    return head + "\n" + tabulate(rows, headers=["cell", "validity", "est. mem/rank GiB", "capacity GiB", "fits",
                                                 "reason"], tablefmt="github")
