"""`harness trace` without nsys: one notice line, then torch.profiler traces and their analysis."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.measure.nsys import nsys_available

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(nsys_available() is not None, reason="this machine has nsys: the fallback is not taken")
def test_trace_without_nsys_says_so_and_leaves_profiler_traces(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARNESS_")}
    env.update(PYTHONPATH=str(REPO), HARNESS_FORCE_CPU="1", HARNESS_CALIBRATION=str(tmp_path / "cal.json"))
    cell = "tiny-ddp-fp32-w2-gb4-strong"
    r = subprocess.run([sys.executable, "-m", "harness", "trace", "--device", "cpu", "--gpus", "2", "--sizes", "tiny",
                        "--strategies", "ddp", "--batch", "4", "--steps", "3", "--warmup", "1", "--cell", cell,
                        "--out", str(tmp_path / "run")], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    notices = [l for l in r.stdout.splitlines() if l.startswith("n/a: Nsight Systems trace")]
    assert len(notices) == 1, r.stdout
    traces = sorted((tmp_path / "run" / "cells" / cell / "traces").glob("rank*.json.gz"))
    assert [t.name.split(".")[0] for t in traces] == ["rank0", "rank1"]
    rec = json.loads((tmp_path / "run" / "records.jsonl").read_text().splitlines()[-1])
    trace = rec["metrics"]["trace"]
    assert trace["ranks"] == 2 and trace["comm_s"] > 0 and trace["compute_s"] > 0
    assert 0 <= trace["overlap_pct"] <= 100
    assert rec["metrics"]["monitor"]["sampler"] == "host" and rec["metrics"]["monitor"]["peak_rss_mib"] > 0
