"""``record.predicted`` for a planned cell: what the model expects, from calibration data only.

The planner looks the calibration entries up (:mod:`harness.calibration`) and hands them in as
:class:`CalibrationInputs`; the model reads no files. Predictions are attached to each cell
before it runs, so the report's error columns say how far the model can be trusted where
nothing can be measured (``harness plan --device``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from harness.model.block_ops import fp8_linears
from harness.model.checkpoint_cost import checkpoint_prediction
from harness.model.comm import comm_by_rank
from harness.model.comm_fit import fitted_time_s
from harness.model.compute import (
    NO_SHARING,
    CoreSharing,
    rates_from_entry,
    roofline_rates,
    with_recompute,
    wrapper_of,
)
from harness.model.memory import peak_bytes, state_bytes_by_rank
from harness.model.op_step import block_runs
from harness.model.pipeline_sim import simulate
from harness.model.shape import CellShape
from harness.model.step_time import CommTime, predict_step
from harness.spec import usable_cores
from harness.units import GIB
from workloads.own_model import OwnModel

if TYPE_CHECKING:  # for annotations only: harness.spec imports torch, which the model never needs
    from harness.spec import CellConfig

CPU_BASE_GIB = 0.35
"""Process memory of a CPU rank before the model (torch loaded), when no workload calibration measured it."""


@dataclass(frozen=True)
class CalibrationInputs:
    """The calibration entries one cell's prediction uses (None / no entry: not calibrated)."""

    dtype: str
    """The compute dtype the entries were looked up for."""
    threads: int
    """CPU threads per rank (0 on GPU)."""
    workload: dict | None = None
    """Workload entry (kind ``workload``) at the cell's size, sequence, dtype, threads and ranks at once."""
    workload_compiled: bool = False
    """Whether ``workload`` timed compiled passes (``harness calibrate --workloads SIZE --compile``)."""
    matmul_tflops: float | None = None
    """Measured matmul peak (kind ``matmul``): the roofline fallback without a workload entry."""
    comm: Callable[[int], dict | None] = lambda group: None
    """Comm entry (kind ``comm``) for a group of this many ranks, or None."""
    storage: dict | None = None
    """Storage entry (kind ``storage``) of the run directory's filesystem: a checkpointing cell's save seconds."""


def core_sharing(device_kind: str, local_world: int, threads: int, calibrated_busy: int) -> CoreSharing:
    """How the node's CPU ranks share its cores, against rates measured with ``calibrated_busy`` busy."""
    if device_kind != "cpu":
        return NO_SHARING
    return CoreSharing(cores=float(usable_cores()), threads=threads, calibrated_busy=calibrated_busy,
                       node_ranks=local_world)


def _comm_time_fn(comm: Callable[[int], dict | None]) -> CommTime:
    entry = functools.cache(comm)

    def fn(collective: str, nbytes: int, group: int, dim: str | None = None) -> float | None:
        e = entry(group)
        if e is None or collective not in e.get("collectives", {}):
            return None
        return fitted_time_s(e, collective, nbytes, after_compute=True)

    return fn


OWN_MODULE_NOTE = ("n/a: a module of your own (--model package.module:factory): the analytic model prices the "
                   "harness's own layers; its parameters and FLOPs per token are counted, its memory, communication "
                   "and step time are not priced")


