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


def test_a_probes_bandwidth_is_its_bytes_over_the_median_seconds_on_a_stubbed_clock(tmp_path, monkeypatch):
    """Issue 61: the unit held by value. The clock reads 0, then after each write and read: writes of 0.5, 0.25
    and 1.0 s (median 0.5), reads of 0.125 s: 8 MiB / 0.5 s = 0.016777216 GB/s written, / 0.125 s read."""
    ticks = iter([0.0, 0.5, 1.0, 1.125, 2.0, 2.25, 3.0, 3.125, 4.0, 5.0, 6.0, 6.125])
    monkeypatch.setattr(storage.time, "perf_counter", lambda: next(ticks))
    e = storage.measure(tmp_path / "a" / "b", nbytes=2 * storage.CHUNK_BYTES)  # parents made
    assert e["repeats"] == {"write": [0.5, 0.25, 1.0], "read": [0.125, 0.125, 0.125]}
    assert e["write_gbps"] == 8 * 2**20 / 0.5 / 1e9 == 0.016777216
    assert e["read_gbps"] == 8 * 2**20 / 0.125 / 1e9
    assert set(e) == {"measured_at", "bytes", "write_gbps", "read_gbps", "repeats"}
    assert len(e["measured_at"]) == len("2026-12-06T20:00:00+0000") and e["measured_at"][10] == "T"
    assert list((tmp_path / "a" / "b").iterdir()) == []


class _Part:
    def __init__(self, mountpoint: str, fstype: str) -> None:
        self.mountpoint, self.fstype = mountpoint, fstype


def test_the_filesystem_is_the_deepest_mount_holding_the_path(tmp_path, monkeypatch):
    seen = {}

    def parts(all):  # noqa: A002 (psutil's name)
        seen["all"] = all
        return [_Part("/", "ext4"), _Part(str(tmp_path), "xfs"), _Part(str(tmp_path / "elsewhere"), "tmpfs")]

    monkeypatch.setattr(storage.psutil, "disk_partitions", parts)
    monkeypatch.setattr(storage.socket, "gethostname", lambda: "node7")
    assert storage.filesystem_of(tmp_path / "run") == {"host": "node7", "mount": str(tmp_path), "fstype": "xfs"}
    assert seen["all"] is True  # every mount, a bind or tmpfs one included
    monkeypatch.setattr(storage.psutil, "disk_partitions", lambda all: [])  # noqa: A006
    assert storage.filesystem_of(tmp_path) == {"host": "node7", "mount": "/", "fstype": "unknown"}


def test_a_calibration_measures_the_run_directory_under_its_filesystems_label(tmp_path, monkeypatch):
    taken = {}

    def steadily(fn, label):
        taken["label"] = label
        return fn()

    monkeypatch.setattr(storage.steadiness, "measure_steadily", steadily)
    monkeypatch.setattr(storage, "measure", lambda d: taken.setdefault("dir", d) and {"write_gbps": 1.0})
    monkeypatch.setattr(storage, "filesystem_of", lambda p: {"host": "h", "mount": "/m", "fstype": "xfs"})
    storage.calibrate(tmp_path / "run", cache=tmp_path / "cal.json")
    assert taken["dir"] == tmp_path / "run" and taken["label"] is not None and "storage" in taken["label"]
