"""Run a planned sweep: one job per cell, one record per cell, nothing measured ever lost.

Records are appended (flush + fsync, a torn tail set aside first) as each cell finishes; a cell
interrupted by Ctrl-C or SIGTERM gets no record. ``--resume DIR`` runs only the cells whose
latest record is neither ``ok`` nor ``invalid``: the latest record of a cell wins, and earlier
attempts stay in the file. Parity is computed as records land, against the group's
single-device reference, which the planner orders first. Each record carries the prediction
the planner attached to its cell.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from harness.measure.machine_probe import machine_probe_s
from harness.planner import PlannedCell
from harness.precision import PrecisionPlan
from harness.records.env import capture
from harness.records.reader import RECORDS_FILENAME, append_record, latest_per_cell
from harness.records.record import make_record, pulled_levers
from harness.run import batch_search, claims
from harness.run.batch_search import BatchSearch
from harness.run.fork_client import ForkServer
from harness.run.launch import Outcome, Rendezvous, run_cell_job
from harness.run.nsys_capture import NsysTool, captured_job
from harness.run.parity import parity_key
from harness.run.progress import Progress
from harness.run.record_metrics import RunFacts, cell_metrics, run_metrics
from harness.run.rounds import RoundsPlan, RoundState, round_order
from harness.run.rounds import summary as rounds_summary
from harness.run.rundir import existing_records
from harness.spec import CellConfig
from harness.text import first_line


def default_timeout_s(cfg) -> float:
    """Generous for the slowest expected step, so a healthy cell is never cut off."""
    per_step = 6.0 if cfg.device_kind == "cpu" else 3.0
    return 240.0 + per_step * (cfg.warmup + cfg.steps) * max(1, cfg.world_size // 2)


@dataclass
class SweepOptions:
    out: Path
    run_id: str
    cell_timeout_s: float | None = None
    stall_timeout_s: float | None = None
    """A rank that finishes no measured step for this long ends its cell as ``timeout`` (None: off)."""
    rdzv: Rendezvous = Rendezvous()
    resume: bool = False
    launcher: str = "fork"
    """How a cell's ranks start on one node (:data:`harness.run.launch.LAUNCHERS`)."""
    nsys: NsysTool | None = None
    """Every cell's ranks under this Nsight Systems, the reports checked (``bench --nsys``, ``trace``)."""
    rounds: RoundsPlan = RoundsPlan()
    """``--rounds N``: every cell once per round, its record from its median round (:mod:`harness.run.rounds`)."""


def run_sweep(cells: list[PlannedCell], opts: SweepOptions, device_kind: str, env_extra: dict | None = None,
              progress: Progress | None = None,
              replan: Callable[[PlannedCell], PlannedCell] | None = None,
              note: Callable[[dict], str | None] | None = None) -> list[dict]:
    """Run every valid cell not already ``ok``; return the records written in this call.

    ``note`` says, after each record, what it must not hide (a step far from its prediction names
    the calibration entry the prediction came from); the sweep prints what it returns.

    ``replan`` re-attaches the prediction of a cell whose batch ``--batch auto`` just found (the
    sweep never predicts itself); without it such a cell keeps the planned prediction. With
    ``opts.rounds.n > 1`` every cell runs once per round (:func:`_run_rounds`)."""
    writer = opts.rdzv.node_rank == 0
    existing = existing_records(opts.out) if opts.resume else []
    done = finished_cells(existing)
    references: dict = {}
    for r in latest_per_cell(existing)[0]:
        _keep_reference(references, r)
    env = capture(device_kind)
    todo = {c.cell_id for c in cells_to_run(cells, done, writer)}
    state = RoundState.open(opts.out, opts.rounds, opts.resume) if opts.rounds.n > 1 else None
    if progress is None:
        total = len(todo) if state is None else sum(  # with rounds: every cell's rounds left, then its record
            1 if not c.valid else opts.rounds.n + 1 - len(state.rounds_of(c.cell_id)) for c in cells if c.cell_id in todo)
        progress = Progress(total=total, stream=sys.stdout)
    written: list[dict] = []
    records_path = opts.out / RECORDS_FILENAME

    def keep(rec: dict, label: str) -> None:
        if writer:
            side = append_record(records_path, rec)
            if side is not None:
                print(f"{records_path}: its torn last line was moved to {side}", file=sys.stderr, flush=True)
        written.append(rec)
        progress.finish(label, rec["status"], _progress_note(rec))
        said = note(rec) if note is not None else None
        if said:
            print(said, file=sys.stderr, flush=True)

    # One fork server per sweep (started by the first cell that needs it), killed with everything it
    # started whatever ends the sweep: Ctrl-C, SIGTERM, an error.
    # (not under nsys: nsys goes in front of torchrun, see harness.run.nsys_capture)
    server = ForkServer(opts.out, env_extra) if opts.launcher == "fork" and opts.nsys is None else None
    run = _CellRun(opts, device_kind, server, env_extra, replan)
    try:
        for index, cell in enumerate(cells):
            if cell.cell_id not in todo or (cell.valid and state is not None):
                continue
            progress.start(cell.cell_id)
            if not cell.valid:
                rec = make_record(run_id=opts.run_id, cell_id=cell.cell_id, status="invalid", config=cell.raw,
                                  env=env, degrees=None, workload=None, error=cell.reason)
            else:
                cell, outcome, facts = run(cell, index, opts.out / "cells" / cell.cell_id if writer
                                           else opts.out / f"node{opts.rdzv.node_rank}" / cell.cell_id)
                rec = _record(cell, outcome, facts, opts.run_id, env, references)
                _keep_reference(references, rec)
            keep(rec, cell.cell_id)
        if state is not None:
            _run_rounds([c for c in cells if c.cell_id in todo and c.valid], cells, state, run, env, references, keep,
                        progress)
    finally:
        if server is not None:
            server.close()
    progress.close()
    return written


