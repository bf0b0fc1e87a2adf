"""The CI regression-gate workload: a tiny training step and a calibration matmul.

``make bench-ci`` saves these as pytest-benchmark JSON; ``harness compare`` reads it, takes the
per-step samples from ``extra_info["step_time_s"]`` and, with ``--normalize calibration``,
divides throughput by the calibration workload measured in the same run.
"""

from __future__ import annotations

import pytest
import torch

from harness.run import train
from tests.bench.conftest import make_context

pytestmark = [pytest.mark.slow, pytest.mark.timing]  # statistical benchmarks: make test-slow, alone

ROUNDS = 30


def test_ci_tiny_train_step(benchmark):
    ctx, _, _, x, y = make_context("tiny", seq_len=128, batch=8, nvtx=True)
    for _ in range(3):
        train.train_step(ctx, x, y, 1e-3)
    benchmark.pedantic(lambda: train.train_step(ctx, x, y, 1e-3), rounds=ROUNDS, iterations=1)
    benchmark.extra_info["tokens_per_step"] = x.numel()
    benchmark.extra_info["step_time_s"] = list(benchmark.stats.stats.data)
    benchmark.extra_info["fingerprint"] = f"tiny-single-fp32-b8-s128-threads{torch.get_num_threads()}"


def test_calibration(benchmark):
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    fn = lambda: [a @ b for _ in range(4)]  # noqa: E731 - the same fixed work as the sweep's calibration
    fn()
    benchmark.pedantic(fn, rounds=ROUNDS, iterations=1)
    benchmark.extra_info["kind"] = "calibration"
    benchmark.extra_info["step_time_s"] = list(benchmark.stats.stats.data)
