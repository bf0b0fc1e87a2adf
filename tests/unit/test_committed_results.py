"""What is committed under results/ stays results: loadable, rebuildable, and no empty logs."""

from __future__ import annotations

import gzip
import subprocess
from pathlib import Path

import pytest

from harness.records.reader import load_records, read_records, records_file
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
    if records_file(run_dir) is not None:
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


RESULTS_LIMIT_BYTES = 15 * 1024 * 1024
"""What a clone downloads of our runs: records, summaries, consoles and what tests read (issue 43)."""
REFERENCE_LIMIT_BYTES = 1024 * 1024
"""One committed reference: its records gzip-compressed (``records.jsonl.gz``), summary and console."""


def _tracked(area: Path) -> list[Path]:
    """The files git tracks under ``area`` (every file there when this is not a checkout: a CI clone tracks all)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", str(area)], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return [p for p in area.rglob("*") if p.is_file()]
    return [REPO / name for name in out.decode().split("\0") if name]


def test_results_stay_small_enough_to_clone():
    files = _tracked(REPO / "results")
    total = sum(p.stat().st_size for p in files)
    assert total <= RESULTS_LIMIT_BYTES, f"results/ holds {total / 2**20:.1f} MiB tracked; keep records and summaries, " \
                                         f"not what harness report rebuilds"
    per_run: dict[Path, int] = {}
    for p in files:
        parts = p.relative_to(REPO / "results").parts
        if parts[0] == "reference" and len(parts) > 2:
            per_run[REPO / "results" / "reference" / parts[1]] = per_run.get(REPO / "results" / "reference" / parts[1], 0) \
                + p.stat().st_size
    big = {str(d.relative_to(REPO)): n for d, n in per_run.items() if n > REFERENCE_LIMIT_BYTES}
    assert not big, f"references over {REFERENCE_LIMIT_BYTES // 2**20} MiB (gzip their records.jsonl, drop rebuilt files): {big}"


def test_a_rebuilt_report_is_the_same_bytes_every_time(tmp_path):
    """report.html and summary.md are not committed: `harness report` rebuilds them from the records, the same bytes
    each time (no clock or path in them), so the dropped report of a committed reference is its rebuild."""
    from harness.report import write_report

    src = REPO / "results" / "reference" / "diff-w2-injected"
    pages = []
    for name in ("a", "b"):
        run = tmp_path / name / src.name
        run.mkdir(parents=True)
        (run / "records.jsonl").write_bytes(gzip.decompress((src / "records.jsonl.gz").read_bytes()))
        write_report(run)
        pages.append(((run / "report.html").read_bytes(), (run / "summary.md").read_bytes()))
    assert pages[0] == pages[1]
