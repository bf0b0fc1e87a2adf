"""Run a planned sweep: one job per cell, one record per cell, nothing measured ever lost.

Records are appended (flush + fsync) as each cell finishes. ``--resume DIR`` re-runs only
cells without an ``ok`` record. Parity is computed as records land, against the group's
single-device reference, which the planner orders first. Each record carries the prediction
the planner attached to its cell.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from harness.plan import PlannedCell
from harness.precision import PrecisionPlan
from harness.records.atomic import append_jsonl
from harness.records.env import capture
from harness.records.reader import RECORDS_FILENAME
from harness.records.record import make_record
from harness.run.launch import Outcome, Rendezvous, run_cell_job
from harness.run.progress import Progress
from harness.run.record_metrics import cell_metrics, failed_cell_metrics, parity_key
from harness.run.rundir import existing_records


def default_timeout_s(cfg) -> float:
    """Generous for the slowest expected step, so a healthy cell is never cut off."""
    per_step = 6.0 if cfg.device_kind == "cpu" else 3.0
    return 240.0 + per_step * (cfg.warmup + cfg.steps) * max(1, cfg.world_size // 2)


@dataclass
class SweepOptions:
    out: Path
    run_id: str
    cell_timeout_s: float | None = None
    rdzv: Rendezvous = Rendezvous()
    resume: bool = False


def run_sweep(cells: list[PlannedCell], opts: SweepOptions, device_kind: str, env_extra: dict | None = None,
              worker_prefix: list[str] | None = None, progress: Progress | None = None) -> list[dict]:
    """Run every valid cell not already ``ok``; return the records written in this call."""
    writer = opts.rdzv.node_rank == 0
    existing = existing_records(opts.out) if opts.resume else []
    done_ok = {r["cell_id"] for r in existing if r.get("status") == "ok"}
    references = {parity_key(r["config"]): r for r in existing
                  if r.get("status") == "ok" and r["config"].get("strategy") == "single"}
    env = capture(device_kind)
    todo = [c for c in cells if c.cell_id not in done_ok and not _other_node_skips(c, writer)]
    progress = progress or Progress(total=len(todo), stream=sys.stdout)
    written: list[dict] = []
    records_path = opts.out / RECORDS_FILENAME
    for index, cell in enumerate(cells):
        if cell.cell_id in done_ok:
            continue
        if _other_node_skips(cell, writer):
            continue
        progress.start(cell.cell_id)
        if not cell.valid:
            rec = make_record(run_id=opts.run_id, cell_id=cell.cell_id, status="invalid", config=cell.raw, env=env,
                              degrees=None, workload=None, error=cell.reason)
        else:
            cfg = cell.config
            cell_dir = opts.out / "cells" / cell.cell_id if writer else opts.out / f"node{opts.rdzv.node_rank}" / cell.cell_id
            timeout = opts.cell_timeout_s or default_timeout_s(cfg)
            outcome = run_cell_job(cfg, cell_dir, timeout, opts.rdzv, rdzv_id=_rdzv_id(opts, index),
                                   env_extra=env_extra, worker_prefix=worker_prefix)
            rec = _record(cell, outcome, opts.run_id, env, references)
            if rec["status"] == "ok" and cfg.strategy == "single":
                references[parity_key(rec["config"])] = rec
        if writer:
            append_jsonl(records_path, rec)
        written.append(rec)
        progress.finish(cell.cell_id, rec["status"], _short(rec))
    progress.close()
    return written


def _other_node_skips(cell: PlannedCell, writer: bool) -> bool:
    """A one-node cell (the single-device reference) runs on node 0 only."""
    return not writer and cell.valid and cell.config.nnodes == 1


def _rdzv_id(opts: SweepOptions, index: int) -> str:
    """Nodes of a multi-node sweep share no run id, but they walk the cells in the same order."""
    return f"harness-cell{index}" if opts.rdzv.nnodes > 1 else f"{opts.run_id}-{index}"


def _short(rec: dict) -> str:
    if rec["status"] != "ok":
        return (rec.get("error") or "").splitlines()[0][:100] if rec.get("error") else ""
    m = rec["metrics"]
    tps = m.get("tokens_per_s_per_device")
    return f"{tps:,.0f} tok/s/dev" if tps else ""


def _record(cell: PlannedCell, outcome: Outcome, run_id: str, env: dict, references: dict) -> dict:
    cfg = cell.config.to_dict()
    if outcome.status != "ok" or outcome.result is None:
        return make_record(run_id=run_id, cell_id=cell.cell_id, status=outcome.status, config=cfg, env=env,
                           degrees=None, workload=None, error=outcome.error, predicted=cell.predicted,
                           metrics=failed_cell_metrics(outcome.wall_s, cell.est_mem_gib))
    res = outcome.result
    metrics = cell_metrics(cell.cell_id, cfg, res["metrics"], outcome.wall_s, cell.est_mem_gib, cell.calibrated_tflops,
                           res["env"]["device_name"], PrecisionPlan(cell.config.precision).compute_dtype,
                           references.get(parity_key(cfg)))
    return make_record(run_id=run_id, cell_id=cell.cell_id, status="ok", config=cfg, env=res["env"],
                       degrees=res["degrees"], workload=res["workload"], metrics=metrics, samples=res["samples"],
                       predicted=cell.predicted)
