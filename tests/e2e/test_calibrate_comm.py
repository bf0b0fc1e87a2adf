"""``harness calibrate`` end to end on CPU: a real 2-rank gloo bus-bandwidth run cached next to the matmul peak."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.calibration.collectives import COLLECTIVES, bus_factor

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


def _calibrate(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARNESS_")}
    env.update(PYTHONPATH=str(REPO), HARNESS_FORCE_CPU="1", HARNESS_CALIBRATION=str(tmp / "cal.json"))
    return subprocess.run([sys.executable, "-m", "harness", "calibrate", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_calibrate_caches_comm_entry_next_to_matmul(tmp_path):
    r = _calibrate(tmp_path, "--device", "cpu", "--gpus", "2", "--dtype", "fp32", "--comm-max-bytes", "64KiB")
    assert r.returncode == 0, r.stderr[-3000:]
    entries = list(json.loads((tmp_path / "cal.json").read_text()).values())
    comm = [e for e in entries if e.get("kind") == "comm"]
    assert len(comm) == 1 and len(entries) == 2, entries
    e = comm[0]
    assert e["fingerprint"]["world_size"] == 2 and e["fingerprint"]["backend"] == "gloo"
    assert set(e["collectives"]) == set(COLLECTIVES)
    for name, rows in e["collectives"].items():
        assert [row["bytes"] for row in rows] == [4096, 8192, 16384, 32768, 65536], name
        for row in rows:
            assert row["time_s"] > 0 and row["busbw_gbps"] > 0, (name, row)
            assert row["algbw_gbps"] == pytest.approx(row["bytes"] / row["time_s"] / 1e9)
            assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * bus_factor(name, 2))
        assert e["summary"][name]["peak_busbw_gbps"] == max(row["busbw_gbps"] for row in rows)
    assert "all_reduce (busbw = algbw x 1)" in r.stdout and "64KiB" in r.stdout
    assert f"comm cache: {tmp_path / 'cal.json'}" in r.stdout


def test_bad_size_exits_2_and_writes_nothing(tmp_path):
    r = _calibrate(tmp_path, "--device", "cpu", "--gpus", "2", "--comm-max-bytes", "12XB")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "harness calibrate: error: --comm-max-bytes '12XB' is not a size; give a positive integer of bytes "
        "or a KiB/MiB/GiB suffix, e.g. 4MiB"]
    assert not (tmp_path / "cal.json").exists()
