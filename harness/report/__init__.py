"""The report: records -> frames -> summary.md, summary.csv, model.csv and plots.

A leaf: nothing below it imports it back. The analysis modules (:mod:`~harness.report.frame`,
:mod:`~harness.report.summary`, :mod:`~harness.report.model_error`, :mod:`~harness.report.composition`,
:mod:`~harness.report.html`) are pure; :func:`write_report` is the only function with side effects
(files under the run directory, report.html among them: the tables and plots in one file).
"""

from __future__ import annotations

from pathlib import Path

from harness.records.atomic import write_text_atomic
from harness.records.reader import load_records
from harness.report.html import report_html
from harness.report.run_frames import RunFrames
from harness.report.summary import summary_markdown


def write_report(run_dir: Path) -> str:
    """Write summary.md, summary.csv, plots/*.png and report.html of ``run_dir`` from its records only.

    Files are written atomically (temp file + os.replace). Returns the markdown.
    """
    from harness.report.plot_files import write_plots  # noqa: PLC0415  (heavy: matplotlib only when files are written)

    run_dir = Path(run_dir)
    frames = RunFrames.of(load_records(run_dir))  # each frame built once, read by every writer below
    markdown = summary_markdown(frames)
    write_text_atomic(run_dir / "summary.md", markdown)
    write_text_atomic(run_dir / "summary.csv", frames.cells.to_csv(index=False))
    if not frames.model.empty:
        write_text_atomic(run_dir / "model.csv", frames.model.to_csv(index=False))
    written = write_plots(frames, run_dir / "plots")
    title = f"Benchmark report: {run_dir.name}"
    write_text_atomic(run_dir / "report.html", report_html(frames, {p.name: p.read_bytes() for p in written}, title))
    return markdown
