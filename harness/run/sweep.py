"""Run a planned sweep: one job per cell, one record per cell, nothing measured ever lost.

Records are appended (flush + fsync, a torn tail set aside first) as each cell finishes; a cell
interrupted by Ctrl-C or SIGTERM gets no record. ``--resume DIR`` runs only the cells whose
latest record is neither ``ok`` nor ``invalid``: the latest record of a cell wins, and earlier
attempts stay in the file. Parity is computed as records land, against the group's
single-device reference, which the planner orders first. Each record carries the prediction
the planner attached to its cell.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from harness.plan import PlannedCell
from harness.precision import PrecisionPlan
from harness.records.env import capture
from harness.records.reader import RECORDS_FILENAME, append_record, latest_per_cell
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
    done = finished_cells(existing)
    references = {parity_key(r["config"]): r for r in latest_per_cell(existing)[0]
                  if r.get("status") == "ok" and r["config"].get("strategy") == "single"}
    env = capture(device_kind)
    todo = {c.cell_id for c in cells_to_run(cells, done, writer)}
    progress = progress or Progress(total=len(todo), stream=sys.stdout)
    written: list[dict] = []
    records_path = opts.out / RECORDS_FILENAME
    for index, cell in enumerate(cells):
        if cell.cell_id not in todo:
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
            side = append_record(records_path, rec)
            if side is not None:
                print(f"{records_path}: its torn last line was moved to {side}", file=sys.stderr, flush=True)
        written.append(rec)
        progress.finish(cell.cell_id, rec["status"], _short(rec))
    progress.close()
    return written


def finished_cells(existing: list[dict]) -> set[str]:
    """Cells a resume leaves alone: their latest record is ``ok``, or ``invalid`` (nothing to run)."""
    return {r["cell_id"] for r in latest_per_cell(existing)[0]
            if r.get("kind", "cell") == "cell" and r.get("status") in ("ok", "invalid")}


def cells_to_run(cells: list[PlannedCell], done: set[str], writer: bool = True) -> list[PlannedCell]:
    """The cells this node runs (or records as invalid): not finished, and not one-node cells
    on a node other than 0 (the single-device reference runs on node 0 only)."""
    return [c for c in cells if c.cell_id not in done and not (not writer and c.valid and c.config.nnodes == 1)]


def _rdzv_id(opts: SweepOptions, index: int) -> str:
    """Nodes of a multi-node sweep share no run id, but they walk the cells in the same order."""
    return f"harness-cell{index}" if opts.rdzv.nnodes > 1 else f"{opts.run_id}-{index}"


def _short(rec: dict) -> str:
    if rec["status"] != "ok":
        return (rec.get("error") or "").splitlines()[0] if rec.get("error") else ""
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
                           references.get(parity_key(cfg)), res["samples"])
    return make_record(run_id=run_id, cell_id=cell.cell_id, status="ok", config=cfg, env=res["env"],
                       degrees=res["degrees"], workload=res["workload"], metrics=metrics, samples=res["samples"],
                       predicted=cell.predicted)
