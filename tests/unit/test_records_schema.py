"""The record's metrics schema: the typed parts, docs/records.md and the records in results/ agree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness.records import metrics as schema
from harness.records.reader import load_records
from harness.report.frame import cells_frame

REPO = Path(__file__).resolve().parents[2]
RUNS = sorted(p.parent for p in (REPO / "results").rglob("records.jsonl"))
ROW = re.compile(r"^\| `(\w+)` \| (\w+) \| (worker|sweep) \|", re.M)


def _doc_rows() -> dict[str, str]:
    text = (REPO / "docs" / "records.md").read_text()
    rows = ROW.findall(text[text.index("## metrics"):])
    keys = [k for k, _, _ in rows]
    assert len(keys) == len(set(keys)), "a metric is listed twice in docs/records.md"
    return {k: part for k, part, _ in rows}


def test_docs_list_exactly_the_typed_metrics():
    documented = _doc_rows()
    assert set(documented) == schema.metric_keys(), \
        f"docs/records.md and CellMetrics differ: {sorted(set(documented) ^ schema.metric_keys())}"
    for key, part in documented.items():
        assert key in getattr(schema, part).__annotations__, f"docs/records.md puts {key} in {part}, which lacks it"


def test_worker_and_run_parts_are_disjoint_and_complete():
    worker = schema.WorkerMetrics.__required_keys__ | schema.WorkerMetrics.__optional_keys__
    run = schema.RunMetrics.__optional_keys__
    calibrated = schema.CalibratedMfuMetrics.__required_keys__
    assert not (worker & run) and not (worker & calibrated) and not (run & calibrated)
    assert worker | run | calibrated == schema.metric_keys()


@pytest.mark.parametrize("run_dir", RUNS, ids=[str(p.relative_to(REPO)) for p in RUNS])
def test_committed_records_load_and_use_only_known_metrics(run_dir):
    """Records of schema_version 1 written by every earlier version of the harness still load."""
    records = load_records(run_dir)
    cells = [r for r in records if r.get("kind", "cell") == "cell"]
    assert cells, f"{run_dir} holds no cell record"
    assert {r["schema_version"] for r in records} == {1}
    unknown = {k for r in cells for k in r["metrics"]} - schema.metric_keys()
    assert not unknown, f"{run_dir}: metrics not in CellMetrics (add them to harness/records/metrics.py): {unknown}"
    ok = [r for r in cells if r["status"] == "ok"]
    required = schema.CellMetrics.__required_keys__
    for r in ok:
        missing = required - set(r["metrics"])
        assert not missing, f"{r['cell_id']}: ok record lacks {sorted(missing)}"
    df = cells_frame(records)
    assert len(df) == len(cells) and df["tokens_per_s_per_device"].notna().sum() == len(ok)
