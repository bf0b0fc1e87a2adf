"""CPU ranks get the cores the process may use (its affinity), not the machine's count: what Slurm's CPU binding,
``taskset`` or a container's cpuset leave it. Before, a job bound to 4 of a node's 64 cores ran each of its 4 ranks
on 16 threads."""

from __future__ import annotations

import os

import pytest

from harness import spec
from harness.model.predict import core_sharing


@pytest.fixture
def affinity(monkeypatch):
    def set_cores(cores: set[int]) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cores)
        monkeypatch.setattr(os, "cpu_count", lambda: 64)

    return set_cores


def test_ranks_share_the_cores_the_process_may_use(affinity):
    affinity({0, 1, 2, 3})
    assert spec.usable_cores() == 4
    assert [spec.threads_per_rank(n) for n in (1, 2, 3, 4, 8)] == [4, 2, 1, 1, 1]
    sharing = core_sharing("cpu", 4, 1, 4)
    assert (sharing.cores, sharing.node_ranks) == (4.0, 4)
    assert core_sharing("cuda", 4, 1, 4).cores == float("inf")  # GPUs share no cores


def test_without_an_affinity_call_the_machine_s_count(monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert spec.usable_cores() == 6 and spec.threads_per_rank(4) == 1 and spec.threads_per_rank(2) == 3
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert spec.usable_cores() == 1
