"""One home per concern: the calibration store, the fingerprint, the records reader, the resolved
strategy, and the predictions the planner attaches."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os

import pytest

from harness.calibration import matmul, store
from harness.errors import UsageError
from harness.parallel.presets import STRATEGIES, Layout, degrees_for, resolve
from harness.planner import expand
from harness.records.fingerprint import digest
from harness.records.reader import TornTail, append_record, latest_per_cell, load_records, read_records
from harness.run.rundir import existing_records
from harness.spec import SweepSpec
from workloads.sizes import get_size

# ---------------------------------------------------------------- fingerprint and store keys


def test_digest_is_sha256_of_sorted_json():
    fields = {"b": 1, "a": [2, "x"]}
    assert digest(fields) == hashlib.sha256(b'{"a": [2, "x"], "b": 1}').hexdigest()[:16]


def test_store_keys_keep_existing_caches_valid():
    fp = {"device_kind": "cpu", "dtype": "fp32"}
    assert store.key("matmul", fp) == digest(fp)  # matmul keys predate kinds
    assert store.key("comm", fp) == digest({"kind": "comm", **fp})
    assert store.key("workload", {"kind": "workload", **fp}) == digest({"kind": "workload", **fp})
    with pytest.raises(ValueError, match="unknown calibration kind 'gemm'"):
        store.key("gemm", fp)


def test_store_get_checks_the_kind(tmp_path):
    path = tmp_path / "cal.json"
    fp = {"x": 1}
    store.put("comm", fp, {"sync_s": 1e-3}, path)
    assert store.get("comm", fp, path) == {"sync_s": 1e-3, "fingerprint": fp, "kind": "comm"}
    assert store.get("workload", fp, path) is None
    path.write_text(json.dumps({store.key("matmul", fp): {"kind": "comm", "fingerprint": fp}}))
    assert store.get("matmul", fp, path) is None  # a comm entry under a matmul key is not a matmul entry


def _put_many(path: str, worker: int, n: int) -> None:
    from pathlib import Path

    from harness.calibration import store as s

    for i in range(n):
        s.put("comm", {"worker": worker, "i": i}, {"value": i}, Path(path))


def test_concurrent_writers_keep_every_entry(tmp_path):
    """Four processes read-modify-write the same file at once; the lock keeps all 4 x 25 entries."""
    path = tmp_path / "cal.json"
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_put_many, args=(str(path), w, 25)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    entries = json.loads(path.read_text())
    assert len(entries) == 100
    assert all(store.get("comm", {"worker": w, "i": i}, path)["value"] == i for w in range(4) for i in range(25))


# ---------------------------------------------------------------- the one records reader


def _line(cell_id: str) -> str:
    return json.dumps({"schema_version": 1, "kind": "cell", "cell_id": cell_id, "run_id": "r", "status": "ok", "config": {}, "metrics": {}, "samples": {}}) + "\n"


def test_torn_last_line_is_reported_then_set_aside_at_the_next_append(tmp_path, capsys):
    path = tmp_path / "records.jsonl"
    whole = _line("a") + _line("b")
    torn = _line("c")[:25]
    path.write_text(whole + torn)
    records, tail = read_records(tmp_path)
    assert [r["cell_id"] for r in records] == ["a", "b"]
    assert tail == TornTail(path, 3, len(whole.encode()))
    assert [r["cell_id"] for r in load_records(tmp_path)] == ["a", "b"]
    assert "line 3 is a torn write" in capsys.readouterr().err
    side = append_record(path, json.loads(_line("d")))
    assert path.read_text() == whole + _line("d"), "the torn bytes are cut, the new record starts its own line"
    assert side.name.startswith("records.jsonl.torn-") and side.read_text() == torn, "the torn bytes are kept"
    assert append_record(path, json.loads(_line("e"))) is None  # a whole last record: nothing to set aside
    assert [r["cell_id"] for r in load_records(tmp_path)] == ["a", "b", "d", "e"]


def test_a_last_line_that_ends_but_does_not_parse_is_set_aside_too(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text(_line("a") + "garbage\n")
    assert [r["cell_id"] for r in load_records(tmp_path)] == ["a"]
    side = append_record(path, json.loads(_line("b")))
    assert side.read_text() == "garbage\n" and path.read_text() == _line("a") + _line("b")


def test_corrupt_line_in_the_middle_is_refused_and_left_alone(tmp_path):
    path = tmp_path / "records.jsonl"
    text = _line("a") + "{not json\n" + _line("b")
    path.write_text(text)
    for read in (load_records, existing_records):
        with pytest.raises(UsageError, match="line 2 is not valid JSON.*corrupt at that line"):
            read(tmp_path)
    assert path.read_text() == text


def test_latest_record_per_cell_wins_and_attempts_are_counted():
    recs = [{"kind": "calibration", "cell_id": "calibration"}, {"cell_id": "a", "status": "timeout"},
            {"cell_id": "b", "status": "ok"}, {"cell_id": "a", "status": "ok"}]
    latest, attempts = latest_per_cell(recs)
    assert [(r.get("cell_id"), r.get("status")) for r in latest] == \
        [("calibration", None), ("a", "ok"), ("b", "ok")]
    assert attempts == {"a": 2, "b": 1}


# ---------------------------------------------------------------- the strategy resolved once

FSDP_APPLIED = {"fsdp", "zero2", "hsdp", "fsdp+tp", "pp+fsdp", "fsdp+cp", "fsdp+tp+cp", "fsdp+ep", "fsdp+tp+ep", "pp+fsdp+ep"}


@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s != "pp+fsdp+tp"])
def test_layout_says_where_fsdp_applies_and_what_syncs(strategy):
    world = 1 if strategy == "single" else 4
    layout = resolve(strategy, world)
    assert layout.dims == degrees_for(strategy, world)
    assert layout.fsdp == (strategy in FSDP_APPLIED)
    synced = layout.options.synced_dims
    for dim in ("dp_replicate", "dp_shard"):
        if getattr(layout.dims, dim) > 1:
            assert dim in synced, f"{strategy} would train diverging replicas over {dim}"


def test_fsdp_on_one_rank_still_wraps_but_fsdp_tp_without_dp_does_not():
    assert Layout("fsdp", degrees_for("single", 1)).fsdp
    assert not resolve("fsdp+tp", 2, {"tp": 2}).fsdp


def test_override_that_leaves_a_replica_unsynced_is_refused():
    with pytest.raises(UsageError, match=r"strategy tp does not synchronise gradients over dp_shard \(2\)"):
        resolve("tp", 4, {"tp": 2, "dp_shard": 2})


# ---------------------------------------------------------------- predictions at plan time


def _spec(**kw) -> SweepSpec:
    base = dict(sizes=("tiny",), strategies=("ddp", "tp", "pp+fsdp+tp"), precisions=("fp32",), gpus=(2,),
                device_kind="cpu", batch=8, steps=3, warmup=1)
    return SweepSpec(**{**base, **kw})


def test_plan_attaches_predictions_from_the_store(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_CALIBRATION", str(tmp_path / "cal.json"))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # 2 cores: ddp's 2 one-thread ranks one each
    cells = expand(_spec())
    valid = [c for c in cells if c.valid]
    assert {c.raw["strategy"] for c in valid} == {"single", "ddp", "tp"}
    invalid = [c for c in cells if not c.valid]
    assert [c.raw["strategy"] for c in invalid] == ["pp+fsdp+tp"] and invalid[0].predicted is None
    for c in valid:
        assert c.predicted["step_time_s"] is None and "n/a: no calibration" in c.predicted["notes"][-1]
        assert c.est_mem_gib == c.predicted["peak_mem_gib"] > 0
        assert c.calibrated_tflops is None
    # a matmul entry appears: the same plan now predicts a step time from the roofline and knows the peak
    threads = matmul.threads_for("cpu", 2)
    store.put("matmul", matmul.fingerprint("cpu", "fp32", threads), {"tflops": 0.5, "shapes": []})
    ddp = next(c for c in expand(_spec()) if c.raw["strategy"] == "ddp")
    assert ddp.calibrated_tflops == 0.5
    size = get_size("tiny")
    rows = 4  # global batch 8 over 2 replicas
    bd = ddp.predicted["breakdown"]
    assert bd["basis"] == "matmul peak"
    assert bd["compute_s"] == pytest.approx(rows * size.flops_per_token() * size.seq_len / 0.5e12, rel=1e-12)
    assert ddp.predicted["step_time_s"] is None  # no comm calibration yet: the model says so instead of guessing
    assert "no comm calibration for all_reduce over 2 ranks" in " ".join(ddp.predicted["notes"])


def test_resume_runs_neither_finished_nor_invalid_cells_again(tmp_path, monkeypatch):
    from harness.run.sweep import cells_to_run, finished_cells

    monkeypatch.setenv("HARNESS_CALIBRATION", str(tmp_path / "cal.json"))
    cells = expand(_spec())
    by_strategy = {c.raw["strategy"]: c.cell_id for c in cells}
    existing = [{"cell_id": by_strategy["single"], "status": "ok"},
                {"cell_id": by_strategy["pp+fsdp+tp"], "status": "invalid"},
                {"cell_id": by_strategy["ddp"], "status": "ok"},
                {"cell_id": by_strategy["ddp"], "status": "timeout"},  # the latest attempt failed: run it again
                {"cell_id": by_strategy["tp"], "status": "crashed"}]
    todo = cells_to_run(cells, finished_cells(existing))
    assert sorted(c.raw["strategy"] for c in todo) == ["ddp", "tp"]


# ---------------------------------------------------------------- metric keys


def _metric_key_writes(tree) -> list[int]:
    """Lines that assign into ``<something>["metrics"][...]`` (a metric key written after the fact)."""
    import ast

    lines = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, ast.AugAssign | ast.AnnAssign) else []
        for t in targets:
            if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Subscript) \
                    and isinstance(t.value.slice, ast.Constant) and t.value.slice.value == "metrics":
                lines.append(node.lineno)
    return lines


def test_only_the_record_builders_write_metric_keys():
    """record_metrics.py (cells) and fit/cell.py (fit records) build ``metrics``; nothing patches a
    record's metrics afterwards (the schema in records/schema.py is the whole list)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "harness"
    found = {str(p.relative_to(root.parent)): lines for p in sorted(root.rglob("*.py"))
             if (lines := _metric_key_writes(ast.parse(p.read_text())))}
    assert found == {}, f"metric keys written outside the record builders: {found}"
    assert _metric_key_writes(ast.parse('rec["metrics"]["x"] = 1\nm = {}\nm["y"] = 2')) == [1], "the check can fail"


def test_no_module_name_repeats_across_packages():
    """A file name alone says which module is meant (one `metrics`, not three)."""
    from collections import Counter
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    names = Counter(p.name for pkg in ("harness", "workloads") for p in (repo / pkg).rglob("*.py")
                    if p.name not in ("__init__.py", "__main__.py"))
    assert [n for n, c in names.items() if c > 1] == []