class _CellRun:
    """One job of a valid cell (or its batch search's trials), the machine probed around it."""

    def __init__(self, opts: SweepOptions, device_kind: str, server: ForkServer | None, env_extra: dict | None,
                 replan: Callable[[PlannedCell], PlannedCell] | None) -> None:
        self.opts, self.device_kind, self.server = opts, device_kind, server
        self.env_extra, self.replan = env_extra, replan

    def job(self, cfg: CellConfig, where: Path, rdzv_id: str, prefix: list[str] | None = None,
            env: dict[str, str] | None = None, capture_over: Callable[[], bool] | None = None) -> Outcome:
        opts = self.opts
        return run_cell_job(cfg, where, opts.cell_timeout_s or default_timeout_s(cfg), opts.rdzv,
                            rdzv_id=rdzv_id, env_extra={**(self.env_extra or {}), **(env or {})},
                            launcher_prefix=prefix, stall_timeout_s=opts.stall_timeout_s, server=self.server,
                            capture_over=capture_over)

    def __call__(self, cell: PlannedCell, index: int, cell_dir: Path,
                 round_index: int | None = None) -> tuple[PlannedCell, Outcome, RunFacts]:
        opts, device_kind = self.opts, self.device_kind
        rdzv_id = _rdzv_id(opts, index) + (f"-r{round_index}" if round_index is not None else "")
        found, outcome, nsys = None, None, None
        probe = machine_probe_s(device_kind) if device_kind == "cpu" else None  # the machine's speed around the cell
        cfg = cell.config
        assert cfg is not None, f"valid cell {cell.cell_id} has no config"
        if cfg.batch_auto:
            trials = cell_dir / "batch-trials"
            cell, found, outcome = _search_batch(cell, lambda cfg, name: self.job(
                cfg, trials / name, f"{rdzv_id}-{name}"), self.replan)
        if outcome is None and opts.nsys is not None:
            outcome, nsys = captured_job(opts.nsys, lambda attempt: self.job(
                cfg, attempt.where, rdzv_id, attempt.prefix, attempt.env, attempt.over),
                cell, cell_dir, device_kind, opts.rdzv.node_rank)
            if nsys["problem"]:
                print(f"{cell.cell_id}: nsys capture: {nsys['problem']}", file=sys.stderr, flush=True)
        if outcome is None:  # no batch search ran: cell is still the planned one, cfg its config
            outcome = self.job(cfg, cell_dir, rdzv_id)
        facts = RunFacts(wall_s=outcome.wall_s, est_mem_gib=cell.est_mem_gib, started_at=outcome.started_at,
                         batch_search=found.as_dict() if found is not None else None,
                         machine_probe_s={"before": probe, "after": machine_probe_s(device_kind)}
                         if probe is not None else None, nsys=nsys)
        return cell, outcome, facts