def _own_prediction(cfg: CellConfig, own: OwnModel) -> dict:
    """What the model can count of a module of your own: its parameters and FLOPs (counted on the meta device) and,
    where the layout is data parallel only (its tensors placed by DDP's buckets and FSDP's shards, no tp plan to
    read), its model states and every collective exactly; step time and peak memory are not priced."""
    out = {"model": "harness.model", "step_time_s": None, "tokens_per_s": None, "breakdown": None,
           "comm_bytes_per_step": None, "model_state_bytes_per_rank": None, "peak_mem_gib": None,
           "params": own.params, "flops_per_token": own.flops_per_token(), "notes": [OWN_MODULE_NOTE]}
    if cfg.layout.dims.tp_enabled:
        return {**out, "notes": [OWN_MODULE_NOTE, "tensor parallel by the factory's plan: comm and model states "
                                                  "not priced either"]}
    c = CellShape.of(cfg)
    comm, states = comm_by_rank(c), state_bytes_by_rank(c)
    return {**out, "comm_bytes_per_step": sum(v["bytes_per_step"] for v in comm[0].values()), "comm": comm[0],
            "comm_by_rank": comm, "model_state_bytes_per_rank": max(s.total for s in states),
            "model_state_bytes_by_rank": [s.total for s in states]}


def predict_cell(cfg: CellConfig, cal: CalibrationInputs) -> dict:
    """Predicted step time, communication, model states and peak memory of a planned cell (a module of your own:
    what can be counted, and why the rest is not priced)."""
    workload = cfg.workload
    if isinstance(workload, OwnModel):
        return _own_prediction(cfg, workload)
    c = CellShape.of(cfg)
    local_world = max(1, cfg.world_size // cfg.nnodes)
    notes = []
    rates = None
    # workload passes were timed with the node's ranks computing at once (that sharing is in the
    # rates); the roofline is one rank alone
    busy = local_world if cal.workload is not None else 1
    sharing = core_sharing(cfg.device_kind, local_world, cal.threads, calibrated_busy=busy)
    if cal.workload is not None:
        rates = rates_from_entry(cal.workload, wrapper_of(c))
    elif cal.matmul_tflops is not None:
        rates = roofline_rates(c, cal.matmul_tflops)
        notes.append("no workload calibration: compute at the matmul peak (a lower bound on time)")
    if rates is not None and c.recompute != "none":
        rates = with_recompute(rates, c, block_runs(c))
    if cfg.compile and not cal.workload_compiled:
        notes.append("compile on: priced at the eager rates (no compiled workload calibration: "
                     "harness calibrate --workloads SIZE --compile)")
    step = None
    if rates is not None:
        step = predict_step(c, rates, _comm_time_fn(cal.comm), sharing, hide_overlappable=cfg.device_kind == "cuda")
        notes += list(step.notes)
    else:
        notes.append(f"n/a: no calibration for {cfg.device_kind} {cal.dtype} threads={cal.threads}; "
                     f"run harness calibrate")
    comm = comm_by_rank(c)
    states = state_bytes_by_rank(c)
    base = (rates.base_gib if rates and rates.base_gib is not None else CPU_BASE_GIB) if cfg.device_kind == "cpu" else 0.0
    return {
        "model": "harness.model",
        "step_time_s": step.step_time_s if step else None,
        "tokens_per_s": cfg.tokens_per_step / step.step_time_s if step and step.step_time_s else None,
        "breakdown": step.as_dict() if step else None,
        "comm_bytes_per_step": sum(v["bytes_per_step"] for v in comm[0].values()),
        "comm": comm[0],
        "comm_by_rank": comm,
        "model_state_bytes_per_rank": max(s.total for s in states),
        "model_state_bytes_by_rank": [s.total for s in states],
        "peak_mem_gib": peak_bytes(c, base * GIB) / GIB,
        "peak_tensor_gib": peak_bytes(c, 0.0) / GIB,  # without the process: against measured tensor bytes
        "notes": notes,
        **({"fp8_linears": fp8_linears(c.size)} if cfg.precision == "fp8" else {}),
        **({"checkpoint": checkpoint_prediction(c, cal.storage, cfg.nnodes)}
           if cfg.checkpoint != "off" and cal.storage is not None else {}),
        **({"pipeline_bubble_by_rank": [b.fraction for b in simulate(cfg.pp_schedule, c.dims.pp, c.microbatches)]}
           if c.dims.pp_enabled else {}),
    }
