"""The slurm tier's cluster: one private Slurm (two nodes on this host) for the whole session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.slurm.cluster import SlurmCluster, start_cluster, unavailable

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def slurm(tmp_path_factory) -> SlurmCluster:
    """The started cluster; its ``env`` puts this checkout's ``harness`` on PATH for the jobs
    (sbatch exports the submitting environment), on CPU, one thread per rank, a private calibration."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("slurm-env")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HARNESS_", "SLURM_"))}
    env.update(PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "/usr/bin:/bin")]),
               PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HARNESS_FORCE_CPU="1",
               HARNESS_CALIBRATION=str(tmp / "calibration.json"))
    cluster = start_cluster(env)
    yield cluster
    cluster.stop()
