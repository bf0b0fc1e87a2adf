"""Run a planned sweep: one job per cell, one record per cell, nothing measured ever lost.

Records are appended (flush + fsync) as each cell finishes. ``--resume DIR`` re-runs only
cells without an ``ok`` record. Parity is computed as records land, against the group's
single-device reference, which the planner orders first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from harness.errors import UsageError
from harness.launch import Outcome, Rendezvous, run_cell_job
from harness.metrics import max_rel_diff
from harness.model.predict import predict_cell
from harness.plan import PlannedCell
from harness.progress import Progress
from harness.results.atomic import append_jsonl, write_json_atomic
from harness.results.env import capture
from harness.results.record import make_record, new_run_id

PARITY_KEYS = ("size", "precision", "global_batch", "seq_len", "lr", "lr_warmup_steps", "seed", "steps", "warmup",
               "scaling", "lr_rule")
PARITY_TOL = {"fp32": 1e-4, "tf32": 5e-3, "bf16": 2e-2, "fp16": 2e-2}
"""Max relative loss difference vs the single-device reference that still counts as parity.

fp32: reductions in a different order (all-reduce, sharded matmuls, microbatch sums) change
results by a few ulps (~1e-7 relative per op); Adam's normalised updates carry that into the
loss at ~1e-6 over tens of steps, so 1e-4 leaves margin yet catches any real mistake (a wrong
gradient scale moves the loss by > 1e-2 within a few steps). Low-precision modes round every
matmul to 8 (bf16) or 11 (fp16) mantissa bits, so their curves agree only to ~1e-2.
"""


def default_timeout_s(cfg) -> float:
    """Generous for the slowest expected step, so a healthy cell is never cut off."""
    per_step = 6.0 if cfg.device_kind == "cpu" else 3.0
    return 240.0 + per_step * (cfg.warmup + cfg.steps) * max(1, cfg.world_size // 2)


def _parity_key(cfg: dict) -> tuple:
    return tuple(cfg.get(k) for k in PARITY_KEYS)


@dataclass
class SweepOptions:
    out: Path
    run_id: str
    cell_timeout_s: float | None = None
    rdzv: Rendezvous = Rendezvous()
    resume: bool = False


def prepare_out(out: Path, resume: bool, node_rank: int) -> Path:
    """A run directory is never overwritten: refuse a used one unless resuming it."""
    records = out / "records.jsonl"
    if node_rank == 0 and not resume and records.exists() and records.stat().st_size > 0:
        raise UsageError(f"--out {out} already holds records; pass a new --out, or --resume {out} to finish it")
    if resume and not records.exists():
        raise UsageError(f"--resume {out}: no records.jsonl there; start a new run with --out {out}")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"--out {out} is not writable ({e.strerror}); choose a writable directory") from None
    return out


def load_existing(out: Path) -> list[dict]:
    path = out / "records.jsonl"
    if not path.exists():
        return []
    recs = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn last line from an interrupted write: that cell simply re-runs
    return recs


def run_sweep(cells: list[PlannedCell], opts: SweepOptions, device_kind: str, env_extra: dict | None = None,
              worker_prefix: list[str] | None = None, progress: Progress | None = None) -> list[dict]:
    """Run every valid cell not already ``ok``; return the records written in this call."""
    writer = opts.rdzv.node_rank == 0
    existing = load_existing(opts.out) if opts.resume else []
    done_ok = {r["cell_id"] for r in existing if r.get("status") == "ok"}
    references = {_parity_key(r["config"]): r for r in existing
                  if r.get("status") == "ok" and r["config"].get("strategy") == "single"}
    env = capture(device_kind)
    todo = [c for c in cells if c.cell_id not in done_ok and not _other_node_skips(c, writer)]
    progress = progress or Progress(total=len(todo), stream=sys.stdout)
    written: list[dict] = []
    records_path = opts.out / "records.jsonl"
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
                references[_parity_key(rec["config"])] = rec
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
    predicted = predict_cell(cell.config)
    if outcome.status != "ok" or outcome.result is None:
        return make_record(run_id=run_id, cell_id=cell.cell_id, status=outcome.status, config=cfg, env=env,
                           degrees=None, workload=None, error=outcome.error, predicted=predicted,
                           metrics={"wall_s": outcome.wall_s, "est_mem_gib": cell.est_mem_gib})
    res = outcome.result
    metrics = res["metrics"]
    metrics["wall_s"] = outcome.wall_s
    metrics["est_mem_gib"] = cell.est_mem_gib
    ref = references.get(_parity_key(cfg))
    tol = PARITY_TOL[cfg["precision"]]
    if cfg["strategy"] == "single":
        metrics["parity_max_rel_diff"] = 0.0
        metrics["parity"] = {"reference": cell.cell_id, "tolerance": tol, "ok": True}
    elif ref is not None and metrics.get("loss") and ref["metrics"].get("loss"):
        diff = max_rel_diff(metrics["loss"], ref["metrics"]["loss"])
        metrics["parity_max_rel_diff"] = diff
        metrics["parity"] = {"reference": ref["cell_id"], "tolerance": tol, "ok": diff is not None and diff <= tol}
    else:
        metrics["parity_max_rel_diff"] = None
        metrics["parity"] = {"reference": None, "tolerance": tol, "ok": None,
                             "reason": "n/a: no single-device reference with the same global batch in this run"}
    return make_record(run_id=run_id, cell_id=cell.cell_id, status="ok", config=cfg, env=res["env"],
                       degrees=res["degrees"], workload=res["workload"], metrics=metrics, samples=res["samples"],
                       predicted=predicted)


def calibration_record(run_id: str, device_kind: str, samples: int = 15) -> dict:
    """A fixed reference workload timed in the same run, for ``harness compare --normalize calibration``."""
    import torch

    from harness.measure.timer import StepTimer

    dev = "cuda" if device_kind == "cuda" else "cpu"
    n = 2048 if device_kind == "cuda" else 384
    a = torch.randn(n, n, device=dev)
    b = torch.randn(n, n, device=dev)
    timer = StepTimer(device_kind)
    times = []
    for i in range(samples + 2):
        timer.start()
        for _ in range(4):
            a @ b
        t = timer.stop()
        if i >= 2:
            times.append(t)
    env = capture(device_kind)
    cfg = {"workload": f"matmul fp32 {n}x{n} x4", "device_kind": device_kind, "tokens_per_step": 1,
           "threads": torch.get_num_threads()}
    return make_record(run_id=run_id, cell_id="calibration", status="ok", config=cfg, env=env, degrees=None,
                       workload={"name": cfg["workload"]}, kind="calibration",
                       metrics={"tokens_per_step": 1}, samples={"step_time_s": times})


SWEEP_ARGS_FILE = "sweep_args.json"
"""A run's sweep flags, so that ``harness bench --resume DIR`` alone re-plans the same cells."""


