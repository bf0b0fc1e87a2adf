"""The benchmark tier's thread count: set, not inherited from whatever ran before."""

from __future__ import annotations

import os

import psutil
import torch

from tests.bench.conftest import bench_threads


def test_thread_count_is_omp_num_threads_else_one_per_physical_core() -> None:
    physical = psutil.cpu_count(logical=False) or os.cpu_count()
    assert bench_threads({}) == physical
    assert bench_threads({"OMP_NUM_THREADS": "1"}) == 1
    assert bench_threads({"OMP_NUM_THREADS": "3"}) == 3
    assert bench_threads({"OMP_NUM_THREADS": ""}) == physical
    assert bench_threads({"OMP_NUM_THREADS": "0"}) == physical
    assert bench_threads({"OMP_NUM_THREADS": "two"}) == physical


def test_the_fixture_applied_it() -> None:
    omp = os.environ.get("OMP_NUM_THREADS", "")
    expected = int(omp) if omp.isdigit() and int(omp) > 0 else (psutil.cpu_count(logical=False) or os.cpu_count())
    assert torch.get_num_threads() == expected
