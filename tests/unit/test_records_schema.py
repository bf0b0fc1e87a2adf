"""The record's metrics schema: the typed parts, docs/records.md and the records in results/ agree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness.records import schema
from harness.records.reader import latest_per_cell, load_records
from harness.report.frame import cells_frame

REPO = Path(__file__).resolve().parents[2]
RUNS = sorted(p.parent for p in (REPO / "results").rglob("records.jsonl*"))
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
    assert not unknown, f"{run_dir}: metrics not in CellMetrics (add them to harness/records/schema.py): {unknown}"
    ok = [r for r in cells if r["status"] == "ok"]
    required = schema.CellMetrics.__required_keys__
    for r in ok:
        missing = required - set(r["metrics"])
        assert not missing, f"{r['cell_id']}: ok record lacks {sorted(missing)}"
    latest, _ = latest_per_cell(cells)  # a resumed run appends: the table holds each cell's latest record
    df = cells_frame(records)
    assert len(df) == len(latest) and df["tokens_per_s_per_device"].notna().sum() == sum(r["status"] == "ok" for r in latest)


def _documented_keys(section: str | None) -> set[str]:
    """Top-level quoted keys of one object in docs/records.md's record sketch (None: the record itself).

    Comments (``# ...``) and values (a quoted word after a colon) are not keys; nested objects are
    skipped. A documented key that no record has, or a record key left undocumented, fails a test.
    """
    text = (REPO / "docs" / "records.md").read_text()
    sketch = text[text.index("```\n{") + 4:text.index("\n}\n```") + 2]
    sketch = "\n".join(line.split("#")[0] for line in sketch.splitlines())
    start = 0 if section is None else sketch.index(f'"{section}": {{') + len(section) + 4
    keys, depth, i = set(), 0, start
    while i < len(sketch):
        ch = sketch[i]
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                break
        elif ch == '"':
            end = sketch.index('"', i + 1)
            before = sketch[start:i].rstrip()
            if depth == 1 and not before.endswith(":") and not before.endswith("|"):
                keys.add(sketch[i + 1:end])
            i = end
        i += 1
    return keys


def _seen(section: str | None, kind: str = "cell") -> set[str]:
    seen: set[str] = set()
    for run_dir in RUNS:
        for r in load_records(run_dir):
            if r.get("kind", "cell") != kind:
                continue
            obj = r if section is None else r.get(section)
            if isinstance(obj, dict):
                seen |= set(obj)
    return seen


@pytest.mark.parametrize("section", [None, "fingerprint_fields", "config", "env", "workload", "predicted", "samples"])
def test_documented_record_fields_are_the_fields_records_have(section):
    documented = _documented_keys(section)
    assert documented, f"docs/records.md documents no keys for {section}"
    assert documented == _seen(section), \
        f"{section or 'record'}: documented but in no record {sorted(documented - _seen(section))}; " \
        f"in records but undocumented {sorted(_seen(section) - documented)}"


def test_documented_config_is_the_cell_config():
    from dataclasses import fields

    from harness.spec import CellConfig

    assert _documented_keys("config") == {f.name for f in fields(CellConfig)} | {"degrees"}


def test_reference_readme_lists_exactly_the_runs_there():
    readme = (REPO / "results" / "reference" / "README.md").read_text()
    listed = set(re.findall(r"^\| `([\w.+-]+)/` \|", readme, re.M))
    present = {p.name for p in (REPO / "results" / "reference").iterdir() if p.is_dir()}
    assert listed == present, f"listed but absent {sorted(listed - present)}; present but unlisted {sorted(present - listed)}"


def test_the_record_check_types_config_as_the_cell_config_does():
    """harness/records/record_shape.py's CONFIG (this layer does not import the spec) is CellConfig's fields, a tuple
    as a JSON list: a field added to one and not the other fails here."""
    from typing import get_type_hints

    from harness.records.record_shape import CONFIG
    from harness.spec import CellConfig

    # a tuple is a JSON list; degrees are named ints in a record (CellConfig says dict)
    as_json = {k: (list[int] if v == tuple[int, ...] else v) for k, v in get_type_hints(CellConfig).items()}
    as_json["degrees"] = dict[str, int] | None
    assert {k: str(v) for k, v in CONFIG.items()} == {k: str(v) for k, v in as_json.items()}
