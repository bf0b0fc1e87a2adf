"""The run directory's write bandwidth (harness/calibration/storage.py) and what the model makes of it: a save's
seconds from the node's bytes, by hand; the entry reused until forced; the prediction names its source."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.calibration import storage, store
from harness.model.checkpoint_cost import checkpoint_bytes_by_rank, checkpoint_prediction, node_save_seconds
from harness.model.predict import CalibrationInputs, predict_cell
from harness.model.shape import CellShape
from harness.spec import CellConfig

CELL = dict(size="tiny", strategy="fsdp", precision="fp32", world_size=4, global_batch=8, seq_len=128, steps=4,
            warmup=1, device_kind="cpu", checkpoint="sync")


def test_a_probe_is_written_read_back_and_removed(tmp_path):
    e = storage.measure(tmp_path, nbytes=2 * storage.CHUNK_BYTES)
    assert e["bytes"] == 8 * 2**20 and len(e["repeats"]["write"]) == storage.REPEATS == len(e["repeats"]["read"])
    assert e["write_gbps"] > 0 and e["read_gbps"] > 0 and list(tmp_path.iterdir()) == []


def test_the_entry_is_kept_per_filesystem_and_reused_until_forced(tmp_path, monkeypatch):
    cache = tmp_path / "cal.json"
    calls = []
    monkeypatch.setattr(storage, "measure", lambda d: calls.append(d) or {
        "measured_at": "t", "bytes": 1, "write_gbps": 2.0, "read_gbps": 4.0, "repeats": {"write": [1.0] * 3}})
    first = storage.calibrate(tmp_path / "run", cache)
    assert storage.calibrate(tmp_path / "run", cache) == first and len(calls) == 1
    storage.calibrate(tmp_path / "run", cache, force=True)
    assert len(calls) == 2
    fp = first["fingerprint"]
    assert fp["device_kind"] == "storage" and Path(tmp_path).resolve().is_relative_to(fp["mount"])
    assert store.get("storage", fp, cache)["write_gbps"] == 2.0


def test_a_save_is_the_busiest_nodes_bytes_over_its_disk():
    c = CellShape.of(CellConfig(**CELL))
    per_rank = checkpoint_bytes_by_rank(c)  # fsdp at 4: a quarter of 12 bytes a parameter each, about
    assert node_save_seconds(c, 2.0) == pytest.approx(sum(per_rank) / 2e9)  # one node: every rank's bytes
    assert node_save_seconds(c, 2.0, nnodes=2) == pytest.approx(max(sum(per_rank[:2]), sum(per_rank[2:])) / 2e9)
    entry = {"write_gbps": 2.0, "measured_at": "t", "fingerprint": {"mount": "/", "fstype": "ext4"}}
    p = checkpoint_prediction(c, entry)
    assert p["save_s"] == node_save_seconds(c, 2.0) and p["basis"].startswith("write bandwidth of / (ext4)")


def test_the_prediction_prices_a_save_only_where_the_cell_saves_and_the_disk_was_measured():
    entry = {"write_gbps": 1.0, "measured_at": "t", "fingerprint": {"mount": "/", "fstype": "ext4"}}
    cal = CalibrationInputs(dtype="fp32", threads=1, storage=entry)
    assert predict_cell(CellConfig(**CELL), cal)["checkpoint"]["write_gbps"] == 1.0
    assert "checkpoint" not in predict_cell(CellConfig(**{**CELL, "checkpoint": "off"}), cal)
    assert "checkpoint" not in predict_cell(CellConfig(**CELL), CalibrationInputs(dtype="fp32", threads=1))