def _run_rounds(valid: list[PlannedCell], cells: list[PlannedCell], state: RoundState, run: _CellRun, env: dict,
                references: dict, keep: Callable[[dict, str], None], progress: Progress) -> None:
    """Every cell once per round, in the round's order; a cell that fails is recorded at once and runs no
    more rounds; the others are recorded after the last round, in plan order (the parity reference first),
    each from its median round."""
    opts, n = run.opts, state.plan.n
    by_id = {c.cell_id: c for c in valid}
    index_of = {c.cell_id: i for i, c in enumerate(cells)}
    writer = opts.rdzv.node_rank == 0
    base = (opts.out / "cells") if writer else (opts.out / f"node{opts.rdzv.node_rank}")
    for k in range(n):
        for cid in round_order(list(by_id), k, state.plan):
            if state.has(cid, k) or state.failed(cid):
                continue
            label = f"{cid} round {k + 1}/{n}"
            progress.start(label)
            cell, outcome, facts = run(by_id[cid], index_of[cid], base / cid / f"round{k + 1}", k)
            state.add(cid, k, _round_facts(outcome, facts))
            if outcome.status != "ok":
                keep(_record(cell, outcome, facts, opts.run_id, env, references), label)
            else:
                progress.finish(label, "ok", f"median {_median_s(outcome) * 1e3:,.1f} ms")
    for cell in valid:
        if state.failed(cell.cell_id):
            continue
        rec = _median_round_record(cell, state, base / cell.cell_id, opts.run_id, env, references)
        _keep_reference(references, rec)
        keep(rec, cell.cell_id)


def _median_s(outcome: Outcome) -> float:
    return float(outcome.result["metrics"]["step_time_s"]["median"]) if outcome.result else float("nan")


def _round_facts(outcome: Outcome, facts: RunFacts) -> dict:
    """What ``rounds.json`` keeps of one round: enough to rebuild the record from the round's result.json."""
    return {"status": outcome.status, "error": outcome.error, "returncode": outcome.returncode,
            "median_s": _median_s(outcome) if outcome.status == "ok" else None, "wall_s": outcome.wall_s,
            "started_at": outcome.started_at, "machine_probe_s": facts.machine_probe_s}


def _median_round_record(cell: PlannedCell, state: RoundState, cell_dir: Path, run_id: str, env: dict,
                         references: dict) -> dict:
    """The cell's record from its median round, with every round's median and the spread in ``metrics.rounds``."""
    rounds = state.rounds_of(cell.cell_id)
    info = rounds_summary([r["median_s"] for r in rounds.values()], state.plan)
    k = list(rounds)[info.pop("chosen")]
    chosen = rounds[k]
    result_path = cell_dir / f"round{k + 1}" / "result.json"
    result = json.loads(result_path.read_text()) if result_path.exists() else None
    outcome = Outcome("ok" if result is not None else "crashed",
                      None if result is not None else f"round {k + 1}'s result is gone from {result_path}", result,
                      chosen["returncode"], chosen["wall_s"], chosen["started_at"])
    facts = RunFacts(wall_s=chosen["wall_s"], est_mem_gib=cell.est_mem_gib, started_at=chosen["started_at"],
                     machine_probe_s=chosen["machine_probe_s"],
                     rounds={**info, "chosen_round": k + 1,
                             "machine_probe_s": [r["machine_probe_s"] for r in rounds.values()],
                             "wall_s": [r["wall_s"] for r in rounds.values()]})
    return _record(cell, outcome, facts, run_id, env, references)


