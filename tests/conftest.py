"""Set-up every tier shares: under xdist, each worker on cores of its own.

The parallel tiers (``make test``, ``make test-slow-par``: 2 workers on CI's 2 cores) are CPU-bound. Left to the
scheduler, a one-rank cell's two OpenMP threads (the harness gives a rank the cores it may use) meet at every
barrier with the other worker's processes on the same cores: the poisoned-calibration test took 92 s beside the
other worker and 19 s alone. Pinned, a worker's ranks, harness commands and in-process torch share its own cores
(the harness reads its affinity: :func:`harness.spec.usable_cores`), as CPU ranks under Slurm's binding would.
``HARNESS_TEST_PIN=0`` leaves the workers to the scheduler; without xdist nothing is pinned (the timing tier runs
alone, on every core).
"""

from __future__ import annotations

import os
import sys


def pytest_configure(config) -> None:
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if not worker or not count or os.environ.get("HARNESS_TEST_PIN") == "0" or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // count
    if share < 1:  # fewer cores than workers: the scheduler shares them
        return
    index = int(worker.removeprefix("gw"))
    os.sched_setaffinity(0, set(cores[index * share:(index + 1) * share]))
    os.environ["OMP_NUM_THREADS"] = str(share)  # the processes it starts
    torch = sys.modules.get("torch")  # this worker's own, where a plugin imported it already
    if torch is not None:
        torch.set_num_threads(share)
