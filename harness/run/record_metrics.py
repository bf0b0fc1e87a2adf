"""The record's metrics, built in one place from typed parts (:mod:`harness.records.schema`).

Rank 0 of the worker summarises what every rank measured into :class:`WorkerMetrics`
(:func:`worker_metrics`); the sweep completes it with the calibrated MFU, parity and
:class:`RunMetrics` from :class:`RunFacts` when it writes the record (:func:`cell_metrics`, or
:func:`run_metrics` alone for a cell without a result). Nothing else writes a metric key.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from harness.measure import gns
from harness.measure.compile_stats import DynamoCounts, compile_metrics
from harness.measure.parity_probe import merge
from harness.measure.step_stats import Stats
from harness.parallel.schedules import (
    ZERO_BUBBLE_SCHEDULES,
    expected_bubble,
    stage_action_split_ms,
    stages_per_rank,
)
from harness.precision import float8_tp_styles
from harness.records.schema import (
    CalibratedMfuMetrics,
    CellMetrics,
    CommMetrics,
    InstrumentMetrics,
    LossMetrics,
    MemoryMetrics,
    MfuMetrics,
    RunMetrics,
    TimingMetrics,
    WorkerMetrics,
)
from harness.run.checkpoint_metrics import checkpoint_metrics
from harness.run.formulas import (
    CONVENTIONS,
    calibrated_mfu_fields,
    global_loss,
    mfu_fields,
    overhead_parts,
    slowest_per_step,
    steps_to_target,
    throughput,
)
from harness.run.measurement import CellRun, RankMeasurement
from harness.run.parity import parity_metrics
from harness.spec import CellConfig
from harness.units import GIB

DEFAULT_TARGET_MARGIN = 0.5
"""Default loss target: the data's entropy floor plus this many nats."""


def _memory(gathered: list[RankMeasurement], threads: int | None) -> MemoryMetrics:
    mems = [g.mem for g in gathered]
    states = [g.state_bytes["total"] for g in gathered]
    m: MemoryMetrics = {
        "threads_per_rank": threads,
        "peak_mem_gib": max(x["peak_mem_gib"] for x in mems),
        "peak_mem_gib_per_rank": [x["peak_mem_gib"] for x in mems],
        "peak_mem_kind": mems[0]["peak_mem_kind"],
        "model_state_bytes_per_rank": max(states),
        "model_state_bytes_by_rank": states,
        "model_state_breakdown_rank0": gathered[0].state_bytes,
    }
    if "peak_tensor_bytes" in mems[0]:  # CPU ranks: live tensor storages on an untimed step
        m["peak_tensor_gib"] = max(x["peak_tensor_bytes"] for x in mems) / GIB
        m["peak_tensor_gib_per_rank"] = [x["peak_tensor_bytes"] / GIB for x in mems]
    if "peak_mem_reserved_gib" in mems[0]:
        m["peak_mem_reserved_gib"] = max(x["peak_mem_reserved_gib"] for x in mems)
        m["mem_capacity_pct"] = 100 * m["peak_mem_gib"] / mems[0]["mem_capacity_gib"]
    return m


def _mfu(cfg: CellConfig, tflops_per_device: float, device_name: str) -> MfuMetrics:
    if cfg.fp8_emulate:  # the matmuls ran in high precision: a speed that says nothing of FP8 tensor cores
        return {"peak_tflops": None, "mfu_pct": None,
                "mfu_reason": "n/a: fp8 emulated (torchao's casts and scales, the matmuls in high precision)"}
    return mfu_fields(tflops_per_device, cfg.device_kind, device_name, cfg.precision_plan.compute_dtype)


def _fp8(cfg: CellConfig, gathered: list[RankMeasurement]) -> dict:
    """The linears the ranks trained in float8 (a pipeline's stages hold different blocks; tp ranks the same
    names); the sweep holds them to the model's list (:func:`fp8_against_model`)."""
    converted = sorted({name for g in gathered for name in g.fp8_linears})
    return {"recipe": cfg.fp8_recipe, "emulated": cfg.fp8_emulate, "float8_all_gather": cfg.fp8_all_gather,
            "tp_float8_styles": cfg.layout.dims.tp_enabled and float8_tp_styles(cfg.device_kind),
            "converted": converted, "linears_converted": len(converted)}


def fp8_against_model(fp8: Mapping[str, Any], model: list[str] | None) -> dict:
    """A record's converted linears beside the model's (``predicted.fp8_linears``,
    :func:`harness.model.block_ops.fp8_linears`): both lists empty of the other's names in a correct cell."""
    if model is None:
        return {**fp8, "linears_model": None, "not_converted": None, "converted_not_in_model": None}
    converted = set(fp8.get("converted") or [])
    return {**fp8, "linears_model": len(model), "not_converted": sorted(set(model) - converted),
            "converted_not_in_model": sorted(converted - set(model))}


