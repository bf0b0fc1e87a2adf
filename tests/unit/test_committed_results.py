"""What is committed under results/ stays results: loadable, rebuildable, and no empty logs."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.records.reader import load_records, read_records
from harness.report.run_frames import RunFrames
from harness.report.summary import summary_markdown

REPO = Path(__file__).resolve().parents[2]
COMMITTED = [REPO / "results" / area for area in ("reference", "gpu", "baselines")]
"""Where results are committed; a run a developer makes lands in results/<run-id>/, never committed."""
RUN_DIRS = sorted(p for area in ("reference", "gpu/runs") for p in (REPO / "results" / area).iterdir() if p.is_dir())


def _files() -> list[Path]:
    return [p for area in COMMITTED for p in area.rglob("*") if p.is_file()]


def test_no_committed_result_is_empty():
    empty = [str(p.relative_to(REPO)) for p in _files() if p.stat().st_size == 0]
    assert empty == [], f"{len(empty)} empty files under results/ (logs are not results): {empty[:5]}"


def test_no_torchrun_logs_are_committed():
    logs = [str(p.relative_to(REPO)) for p in _files() if "logs" in p.relative_to(REPO).parts]
    assert logs == [], f"torchrun's per-rank logs are not results: {logs[:5]}"


@pytest.mark.parametrize("run_dir", RUN_DIRS, ids=[p.name for p in RUN_DIRS])
def test_every_committed_reference_loads_and_its_report_rebuilds(run_dir):
    """A sweep's records rebuild its summary; a fit's records load; anything else is a page with its command."""
    if (run_dir / "records.jsonl").exists():
        records = load_records(run_dir)
        assert any(r.get("kind", "cell") == "cell" for r in records), f"{run_dir.name}: no cell record"
        summary = summary_markdown(RunFrames.of(records))
        assert summary.startswith("# Benchmark summary") and (run_dir / "summary.md").exists()
    elif (run_dir / "fit.jsonl").exists():
        fits, torn = read_records(run_dir / "fit.jsonl")
        assert torn is None and fits and all(r["kind"] == "fit" for r in fits), f"{run_dir.name}: fit.jsonl holds no fit record"
    else:
        pages = [p for p in run_dir.iterdir() if p.suffix in (".md", ".txt")]
        assert pages, f"{run_dir.name}: neither records nor a page that says what it holds"
