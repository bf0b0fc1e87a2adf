"""The run's normaliser: a fixed matmul workload timed in the same run as the cells.

``harness compare --normalize calibration`` divides each side's throughput by it, so two runs
on machines of different speed can be compared (docs/records.md, ``kind: "calibration"``).
The workload is :mod:`harness.measure.machine_probe`'s, which the sweep also times around
every CPU cell.
"""

from __future__ import annotations

import torch

from harness.measure.machine_probe import matmul_times, side
from harness.records.env import capture
from harness.records.record import make_record


def calibration_record(run_id: str, device_kind: str, samples: int = 15) -> dict:
    """A fixed reference workload timed in the same run, for ``harness compare --normalize calibration``."""
    n = side(device_kind)
    times = matmul_times(device_kind, samples)
    env = capture(device_kind)
    cfg = {"workload": f"matmul fp32 {n}x{n} x4", "device_kind": device_kind, "tokens_per_step": 1,
           "threads": torch.get_num_threads()}
    return make_record(run_id=run_id, cell_id="calibration", status="ok", config=cfg, env=env, degrees=None,
                       workload={"name": cfg["workload"]}, kind="calibration",
                       metrics={"tokens_per_step": 1}, samples={"step_time_s": times})
