"""Fit every cell asked for, at a fixed micro-batch or the largest that fits (``--batch auto``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from harness.fit.cell import FitCell, RoleOutcome, fit_record, run_roles
from harness.records.reader import append_record
from harness.search import largest_passing

RECORDS = "fit.jsonl"
"""The run directory's fit records (kept apart from the sweep's ``records.jsonl``)."""
AUTO_LIMIT = 4096
"""The largest micro-batch ``--batch auto`` tries."""


def fit_cell(cell: FitCell, out_dir: Path, run_id: str, steps: int, device_mem_gib: float) -> dict:
    outcomes = run_roles(cell, out_dir / "cells" / cell.cell_id, steps)
    return fit_record(run_id, cell, outcomes, device_mem_gib, steps)


def fit_auto(cell: FitCell, out_dir: Path, run_id: str, steps: int, device_mem_gib: float) -> dict:
    """The record at the largest micro-batch whose every role fits (the smallest tried when none does),
    with ``metrics.batch_search`` listing each micro-batch tried and whether it fit."""
    outcomes: dict[int, list[RoleOutcome]] = {}
    fitted: dict[int, bool | None] = {}

    def fits(mb: int) -> bool:
        at = replace(cell, micro_batch=mb)
        outcomes[mb] = run_roles(at, out_dir / "cells" / at.cell_id, steps)
        fitted[mb] = fit_record(run_id, at, outcomes[mb], device_mem_gib, steps)["metrics"]["fits"]
        return bool(fitted[mb])

    best = largest_passing(fits, start=1, limit=AUTO_LIMIT)
    mb = best if best is not None else 1
    search = {"largest_fitting_micro_batch": best, "tried": {str(m): f for m, f in sorted(fitted.items())},
              "method": "doubling from 1, then bisection (harness/search.py)"}
    return fit_record(run_id, replace(cell, micro_batch=mb), outcomes[mb], device_mem_gib, steps,
                      batch_search=search)


def fit_all(cells: list[FitCell], out_dir: Path, run_id: str, steps: int, device_mem_gib: float,
            auto: bool, progress=print) -> list[dict]:
    """Fit each cell in turn, appending its record to ``out_dir/fit.jsonl`` as it lands."""
    out_dir.mkdir(parents=True, exist_ok=True)
    records = []
    for i, cell in enumerate(cells, 1):
        progress(f"[{i}/{len(cells)}] {cell.cell_id}{' (batch auto)' if auto else ''}")
        fn = fit_auto if auto else fit_cell
        record = fn(cell, out_dir, run_id, steps, device_mem_gib)
        append_record(out_dir / RECORDS, record)
        records.append(record)
    return records
