"""Each cell's claims as the record holds them (``metrics.claims``, docs/claims.md): one row per cell, a column per
claim (checked, contradicted, n/a), and the comparison behind each contradicted or n/a one.

    .venv/bin/python scripts/claims_table.py RUN_DIR_OR_RECORDS [...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tabulate import tabulate

from harness.records.reader import load_records

MARK = {"checked": "checked", "contradicted": "**contradicted**", "n/a": "n/a"}


def table(records: list[dict]) -> tuple[str, list[str]]:
    cells = [r for r in records if r.get("kind", "cell") == "cell" and (r.get("metrics") or {}).get("claims")]
    names = list(dict.fromkeys(c["claim"] for r in cells for c in r["metrics"]["claims"]))
    rows, notes = [], []
    for r in cells:
        by = {c["claim"]: c for c in r["metrics"]["claims"]}
        rows.append([r["cell_id"], r["status"], *[MARK[by[n]["status"]] if n in by else "" for n in names]])
        notes += [f"- `{r['cell_id']}` {n}: {by[n].get('compared') or by[n].get('reason')}" for n in names
                  if n in by and by[n]["status"] != "checked"]
    return tabulate(rows, headers=["cell", "status", *names], tablefmt="github"), notes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories or records.jsonl files")
    args = ap.parse_args(argv)
    records = [r for run in args.runs for r in load_records(run)]
    text, notes = table(records)
    print(text)
    if notes:
        print("\n" + "\n".join(notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
