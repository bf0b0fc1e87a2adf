"""``record.predicted`` for a planned cell: what the model expects, from calibration files only.

Written before the measurement is compared with it, so the report's error columns say how
far the model can be trusted when it is used where nothing can be measured (``harness plan
--device``).
"""

from __future__ import annotations

import functools
import os

from harness.model.comm import comm_by_rank
from harness.model.compute import lookup_workload, rates_from_entry, roofline_rates, threads_for, wrapper_of
from harness.model.memory import GIB, peak_bytes, state_bytes_by_rank
from harness.model.shape import CellShape
from harness.model.step_time import predict_step

CPU_BASE_GIB = 0.35
"""Process memory of a CPU rank before the model (torch loaded), when no workload calibration measured it."""


def core_share(device_kind: str, local_world: int, threads: int) -> float:
    """Fraction of its threads' cores a CPU rank gets when ranks x threads oversubscribe the cores."""
    if device_kind != "cpu":
        return 1.0
    return min(1.0, (os.cpu_count() or 1) / (local_world * max(1, threads)))


def _comm_time_fn(device_kind: str, nnodes: int):
    from harness.measure.calibrate_comm import fitted_time_s, lookup_comm

    @functools.lru_cache(maxsize=None)
    def entry(group: int):
        return lookup_comm(device_kind, group, nnodes=1 if group <= 1 else nnodes)

    def fn(collective: str, nbytes: int, group: int, dim: str | None = None) -> float | None:
        e = entry(group)
        if e is None or collective not in e.get("collectives", {}):
            return None
        return fitted_time_s(e, collective, nbytes, after_compute=True)

    return fn


def predict_cell(cfg) -> dict:
    """Predicted step time, communication, model states and peak memory of a planned cell."""
    from harness.measure import calibrate
    from harness.precision import PrecisionPlan

    c = CellShape.of(cfg)
    local_world = max(1, cfg.world_size // cfg.nnodes)
    threads = threads_for(cfg.device_kind, local_world)
    dtype = PrecisionPlan(cfg.precision).compute_dtype
    notes = []
    concurrent = local_world if cfg.device_kind == "cpu" else 1
    entry = lookup_workload(cfg.device_kind, cfg.size, cfg.seq_len, dtype, threads, concurrent)
    rates = None
    share = core_share(cfg.device_kind, local_world, threads)
    if entry is not None:
        rates = rates_from_entry(entry, wrapper_of(c))
        share = 1.0  # measured with the node's ranks computing at once: the sharing is in the rates
    else:
        peak = calibrate.lookup(cfg.device_kind, dtype, threads)
        if peak is not None:
            rates = roofline_rates(c, peak["tflops"])
            notes.append("no workload calibration: compute at the matmul peak (a lower bound on time)")
    step = None
    if rates is not None:
        step = predict_step(c, rates, _comm_time_fn(cfg.device_kind, cfg.nnodes), share,
                            hide_overlappable=cfg.device_kind == "cuda")
        notes += list(step.notes)
    else:
        notes.append(f"n/a: no calibration for {cfg.device_kind} {dtype} threads={threads}; run harness calibrate")
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
        "notes": notes,
    }
