"""The record's throughput and MFU fields, on numbers worked out by hand; peaks from the datasheets."""

from __future__ import annotations

import math

import pytest

from harness.measure.step_stats import Stats
from harness.run.formulas import (
    OVERHEAD_PARTS,
    calibrated_mfu_fields,
    global_loss,
    max_rel_diff,
    mfu_fields,
    overhead_parts,
    slowest_per_step,
    steps_to_target,
    throughput,
)


def test_slowest_rank_per_step_and_unequal_counts() -> None:
    assert slowest_per_step([[0.10, 0.30, 0.20], [0.25, 0.05, 0.20], [0.01, 0.02, 0.40]]) == [0.25, 0.30, 0.40]
    assert slowest_per_step([[0.1, 0.2]]) == [0.1, 0.2]
    with pytest.raises(ValueError, match=r"ranks measured different step counts: \[1, 2\]"):
        slowest_per_step([[0.1, 0.2], [0.1]])


def test_global_loss_is_the_mean_over_ranks_with_a_loss() -> None:
    assert global_loss([[1.0, 4.0], [3.0, 8.0], [5.0, 0.0]]) == [3.0, 4.0]
    assert global_loss([None, [2.0, 6.0]]) == [2.0, 6.0]
    assert global_loss([None, None]) == [] and global_loss([]) == []


def test_steps_to_target_counts_from_one_and_sums_the_time() -> None:
    assert steps_to_target([5.0, 4.0, 3.0, 2.0], [0.1, 0.2, 0.3, 0.4], 3.0) == (3, pytest.approx(0.6))
    assert steps_to_target([2.0], [0.5], 2.0) == (1, 0.5)  # reaching the target exactly counts
    assert steps_to_target([2.0, 1.0], [0.5, 0.5], 1.999) == (2, 1.0)
    assert steps_to_target([], [], 1.0) == (None, None)


def test_throughput_and_tflops_exact() -> None:
    # 4096 tokens per step, median step 0.25 s, 4 devices, 6e6 FLOPs/token.
    t = throughput(Stats.of([0.2, 0.25, 0.9]), tokens_per_step=4096, world=4, flops_per_token=6_000_000)
    assert t["tokens_per_s"] == 16384.0
    assert t["tokens_per_s_per_device"] == 4096.0
    assert t["tflops_per_device"] == 6e6 * 16384 / 4 / 1e12  # same operations, same order: exact


def test_mfu_against_the_h200_datasheet_and_never_another_chip() -> None:
    # H200 SXM dense: bf16 989.5 TFLOP/s (1,979 with sparsity), fp32 67.
    assert mfu_fields(98.95, "cuda", "NVIDIA H200", "bf16") == {
        "peak_tflops": 989.5, "mfu_pct": pytest.approx(10.0, rel=1e-12), "mfu_reason": None}
    assert mfu_fields(33.5, "cuda", "NVIDIA H200", "fp32")["mfu_pct"] == pytest.approx(50.0, rel=1e-12)
    # A100 SXM dense bf16 312: the H200's table entry must not be used for it.
    assert mfu_fields(31.2, "cuda", "NVIDIA A100-SXM4-80GB", "bf16")["mfu_pct"] == pytest.approx(10.0, rel=1e-12)
    # H100 PCIe is not the SXM part: 756 dense bf16.
    assert mfu_fields(75.6, "cuda", "NVIDIA H100 PCIe", "bf16")["peak_tflops"] == 756.0
    unknown = mfu_fields(10.0, "cuda", "NVIDIA L4", "bf16")
    assert unknown == {"peak_tflops": None, "mfu_pct": None,
                       "mfu_reason": "n/a: device 'NVIDIA L4' is not in the datasheet table (harness/measure/peaks.py)"}
    cpu = mfu_fields(0.1, "cpu", "AMD EPYC 7B13", "fp32")
    assert cpu == {"peak_tflops": None, "mfu_pct": None,
                   "mfu_reason": "n/a: no datasheet peak for CPU (AMD EPYC 7B13); see mfu_calibrated_pct"}
    assert mfu_fields(1.0, "cuda", "NVIDIA H200", "int8")["mfu_reason"] == "n/a: no datasheet peak for int8 on NVIDIA H200"


def test_calibrated_mfu_and_its_remedy() -> None:
    assert calibrated_mfu_fields(35.0, 700.0, "NVIDIA H200", "bf16") == {
        "calibrated_tflops": 700.0, "mfu_calibrated_pct": pytest.approx(5.0, rel=1e-12), "mfu_calibrated_reason": None}
    for missing in (None, 0.0):
        assert calibrated_mfu_fields(35.0, missing, "cpu", "fp32") == {
            "calibrated_tflops": None, "mfu_calibrated_pct": None,
            "mfu_calibrated_reason": "n/a: no calibration for cpu fp32; run `harness calibrate`"}


def test_max_rel_diff_over_the_common_prefix() -> None:
    assert max_rel_diff([1.1, 2.0, 9.0], [1.0, 2.5]) == pytest.approx(0.2)  # |2.0 - 2.5| / 2.5
    assert max_rel_diff([-1.5], [-1.0]) == pytest.approx(0.5)  # relative to |b|
    assert max_rel_diff([1.0], [0.0]) == math.inf
    assert max_rel_diff([], [1.0]) is None and max_rel_diff([1.0], []) is None


def test_overhead_parts_telescope_from_the_jobs_start_to_its_exit() -> None:
    marks = {"process_start": 100.5, "imports": 103.0, "process_group": 103.25, "build": 103.5, "warmup": 104.0,
             "measured": 106.0, "extra_steps": 107.0, "result": 107.5}
    parts = overhead_parts(marks, job_start=100.0, job_end=108.0)
    assert list(parts) == list(OVERHEAD_PARTS)
    assert parts == {"launch": 0.5, "imports": 2.5, "process_group": 0.25, "build": 0.25, "warmup": 0.5,
                     "measured": 2.0, "extra_steps": 1.0, "profile": 0.0, "result": 0.5, "teardown": 0.5}
    assert sum(parts.values()) == 8.0  # the job's wall, exactly


def test_overhead_parts_never_negative_and_clipped_to_the_job() -> None:
    # the kernel's process start (10 ms ticks) can read before the launcher's clock; a mark past the
    # job's end (clocks of two processes) is cut there
    parts = overhead_parts({"process_start": 99.99, "imports": 101.0, "result": 200.0}, job_start=100.0, job_end=102.0)
    assert parts["launch"] == 0.0 and parts["imports"] == 1.0 and parts["result"] == 1.0
    assert parts["teardown"] == 0.0 and sum(parts.values()) == 2.0
    assert all(v >= 0 for v in parts.values())
