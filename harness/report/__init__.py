"""The report: records -> frames -> summary.md, summary.csv, model.csv and plots.

A leaf: nothing below it imports it back. The analysis modules (:mod:`~harness.report.frame`,
:mod:`~harness.report.summary`, :mod:`~harness.report.model_error`) are pure; :func:`write_report`
is the only function with side effects (files under the run directory).
"""

from __future__ import annotations

from pathlib import Path

from harness.records.atomic import write_text_atomic
from harness.records.reader import load_records
from harness.report.frame import cells_frame
from harness.report.model_error import model_frame
from harness.report.summary import summary_markdown


def write_report(run_dir: Path) -> str:
    """Write summary.md, summary.csv and plots/*.png of ``run_dir`` from its records only.

    Files are written atomically (temp file + os.replace). Returns the markdown.
    """
    from harness.report.plots import write_plots  # noqa: PLC0415  (heavy: matplotlib only when files are written)

    run_dir = Path(run_dir)
    records = load_records(run_dir)
    markdown = summary_markdown(records)
    df = cells_frame(records)
    write_text_atomic(run_dir / "summary.md", markdown)
    write_text_atomic(run_dir / "summary.csv", df.to_csv(index=False))
    model = model_frame(records)
    if not model.empty:
        write_text_atomic(run_dir / "model.csv", model.to_csv(index=False))
    write_plots(df, run_dir / "plots", records=records)
    return markdown
