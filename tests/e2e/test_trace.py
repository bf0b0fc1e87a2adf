"""`harness trace`: torch.profiler traces (``--tracer torch``, what runs without nsys), and an
Nsight Systems report on CUDA. The CPU capture under nsys is the nsys tier (tests/nsys); the CUDA
one needs both nsys and a GPU and says which is missing when it skips.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.measure.nsys import nsys_available

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
NSYS = nsys_available()


def test_trace_on_cpu_says_so_and_leaves_profiler_traces(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARNESS_")}
    env.update(PYTHONPATH=str(REPO), HARNESS_FORCE_CPU="1", HARNESS_CALIBRATION=str(tmp_path / "cal.json"))
    cell = "tiny-ddp-fp32-w2-gb4-strong"
    r = subprocess.run([sys.executable, "-m", "harness", "trace", "--device", "cpu", "--gpus", "2", "--sizes", "tiny",
                        "--strategies", "ddp", "--batch", "4", "--steps", "3", "--warmup", "1", "--cell", cell,
                        "--tracer", "torch", "--out", str(tmp_path / "run")], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "torch.profiler traces (2)" in r.stdout, r.stdout
    traces = sorted((tmp_path / "run" / "cells" / cell / "traces").glob("rank*.json.gz"))
    assert [t.name.split(".")[0] for t in traces] == ["rank0", "rank1"]
    rec = json.loads((tmp_path / "run" / "records.jsonl").read_text().splitlines()[-1])
    trace = rec["metrics"]["trace"]
    assert trace["ranks"] == 2 and trace["comm_s"] > 0 and trace["compute_s"] > 0
    assert 0 <= trace["overlap_pct"] <= 100
    assert rec["metrics"]["monitor"]["sampler"] == "host" and rec["metrics"]["monitor"]["peak_rss_mib"] > 0
    # the composition accounts for the step as the harness's own timer measured it (issue 18, must show 2)
    comp = trace["composition"]
    print("timer coverage per rank (%):", [round(r["timer_coverage_pct"], 2) for r in comp["by_rank"]])
    for rank in comp["by_rank"]:
        assert len(comp["by_rank"]) == 2 and rank["timer_coverage_pct"] == pytest.approx(100.0, abs=2.0)


@pytest.mark.gpu
@pytest.mark.skipif(NSYS is None or not torch.cuda.is_available(),
                    reason=f"n/a: needs nsys and a CUDA GPU (nsys: {NSYS or 'not on PATH, /opt/nvidia or /usr/local/cuda'}; "
                           f"CUDA: {'yes' if torch.cuda.is_available() else 'no'})")
def test_trace_with_nsys_writes_a_report_per_rank_and_its_stats(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARNESS_")}
    env.update(PYTHONPATH=str(REPO), HARNESS_CALIBRATION=str(tmp_path / "cal.json"))
    r = subprocess.run([sys.executable, "-m", "harness", "trace", "--device", "cuda", "--gpus", "1", "--sizes", "tiny",
                        "--strategies", "single", "--precision", "bf16", "--batch", "4", "--steps", "3", "--warmup", "1",
                        "--out", str(tmp_path / "run")], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "one report per node" in r.stdout and "n/a: no nsys" not in r.stdout
    reports = sorted((tmp_path / "run" / "cells").glob("*/nsys/*.nsys-rep"))
    assert [p.name for p in reports] == ["tiny-single-bf16-w1-gb4-strong.nsys-rep"], r.stdout
    rec = json.loads((tmp_path / "run" / "records.jsonl").read_text().splitlines()[-1])
    assert rec["status"] == "ok" and rec["env"]["device_kind"] == "cuda"
    (rank0,) = rec["metrics"]["nsys"]["ranks"]
    assert rec["metrics"]["nsys"]["problem"] is None and rank0["steps_in_window"] == 3 and rank0["kernels"] > 0
