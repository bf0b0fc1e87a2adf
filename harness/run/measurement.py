"""What a cell's ranks hand to rank 0, typed: each rank's measurement and rank 0's own facts of the run.

:class:`RankMeasurement` crosses the process group as JSON (``asdict``, never pickle) and comes back as the same
type on rank 0, where :func:`harness.run.record_metrics.worker_metrics` reads it by attribute. A new measurement
is a field here and a line where it is summarised, not a key read in six functions.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class RankMeasurement:
    """One rank's measurements of one cell."""

    rank: int
    times: list[float]
    """Every step's time on this rank, warmup first (s)."""
    cpu_times: list[float] | None
    """CPU ranks: the process's CPU seconds in each step (``time.process_time``), warmup first: what the rank
    computed; its step time less this is what it waited (a pipeline's bubble and transfers). None on CUDA."""
    losses: list[float] | None
    """Every step's loss, or None on a pipeline rank without the loss (a rank has every step's or none)."""
    g_small: list[float] | None
    """DDP: the local gradient's squared norm per step (the small batch of the gradient noise scale)."""
    mem: dict[str, Any]
    """:func:`harness.measure.rank_memory.peak_memory`, and ``peak_tensor_bytes`` on CPU ranks."""
    state_bytes: dict[str, int]
    """Model-state bytes this rank holds (:func:`harness.measure.rank_memory.model_state_bytes`)."""
    comm: dict[str, dict[str, float]]
    """Calls and bytes per collective on the counted step."""
    comm_cp: dict[str, dict[str, float]]
    """Of those, context parallel's K/V gathers and scatters."""
    moe_ep_rows: dict[str, list[float]] | None
    """Expert parallel: :meth:`harness.parallel.expert_load.ExpertLoad.ep_rows`."""
    trace: dict[str, str]
    """``--profile``: this rank's trace file, by rank."""
    profiled_times: list[float]
    """``--profile``: the step timer's time of each recorded step."""
    probe: dict[str, Any]
    """Step 1's squared norms (:func:`harness.measure.parity_probe.tensor_sq_norms`)."""
    dynamo: dict[str, Any] | None
    """``--compile on``: dynamo's counts over the warmup and the measured window."""
    fp8_linears: list[str]
    """``fp8``: the linears this rank trained in float8 (torchao's ``Float8Linear``), by name in the model."""
    observed: dict[str, Any] | None = None
    """What this rank's run did, read off the counted step and the built modules: the claims' evidence
    (:func:`harness.run.worker._observed`, judged by :mod:`harness.run.claims`)."""
    checkpoint: dict[str, Any] | None = None
    """``--checkpoint``: this rank's saves and restore check (:class:`harness.run.checkpoint.CheckpointLog`)."""
    step_parts: list[dict[str, float]] | None = None
    """CPU pipeline ranks: the seconds of each stage action in each step, warmup first
    (:data:`harness.parallel.schedules.STAGE_ACTIONS`); None elsewhere."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RankMeasurement:
        return cls(**{f.name: d[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class CellRun:
    """Rank 0's own facts of the run, beside every rank's measurements."""

    g_big: list[float]
    """DDP: the all-reduced gradient's squared norm per step (the big batch)."""
    skipped: int
    """fp16 steps the loss scaler skipped."""
    final_scale: float | None
    """The fp16 loss scale after the last step; None without a scaler."""
    entropy_floor: float
    threads: int
    device_name: str
    monitor: Any
    """The monitor's result (:mod:`harness.measure.monitor`), or None without one."""
    trace: dict[str, Any] | None
    """The profiler traces' aggregate, or None without ``--profile``."""
    worker_wall_s: float
    phase_marks: dict[str, float]
    nvtx: dict[str, Any] | None
    moe: dict[str, Any] | None
    """:meth:`harness.parallel.expert_load.ExpertLoad.summary` and ``per_step``; None for a dense model."""
