"""Turn per-rank raw measurements into a cell's metrics (pure: unit-tested on numbers).

Conventions (written into every record under ``metrics.conventions``):

* a step's time is the slowest rank's time for that step;
* ``tokens_per_s = global tokens per step / median step time``;
* ``tflops_per_device = flops_per_token x tokens_per_s / devices / 1e12`` (PaLM FLOPs/token);
* ``mfu_pct = 100 x tflops_per_device / peak`` (datasheet, or measured matmul peak when calibrated).
"""

from __future__ import annotations

import math

from harness.measure.peaks import datasheet_peak_tflops, mfu_pct
from harness.measure.step_stats import Stats
from harness.records.schema import CalibratedMfuMetrics, MfuMetrics, ThroughputMetrics

CONVENTIONS = {
    "step_time": "slowest rank per step; warmup excluded",
    "tokens_per_s": "global_batch x seq_len / median step time",
    "flops_per_token": "PaLM: 6*N_nonembed + 12*L*d*S (fwd+bwd, recompute not counted)",
    "tflops_per_device": "flops_per_token x tokens_per_s / devices / 1e12",
    "mfu_pct": "100 x tflops_per_device / datasheet peak (device, compute dtype)",
    "mfu_calibrated_pct": "100 x tflops_per_device / measured matmul peak (harness calibrate)",
    "comm_bytes": "nccl-tests sizes per call on one rank: all_gather output, reduce_scatter input, else tensor size",
}


def slowest_per_step(per_rank: list[list[float]]) -> list[float]:
    lengths = {len(r) for r in per_rank}
    if len(lengths) != 1:
        raise ValueError(f"ranks measured different step counts: {sorted(lengths)}")
    return [max(col) for col in zip(*per_rank)]


def global_loss(per_rank_losses: list[list[float] | None]) -> list[float]:
    """Mean over the ranks that computed a loss (dp replicas, all tp ranks, last pp stages)."""
    have = [l for l in per_rank_losses if l is not None]
    if not have:
        return []
    return [sum(col) / len(col) for col in zip(*have)]


def steps_to_target(losses: list[float], step_times: list[float], target: float) -> tuple[int | None, float | None]:
    """First step (1-based) whose loss <= target, and the training time up to and including it."""
    elapsed = 0.0
    for i, (loss, t) in enumerate(zip(losses, step_times), start=1):
        elapsed += t
        if loss <= target:
            return i, elapsed
    return None, None


def throughput(stats: Stats, tokens_per_step: int, world: int, flops_per_token: int) -> ThroughputMetrics:
    tps = tokens_per_step / stats.median
    tflops = flops_per_token * tps / world / 1e12
    return {"tokens_per_s": tps, "tokens_per_s_per_device": tps / world, "tflops_per_device": tflops}


def mfu_fields(tflops_per_device: float, device_kind: str, device_name: str, dtype: str) -> MfuMetrics:
    """MFU against the datasheet peak of this device and dtype; n/a with the reason when unknown."""
    peak, reason = datasheet_peak_tflops(device_name, dtype, device_kind)
    return {"peak_tflops": peak, "mfu_pct": mfu_pct(tflops_per_device, peak), "mfu_reason": reason}


def calibrated_mfu_fields(tflops_per_device: float, calibrated_tflops: float | None, device_name: str,
                          dtype: str) -> CalibratedMfuMetrics:
    """MFU against the measured matmul peak (``harness calibrate``); n/a with the remedy without one."""
    if calibrated_tflops:
        return {"calibrated_tflops": calibrated_tflops,
                "mfu_calibrated_pct": mfu_pct(tflops_per_device, calibrated_tflops), "mfu_calibrated_reason": None}
    return {"calibrated_tflops": None, "mfu_calibrated_pct": None,
            "mfu_calibrated_reason": f"n/a: no calibration for {device_name} {dtype}; run `harness calibrate`"}


def max_rel_diff(a: list[float], b: list[float]) -> float | None:
    """max_i |a_i - b_i| / |b_i| over the common prefix (b is the reference)."""
    n = min(len(a), len(b))
    if n == 0:
        return None
    return max(abs(x - y) / abs(y) if y else math.inf for x, y in zip(a[:n], b[:n]))


OVERHEAD_PARTS = ("launch", "imports", "process_group", "build", "warmup", "measured", "extra_steps", "profile",
                  "result", "teardown")
"""A cell's job from launch to exit, in order (:mod:`harness.measure.phases`): ``launch`` is the job's
start to the rank process's start, ``teardown`` the result built to the job's exit."""


def overhead_parts(marks: dict[str, float], job_start: float, job_end: float) -> dict[str, float]:
    """Seconds per part of one cell's job, from rank 0's phase marks (wall-clock times).

    The parts telescope from ``job_start`` to ``job_end``, so they sum to the job's wall time; a
    phase without a mark (no ``--profile``) is 0, and a mark before the previous one (the process
    start's 10 ms resolution) counts as 0 rather than negative.
    """
    edges = {"launch": "process_start", **{p: p for p in OVERHEAD_PARTS[1:-1]}}
    parts, t = {}, job_start
    for part, mark in edges.items():
        end = min(max(t, marks.get(mark, t)), job_end)
        parts[part] = end - t
        t = end
    parts["teardown"] = job_end - t
    return parts