def sweep_arg_values(args: argparse.Namespace) -> dict:
    """The sweep-matrix flags (those of ``harness.cli.add_sweep_args``) that are set in ``args``."""
    from harness.cli import add_sweep_args

    parser = argparse.ArgumentParser(add_help=False)
    add_sweep_args(parser)
    return {a.dest: getattr(args, a.dest) for a in parser._actions if getattr(args, a.dest, None) is not None}


def save_sweep_args(out: Path, args: argparse.Namespace) -> None:
    values = {k: str(Path(v).resolve()) if isinstance(v, Path) else v for k, v in sweep_arg_values(args).items()}
    write_json_atomic(out / SWEEP_ARGS_FILE, values)


def restore_sweep_args(out: Path, args: argparse.Namespace) -> None:
    """Fill the sweep flags not given on this command line from the run's recorded ones (CLI wins)."""
    path = out / SWEEP_ARGS_FILE
    if not path.exists():
        return  # not a run directory, or one from before flags were recorded: the CLI flags alone
    try:
        recorded = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"{path} is unreadable ({e}); give the sweep flags again with --resume {out}") from None
    for key, value in recorded.items():
        if getattr(args, key, None) is None:
            setattr(args, key, Path(value) if key == "sweep" else value)


def start_run(out: Path | None, resume: Path | None, node_rank: int) -> tuple[Path, str, bool]:
    if resume is not None:
        recs = load_existing(resume) if (resume / "records.jsonl").exists() else []
        run_id = recs[0]["run_id"] if recs else new_run_id()
        return prepare_out(resume, True, node_rank), run_id, True
    run_id = new_run_id()
    out = out or Path("results") / run_id
    return prepare_out(out, False, node_rank), run_id, False

