"""Where each cell's wall time goes, before and after a change to how cells start: a markdown table.

    .venv/bin/python scripts/startup_table.py LABEL=RUN_DIR[,RUN_DIR...] ...

Per cell and label, the median over the label's runs (one ``harness bench`` each) of: the cell's wall
time, the worker's own loop (``worker_wall_s``), the measured steps (the sum of the slowest rank's
measured step times), start-up as wall minus the worker's loop and as wall minus the measured steps,
and, where the records have them (``metrics.overhead``), each part of the job. Everything comes from
the runs' ``records.jsonl``. A second table holds what was measured beside it, so that a change to how
cells start can be seen to change no number: each cell's median step time (its median over the runs,
and their range), peak tensor bytes and parity.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.records.reader import latest_per_cell, load_records  # noqa: E402
from harness.run.formulas import OVERHEAD_PARTS  # noqa: E402

COLUMNS = ("wall", "worker loop", "measured", "wall - worker loop", "wall - measured")


def cell_times(run_dir: Path) -> dict[str, dict[str, float]]:
    """cell id -> its times in one run (ok cells only)."""
    out = {}
    for r in latest_per_cell(load_records(run_dir))[0]:
        if r.get("kind", "cell") != "cell" or r["status"] != "ok":
            continue
        m = r["metrics"]
        measured = sum(r["samples"]["step_time_s"])
        t = {"wall": m["wall_s"], "worker loop": m["worker_wall_s"], "measured": measured,
             "wall - worker loop": m["wall_s"] - m["worker_wall_s"], "wall - measured": m["wall_s"] - measured}
        t.update((p, v) for p, v in ((m.get("overhead") or {}).get("parts_s") or {}).items())
        out[r["cell_id"]] = t
    return out


def table(labelled: dict[str, list[Path]]) -> str:
    runs = {label: [cell_times(d) for d in dirs] for label, dirs in labelled.items()}
    cells = list(dict.fromkeys(c for per_label in runs.values() for run in per_label for c in run))
    parts = [p for p in (*OVERHEAD_PARTS, "machine_probe")
             if any(p in run.get(c, {}) for per_label in runs.values() for run in per_label for c in run)]
    cols = [*COLUMNS, *parts]
    lines = ["| cell | runs | " + " | ".join(f"{c} s" for c in cols) + " |",
             "|---|---|" + "---:|" * len(cols)]
    for cell in cells:
        for label, per_label in runs.items():
            have = [run[cell] for run in per_label if cell in run]
            if not have:
                continue
            vals = [statistics.median(t[c] for t in have) if all(c in t for t in have) else None for c in cols]
            lines.append(f"| `{cell}` | {label} ({len(have)}) | "
                         + " | ".join("" if v is None else f"{v:.2f}" for v in vals) + " |")
    total = {label: [sum(t["wall"] for t in run.values()) for run in per_label] for label, per_label in runs.items()}
    lines += ["", "Sum of the cells' walls per run (median): " + "; ".join(
        f"{label} {statistics.median(v):.1f} s ({', '.join(f'{x:.1f}' for x in v)})" for label, v in total.items())]
    return "\n".join(lines)


def measures(run_dir: Path) -> dict[str, dict]:
    out = {}
    for r in latest_per_cell(load_records(run_dir))[0]:
        if r.get("kind", "cell") == "cell" and r["status"] == "ok":
            m = r["metrics"]
            out[r["cell_id"]] = {"step_ms": 1e3 * m["step_time_s"]["median"], "tensor_gib": m.get("peak_tensor_gib"),
                                 "parity": (m.get("parity") or {}).get("ok")}
    return out


def measures_table(labelled: dict[str, list[Path]]) -> str:
    runs = {label: [measures(d) for d in dirs] for label, dirs in labelled.items()}
    labels = list(runs)
    cells = list(dict.fromkeys(c for per in runs.values() for run in per for c in run))
    lines = ["| cell | " + " | ".join(f"{lab}: median step ms [range]" for lab in labels)
             + f" | {labels[-1]} / {labels[0]} | peak tensor GiB | parity ok |",
             "|---|" + "---:|" * (len(labels) + 2) + "---|"]
    for cell in cells:
        meds, row = [], []
        for lab in labels:
            v = [run[cell]["step_ms"] for run in runs[lab] if cell in run]
            meds.append(statistics.median(v))
            row.append(f"{meds[-1]:.1f} [{min(v):.1f}, {max(v):.1f}]")
        tensors = sorted({round(run[cell]["tensor_gib"], 4) for per in runs.values() for run in per
                          if cell in run and run[cell]["tensor_gib"] is not None})
        parity = sorted({str(run[cell]["parity"]) for per in runs.values() for run in per if cell in run})
        lines.append(f"| `{cell}` | " + " | ".join(row) + f" | {meds[-1] / meds[0]:.2f} | "
                     + ", ".join(f"{t:.4f}" for t in tensors) + f" | {', '.join(parity)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="LABEL=RUN_DIR[,RUN_DIR...]")
    args = ap.parse_args(argv)
    labelled = {}
    for spec in args.runs:
        label, _, dirs = spec.partition("=")
        if not dirs:
            ap.error(f"{spec!r}: give LABEL=RUN_DIR[,RUN_DIR...]")
        labelled[label] = [Path(d) for d in dirs.split(",")]
    print(table(labelled))
    print()
    print(measures_table(labelled))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