def _comm(gathered: list[RankMeasurement]) -> CommMetrics:
    comm = gathered[0].comm
    out: CommMetrics = {"comm": comm, "comm_by_rank": [g.comm for g in gathered],
                        "comm_bytes_per_step": sum(v["bytes_per_step"] for v in comm.values())}
    cp = gathered[0].comm_cp
    if cp:  # context parallel's K/V all-gathers and gradient reduce-scatters, also counted in comm
        out["comm_cp"] = cp
        out["cp_comm_bytes_per_step"] = sum(v["bytes_per_step"] for v in cp.values())
    return out


def _loss(cfg, losses: list[float], all_steps: list[float], entropy_floor: float) -> LossMetrics:
    target = cfg.target_loss if cfg.target_loss is not None else entropy_floor + DEFAULT_TARGET_MARGIN
    s2t, t2t = steps_to_target(losses, all_steps, target) if losses else (None, None)
    return {"loss": losses, "final_loss": losses[-1] if losses else None, "entropy_floor": entropy_floor,
            "target_loss": target, "target_margin_nats": None if cfg.target_loss is not None else DEFAULT_TARGET_MARGIN,
            "steps_to_target": s2t, "time_to_target_s": t2t,
            "target_reason": None if s2t else f"not reached in {len(losses)} steps (target {target:.3f} nats)",
            "lr": cfg.lr}