def _search_batch(cell: PlannedCell, trial: Callable[[CellConfig, str], Outcome],
                  replan: Callable[[PlannedCell], PlannedCell] | None) -> tuple[PlannedCell, BatchSearch, Outcome]:
    """``--batch auto``: the cell at the largest batch that fit, the search, and the cell's outcome:
    the trial at the batch found, or the one that ended the search (crashed, timed out, nothing fit).
    The cell's config is that trial's: the record names the batch that was run, not the plan's placeholder."""
    cfg = cell.config
    assert cfg is not None, f"valid cell {cell.cell_id} has no config"
    try:
        found = batch_search.search(cfg, trial)
    except batch_search.TrialFailed as e:
        failed = replace(cell, config=batch_search.trial_config(cfg, e.rows))
        return failed, BatchSearch(None, e.trials), replace(e.outcome, error=str(e))
    if found.rows_per_rank is None:
        cell = replace(cell, config=batch_search.trial_config(cfg, batch_search.split_of(cfg)))
        return cell, found, Outcome(status="oom", error=f"batch auto: not even {batch_search.split_of(cfg)} "
                                    f"sequences per rank fit", result=None, returncode=None,
                                    wall_s=sum(t["wall_s"] for t in found.trials))
    cell = replace(cell, config=batch_search.trial_config(cfg, found.rows_per_rank))
    assert found.outcome is not None, "a batch that fit has its trial's outcome"
    return (replan(cell) if replan else cell), found, found.outcome


def finished_cells(existing: list[dict]) -> set[str]:
    """Cells a resume leaves alone: their latest record is ``ok``, or ``invalid`` (nothing to run)."""
    return {r["cell_id"] for r in latest_per_cell(existing)[0]
            if r.get("kind", "cell") == "cell" and r.get("status") in ("ok", "invalid")}


def cells_to_run(cells: list[PlannedCell], done: set[str], writer: bool = True) -> list[PlannedCell]:
    """The cells this node runs (or records as invalid): not finished, and not one-node cells
    on a node other than 0 (the single-device reference runs on node 0 only)."""
    return [c for c in cells if c.cell_id not in done
            and not (not writer and c.valid and c.config is not None and c.config.nnodes == 1)]


def _rdzv_id(opts: SweepOptions, index: int) -> str:
    """Nodes of a multi-node sweep share no run id, but they walk the cells in the same order."""
    return f"harness-cell{index}" if opts.rdzv.nnodes > 1 else f"{opts.run_id}-{index}"


def _keep_reference(references: dict, rec: dict) -> None:
    """An ok single-device record becomes its group's parity reference; the eager one (no lever
    pulled) is kept over a compiled or checkpointed one, which is then checked against it."""
    if rec.get("status") != "ok" or rec["config"].get("strategy") != "single" or rec["config"].get("precision") == "fp8":
        return  # an fp8 cell is checked against bf16's reference, never one itself
    key = parity_key(rec["config"])
    held = references.get(key)
    if held is None or pulled_levers(held["config"]) or not pulled_levers(rec["config"]):
        references[key] = rec


def _progress_note(rec: dict) -> str:
    """What the progress line says after a cell's status: its throughput, or its error's first line."""
    if rec["status"] != "ok":
        return first_line(rec.get("error"), limit=200) if rec.get("error") else ""
    m = rec["metrics"]
    tps = m.get("tokens_per_s_per_device")
    return f"{tps:,.0f} tok/s/dev" if tps else ""


def _record(cell: PlannedCell, outcome: Outcome, facts: RunFacts, run_id: str, env: dict, references: dict) -> dict:
    assert cell.config is not None, f"cell {cell.cell_id} ran without a config"
    cfg = cell.config.to_dict()
    if outcome.status != "ok" or outcome.result is None:
        return make_record(run_id=run_id, cell_id=cell.cell_id, status=outcome.status, config=cfg, env=env,
                           degrees=None, workload=None, error=outcome.error, predicted=cell.predicted,
                           metrics=run_metrics(facts))
    res = outcome.result
    metrics = cell_metrics(cell.cell_id, cfg, res["metrics"], res["samples"], facts,
                           calibrated_tflops=cell.calibrated_tflops, device_name=res["env"]["device_name"],
                           compute_dtype=PrecisionPlan(cell.config.precision).compute_dtype,
                           reference=references.get(parity_key(cfg)), predicted=cell.predicted)
    metrics["claims"] = claims.judge(cell.config, res["metrics"])
    lie = claims.contradicted(metrics["claims"])
    return make_record(run_id=run_id, cell_id=cell.cell_id, status="ok" if lie is None else "contradicted",
                       config=cfg, env=res["env"], degrees=res["degrees"], workload=res["workload"], metrics=metrics,
                       samples=res["samples"], predicted=cell.predicted, error=lie)
