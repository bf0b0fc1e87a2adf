"""How fast the machine is right now: a fixed matmul workload, timed.

The run's normaliser (:mod:`harness.calibration.normaliser`) times it once when the run is
calibrated; on CPU the sweep times it again before and after every cell
(``metrics.machine_probe_s``). A shared machine's speed drifts by tens of percent within a
minute (``scripts/machine_drift.py``; results/reference/machine-drift), and the two are meant
to say how much slower the machine was around the cell than when its prediction's calibration
was measured (:func:`harness.report.model_error.machine_factor`). On the CPU references they
explain part of the model's error at most: ``-r4`` 21.5% raw against 21.4% adjusted, ``-r5``
(a sweep the machine ran 1.1-1.8x slower than it calibrated) 31.7% against 16.6%.
"""

from __future__ import annotations

import statistics

import torch

from harness.measure.timer import StepTimer

PROBE_SAMPLES = 9
"""Samples of the workload in one :func:`machine_probe_s` (about 0.1 s on a CPU)."""


def side(device_kind: str) -> int:
    """The square matmul's side: 2048 on a GPU, 384 on a CPU."""
    return 2048 if device_kind == "cuda" else 384


def matmul_times(device_kind: str, samples: int) -> list[float]:
    """Seconds per 4 square matmuls, ``samples`` times after 2 untimed."""
    dev = "cuda" if device_kind == "cuda" else "cpu"
    n = side(device_kind)
    a = torch.randn(n, n, device=dev)
    b = torch.randn(n, n, device=dev)
    timer = StepTimer(device_kind)
    times = []
    for i in range(samples + 2):
        timer.start()
        for _ in range(4):
            a @ b
        t = timer.stop()
        if i >= 2:
            times.append(t)
    return times


def machine_probe_s(device_kind: str, samples: int = PROBE_SAMPLES) -> float:
    """The workload now: median seconds, held against the run's calibration record."""
    return statistics.median(matmul_times(device_kind, samples))
