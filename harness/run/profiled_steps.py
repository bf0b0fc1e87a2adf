"""The profiled steps after a cell's measured window, and what their traces say (``metrics.trace``).

``--profile`` runs :data:`PROFILE_STEPS` extra steps under ``torch.profiler`` once the measured window is over, so
profiling never taxes a timed step; rank 0 reads every rank's trace into the step composition.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function, schedule, tensorboard_trace_handler

from harness.measure.nvtx_ranges import PhaseAnnotations
from harness.measure.step_composition import PHASE_PREFIX, composition_from_frames
from harness.measure.timer import StepTimer
from harness.measure.trace_analysis import analyse_frames, load_trace
from harness.run import train
from harness.run.cell_build import Batches
from harness.run.measurement import RankMeasurement
from harness.spec import CellConfig

PROFILE_WARMUP = 1  # after the measured window: 1 profiler warmup step + 3 recorded steps
PROFILE_STEPS = 4


def profile_steps(cfg: CellConfig, ctx: train.StepContext, batches: Batches, first_step: int, out_dir: Path,
             rank: int) -> tuple[dict, list[float]]:
    """Extra steps after the measured window under torch.profiler, so profiling never taxes timed steps.

    Returns this rank's trace path and the step timer's time of each recorded step (data included,
    as in the profiler's ProfilerStep#N window), against which the step composition is checked."""
    trace_dir = out_dir / "traces"
    trace_dir.mkdir(parents=True, exist_ok=True)
    ranks = set(cfg.profile_ranks) if cfg.profile_ranks else set(range(cfg.world_size))
    active = rank in ranks
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cfg.device_kind == "cuda" else [])
    prof = profile(activities=acts, schedule=schedule(wait=0, warmup=PROFILE_WARMUP, active=PROFILE_STEPS - PROFILE_WARMUP),
                   on_trace_ready=tensorboard_trace_handler(str(trace_dir), worker_name=f"rank{rank}", use_gzip=True)) \
        if active else None
    if prof is not None:
        prof.start()
    # harness:<phase> profiler annotations in these steps only: the step composition reads them.
    annotated = replace(ctx, ranges=PhaseAnnotations(ctx.ranges))
    timer = StepTimer(cfg.device_kind)
    times = []
    for i in range(PROFILE_STEPS):
        timer.start()
        with record_function(f"{PHASE_PREFIX}data"):
            x, y = batches(first_step + i)
        train.train_step(annotated, x, y, batches.lr(first_step + i))
        times.append(timer.stop())
        if prof is not None:
            prof.step()
    if prof is not None:
        prof.stop()
    dist.barrier()
    if not active:
        return {}, []
    return ({str(rank): str(p) for p in sorted(trace_dir.glob(f"rank{rank}.*.json.gz"))[-1:]},
            times[PROFILE_WARMUP:])


def analyse_traces(gathered: list[RankMeasurement], out_dir: Path) -> dict | None:
    """The profiler traces' aggregate (``metrics.trace``), with the per-rank table beside the result."""
    traces = {int(k): Path(v) for g in gathered for k, v in g.trace.items()}
    if not traces:
        return None
    frames = {rank: load_trace(path) for rank, path in sorted(traces.items())}  # each trace read once
    df, agg = analyse_frames(frames)
    df.to_csv(out_dir / "trace_ranks.csv", index=False)
    if agg["steps"]:  # else agg["reason"] says why there is no per-step split
        timed = {g.rank: g.profiled_times for g in gathered if g.profiled_times}
        agg.update(composition_from_frames(frames, timed))
    return agg