def _gns(gathered: list[RankMeasurement], g_big: list[float], cfg: CellConfig) -> dict:
    dims = cfg.layout.dims
    smalls = [g.g_small for g in gathered if g.g_small is not None]
    if not smalls or dims.dp < 2:
        return {"b_simple": None, "reason": "n/a: needs data-parallel replicas (ddp) to compare local and global gradients"}
    g_small = [sum(col) / len(col) for col in zip(*smalls)]
    return gns.b_simple(g_small, g_big, float(cfg.global_batch // dims.dp), float(cfg.global_batch))


def _idle_over_busy(gathered: list[RankMeasurement], warmup: int) -> list[float | None] | None:
    """Per rank, the median over the measured steps of (step time - CPU time) / CPU time: what a CPU rank waited
    (its pipeline bubble and transfers) over what it computed, comparable to the schedule's simulated bubble
    (``predicted.pipeline_bubble_by_rank``). None on CUDA, where a rank's CPU time is not its device's work."""
    if any(g.cpu_times is None for g in gathered):
        return None
    out = []
    for g in sorted(gathered, key=lambda g: g.rank):
        pairs = list(zip(g.times, g.cpu_times or []))[warmup:]
        out.append(statistics.median((t - c) / c for t, c in pairs) if pairs and all(c > 0 for _, c in pairs) else None)
    return out


def _actions_ms(gathered: list[RankMeasurement], warmup: int) -> list[dict[str, float] | None] | None:
    """Per rank, the mean measured step split into its stage actions and the rest, in ms
    (:func:`harness.parallel.schedules.stage_action_split_ms`). None on CUDA, where the host's clock around an
    action does not time its kernels."""
    if any(g.step_parts is None for g in gathered):
        return None
    return [stage_action_split_ms((g.step_parts or [])[warmup:], g.times[warmup:])
            for g in sorted(gathered, key=lambda g: g.rank)]


def _instruments(cfg: CellConfig, gathered: list[RankMeasurement], run: CellRun) -> InstrumentMetrics:
    dims, monitor_result = cfg.layout.dims, run.monitor
    m: InstrumentMetrics = {"gns": _gns(gathered, run.g_big, cfg)}
    if dims.pp_enabled:
        v = stages_per_rank(cfg.pp_schedule)
        # the formula holds for GPipe, 1F1B and interleaved 1F1B; a zero-bubble schedule's is the model's simulation
        # of its action list (harness.model.pipeline_sim, record.predicted's step time)
        formula = cfg.pp_schedule not in ZERO_BUBBLE_SCHEDULES
        m["pipeline"] = {"stages": dims.pp * v, "virtual_per_rank": v, "microbatches": cfg.microbatches,
                         "expected_bubble": expected_bubble(dims.pp, v, cfg.microbatches) if formula else None,
                         "idle_over_busy_by_rank": _idle_over_busy(gathered, cfg.warmup),
                         "actions_ms_by_rank": _actions_ms(gathered, cfg.warmup)}
    if cfg.monitor_hz == 0:
        m["monitor"] = {"note": "n/a: monitor off (--monitor-hz 0)"}
    elif monitor_result is not None:
        m["monitor"] = monitor_result.to_record()
        energy = monitor_result.summary.get("energy_j")
        if energy is not None:
            m["energy_j_per_token"] = energy / (cfg.tokens_per_step * cfg.steps)
    if run.trace is not None:
        m["trace"] = run.trace
    return m


def _compile(gathered: list[RankMeasurement], warmup_s: list[float], median_s: float) -> dict:
    """Compile time and dynamo's counts, each the most any rank saw (a rank that recompiled flags the cell)."""
    per_rank = [g.dynamo for g in gathered if g.dynamo]
    most = {phase: DynamoCounts(**{k: max(r[phase][k] for r in per_rank) for k in per_rank[0][phase]})
            for phase in ("warmup", "measured")}
    return compile_metrics(warmup_s, median_s, most["warmup"], most["measured"])


def worker_metrics(cfg: CellConfig, gathered: list[RankMeasurement], run: CellRun
                   ) -> tuple[WorkerMetrics, dict[str, Any]]:
    """Rank 0's metrics and raw samples from every rank's measurements and its own facts of the run."""
    size, precision = cfg.model_size, cfg.precision_plan
    per_rank_times = [g.times for g in gathered]
    all_steps = slowest_per_step(per_rank_times)
    measured = all_steps[cfg.warmup:]
    stats = Stats.of(measured)
    timing: TimingMetrics = {"conventions": CONVENTIONS, "step_time_s": stats.as_dict(),
                             "unstable": stats.unstable_reason() is not None,
                             "unstable_reason": stats.unstable_reason(), "tokens_per_step": cfg.tokens_per_step}
    tput = throughput(stats, cfg.tokens_per_step, cfg.world_size, size.flops_per_token())
    m: WorkerMetrics = {
        **timing, **tput,
        **_mfu(cfg, tput["tflops_per_device"], run.device_name),
        **_memory(gathered, run.threads if cfg.device_kind == "cpu" else None),
        **_comm(gathered),
        **_loss(cfg, global_loss([g.losses for g in gathered]), all_steps, run.entropy_floor),
        "precision": precision.describe(cfg.layout.data_parallel),
        **_instruments(cfg, gathered, run),
        "worker_wall_s": run.worker_wall_s,
    }
    if run.nvtx is not None and run.nvtx["enabled"]:
        m["nvtx"] = run.nvtx
    moe = dict(run.moe or {})
    per_step = moe.pop("per_step", None)
    if size.moe is not None:
        total = tput["tflops_per_device"] * size.flops_per_token_total() / size.flops_per_token()
        m["moe"] = {"routing": cfg.moe_routing, **moe, "tflops_per_device_total_params": total,
                    "mfu_total_params_pct": mfu_fields(total, cfg.device_kind, run.device_name,
                                                       precision.compute_dtype)["mfu_pct"]}
    if cfg.compile:
        m["compile"] = _compile(gathered, all_steps[: cfg.warmup], stats.median)
    if cfg.precision == "fp8":
        m["fp8"] = _fp8(cfg, gathered)
    if cfg.checkpoint != "off" or any(g.checkpoint for g in gathered):
        ranks = sorted(gathered, key=lambda g: g.rank)
        m["checkpoint"] = checkpoint_metrics([g.checkpoint or {} for g in ranks], stats.median,
                                             [g.state_bytes["params"] + g.state_bytes["optimizer"] for g in ranks],
                                             replicas=cfg.layout.dims.dp_replicate)
    if all(g.observed is not None for g in gathered):  # what each rank's run did: the claims' evidence
        m["observed"] = {"by_rank": [g.observed for g in sorted(gathered, key=lambda g: g.rank)]}
    step1 = merge([g.probe for g in gathered])
    m["grad_norm_step1"] = step1["grad_norm"]
    m["param_norm_step1"] = step1["param_norm"]
    if run.final_scale is not None:
        m["fp16_skipped_steps"] = run.skipped
        m["fp16_final_scale"] = run.final_scale
    samples = {"step_time_s": measured, "warmup_step_time_s": all_steps[: cfg.warmup],
               "step_time_s_per_rank": [t[cfg.warmup:] for t in per_rank_times],
               "param_norms_step1": step1["param_norms"], "grad_norms_step1": step1["grad_norms"],
               "grad_near_eps_step1": step1["grad_near_eps"],
               "phase_marks": run.phase_marks}
    if per_step is not None:
        samples["moe_load_per_step"] = per_step
    ep_rows = [g.moe_ep_rows for g in gathered if g.moe_ep_rows is not None]
    if ep_rows:
        m["moe"]["ep"] = _ep_metrics(ep_rows, cfg.warmup)
        samples["moe_ep_rows_per_step_by_rank"] = ep_rows
    return m, samples


def _ep_metrics(by_rank: list[dict[str, list[float]]], warmup: int) -> dict[str, Any]:
    """Expert parallel: the share of routed rows that left their rank over the measured steps (every rank),
    and each rank's rows on the step the comm counter counted (the last one), which fix its all-to-all bytes."""
    measured = slice(warmup, -1)
    routed = sum(sum(r["routed"][measured]) for r in by_rank)
    left = sum(sum(r["left"][measured]) for r in by_rank)
    return {"tokens_left_rank_share": left / routed if routed else None,
            "counted_step_rows_sent_by_rank": [r["routed"][-1] for r in by_rank],
            "counted_step_rows_received_by_rank": [r["received"][-1] for r in by_rank],
            "counted_step_rerun_rows_sent_by_rank": [r["rerun_routed"][-1] for r in by_rank],
            "counted_step_rerun_rows_received_by_rank": [r["rerun_received"][-1] for r in by_rank]}


@dataclass(frozen=True)
class RunFacts:
    """What the sweep knows of a cell's run beside what its ranks measured."""

    wall_s: float
    """The cell's job, launch to exit (the launcher's clock)."""
    est_mem_gib: float | None
    """The plan's memory estimate per rank."""
    started_at: float | None = None
    """Wall-clock start of the job (``time.time()``), the clock of the ranks' phase marks."""

    batch_search: dict | None = None
    """``--batch auto``: every trial (:meth:`harness.run.batch_search.BatchSearch.as_dict`)."""
    machine_probe_s: dict[str, float] | None = None
    """CPU: the normaliser workload timed ``before`` and ``after`` the cell (:mod:`harness.measure.machine_probe`)."""
    nsys: dict | None = None
    """Under Nsight Systems: the reports read back per rank (:func:`harness.run.nsys_capture.captured_job`)."""
    rounds: dict | None = None
    """``--rounds N``: every round's median and the median's interval (:mod:`harness.run.rounds`)."""


def _overhead(facts: RunFacts, phase_marks: dict[str, float] | None) -> dict[str, Any]:
    """Where the cell's time went: the job's parts (rank 0's phase marks), the machine probe around
    it, and the measured steps' share of the whole."""
    parts = overhead_parts(phase_marks, facts.started_at, facts.started_at + facts.wall_s) \
        if phase_marks and facts.started_at is not None else {"job": facts.wall_s}
    probe = facts.machine_probe_s or {}
    parts["machine_probe"] = sum(v for v in probe.values() if v is not None)
    total = sum(parts.values())
    return {"parts_s": parts, "total_s": total,
            "measured_share": parts["measured"] / total if "measured" in parts and total > 0 else None,
            "basis": "rank 0's phase marks between the job's start and exit (harness.measure.phases)"
            if "measured" in parts else "the job's wall time only (no result)"}


def run_metrics(facts: RunFacts, phase_marks: dict[str, float] | None = None) -> RunMetrics:
    """The run's part of a record; all a cell without a result carries."""
    m: RunMetrics = {"wall_s": facts.wall_s, "est_mem_gib": facts.est_mem_gib,
                     "overhead": _overhead(facts, phase_marks)}
    if facts.batch_search is not None:
        m["batch_search"] = facts.batch_search
    if facts.machine_probe_s is not None:
        m["machine_probe_s"] = facts.machine_probe_s
    if facts.nsys is not None:
        m["nsys"] = facts.nsys
    if facts.rounds is not None:
        m["rounds"] = facts.rounds
    return m


def cell_metrics(cell_id: str, cfg: dict, worker: WorkerMetrics, samples: dict, facts: RunFacts, *,
                 calibrated_tflops: float | None, device_name: str, compute_dtype: str,
                 reference: dict | None, predicted: Mapping[str, Any] | None = None) -> CellMetrics:
    """The record's metrics of an ok cell: the worker's, the calibrated MFU, the run's part and parity
    (an fp8 cell's converted linears held to the model's, ``predicted.fp8_linears``)."""
    calibrated: CalibratedMfuMetrics = calibrated_mfu_fields(worker["tflops_per_device"], calibrated_tflops,
                                                             device_name, compute_dtype)
    if "fp8" in worker:
        worker = {**worker, "fp8": fp8_against_model(worker["fp8"], (predicted or {}).get("fp8_linears"))}
    return {**worker, **calibrated, **run_metrics(facts, samples.get("phase_marks")),
            **parity_metrics(cell_id, cfg, worker, samples, reference)}
