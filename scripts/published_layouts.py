"""The planner against published training runs: writes the table of results/reference/published-layouts/.

    .venv/bin/python scripts/published_layouts.py [--rows results/reference/published-layouts/rows.toml]
        [--out results/reference/published-layouts/table.md]

Each row of the rows file quotes its source; the table holds, per row, whether ``harness plan`` expresses the layout,
its "fits" against the published device's memory, and its tokens/s per GPU against the published figure.
tests/unit/test_published_layouts.py holds the committed table to what this writes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.records.atomic import write_text_atomic
from harness.report.published import load_rows, published_table

ROWS = Path("results/reference/published-layouts/rows.toml")
COMMAND = ".venv/bin/python scripts/published_layouts.py"


def render(rows_path: Path) -> str:
    table = published_table(load_rows(rows_path), rows_path.parent)
    return (f"# The planner against published runs\n\n`{COMMAND} --rows {rows_path}` (sources and quotes: "
            f"`{rows_path.name}`; what each column means: docs/published-layouts.md)\n\n{table}\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=Path, default=ROWS)
    p.add_argument("--out", type=Path, default=None, help="default: table.md beside the rows file")
    args = p.parse_args()
    out = args.out or args.rows.parent / "table.md"
    write_text_atomic(out, render(args.rows))
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
