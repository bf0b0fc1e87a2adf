"""GPU tier: the same cell path on CUDA (NCCL, CUDA events, NVML). Skips cleanly without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="n/a: no CUDA GPU on this machine")]
REPO = Path(__file__).resolve().parents[2]


def test_single_cell_on_cuda_uses_events_nccl_and_nvml(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "HARNESS_CALIBRATION": str(tmp_path / "cal.json")}
    r = subprocess.run([sys.executable, "-m", "harness", "bench", "--device", "cuda", "--gpus", "1", "--sizes", "tiny",
                        "--precision", "bf16", "--steps", "5", "--warmup", "2", "--out", str(tmp_path / "run")],
                       env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = [json.loads(l) for l in (tmp_path / "run" / "records.jsonl").read_text().splitlines()][-1]
    assert rec["status"] == "ok" and rec["env"]["device_kind"] == "cuda"
    m = rec["metrics"]
    assert m["peak_mem_kind"] == "cuda_allocated"
    assert m["monitor"]["sampler"] == "nvml"
    assert m["mfu_calibrated_pct"] is not None
