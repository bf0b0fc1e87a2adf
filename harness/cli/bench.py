"""``harness bench``: plan, calibrate what the model needs, run every cell, write the report."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from harness.calibration import store
from harness.calibration.auto import ensure_calibrated
from harness.calibration.normaliser import calibration_record
from harness.calibration.provenance import misprediction_note
from harness.cli.arg_values import int_arg, path_arg
from harness.cli.args import add_sweep_args, device_line, spec_from_args, sweep_arg_values
from harness.errors import UsageError
from harness.jobs import Terminated, sigterm_as_interrupt
from harness.planner import PlannedCell, expand, predict_cells
from harness.records.reader import RECORDS_FILENAME, append_record
from harness.report import write_report
from harness.run.launch import LAUNCHERS, Rendezvous
from harness.run.nsys_capture import REPORT_WAIT_S, nsys_tool
from harness.run.resume import check_same_training
from harness.run.rounds import ORDERS, RoundsPlan, recorded_rounds
from harness.run.rundir import (
    check_resumable,
    check_same_sweep,
    existing_records,
    holds_records,
    recorded_sweep_args,
    save_sweep_args,
    start_run,
)
from harness.run.sweep import SweepOptions, cells_to_run, finished_cells, run_sweep


def check_valid_any(cells: list[PlannedCell]) -> None:
    """Nothing is launched when no cell the user asked for is valid (the parity reference doesn't count)."""
    asked = [c for c in cells if not c.reference_only]
    if not asked:
        raise UsageError("the sweep plans no cell (every combination of its flags was left out); check it with "
                         "harness plan and the same flags")
    if not any(c.valid for c in asked):
        by_reason: dict[str | None, list[str]] = {}
        for c in asked:
            by_reason.setdefault(c.reason, []).append(c.cell_id)
        if len(asked) == 1:
            raise UsageError(asked[0].reason)
        raise UsageError("no valid cell to run: " + "; ".join(
            f"{ids[0] if len(ids) == 1 else f'{len(ids)} cells ({ids[0]}, ...)'}: {reason}"
            for reason, ids in by_reason.items()))


def _restore_sweep_args(out: Path, args: argparse.Namespace) -> None:
    """Fill the sweep flags not given on this command line from the run's recorded ones (CLI wins)."""
    for key, value in recorded_sweep_args(out).items():
        if getattr(args, key, None) is None:
            setattr(args, key, Path(value) if key == "sweep" else value)


def _calibration_store(out: Path) -> None:
    """A calibration store that cannot be written falls back to the run directory, said in one line."""
    why = store.unwritable(store.default_path())
    if why is None:
        return
    fallback = out / "calibration.json"
    print(f"calibration store {store.default_path()} is not writable ({why}); using {fallback} for this run "
          f"(set HARNESS_CALIBRATION to a writable file to keep calibrations across runs)", flush=True)
    os.environ[store.ENV] = str(fallback)  # the calibration children inherit it


def _or_resume(args: argparse.Namespace) -> None:
    """``--out DIR --or-resume``: start DIR, or finish it when it holds this same sweep (a requeued job)."""
    if args.resume is not None:
        raise UsageError(f"--or-resume with --resume {args.resume}: --resume already finishes a run; drop --or-resume")
    if args.out is None:
        raise UsageError("--or-resume needs --out DIR: the directory a restarted job finishes")
    if holds_records(args.out):
        check_same_sweep(args.out, sweep_arg_values(args))
        args.resume = args.out
        print(f"--or-resume: {args.out} holds this sweep's records; finishing it", flush=True)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.or_resume:
        _or_resume(args)
    if args.resume is not None:
        if not args.or_resume:  # --or-resume checked the sweep its own way (the same flags, given again)
            check_resumable(args.resume, sweep_arg_values(args))
        _restore_sweep_args(args.resume, args)  # `--resume DIR` alone re-plans the run's cells; flags given win
    spec = spec_from_args(args)
    if args.node_rank is not None and not 0 <= args.node_rank < spec.nnodes:
        raise UsageError(f"--node-rank {args.node_rank} must be in [0, {spec.nnodes - 1}] for --nnodes {spec.nnodes}")
    if spec.nnodes > 1 and not args.rdzv_endpoint:
        raise UsageError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the node-rank-0 machine)")
    cells = expand(spec)
    if args.resume is None:
        check_valid_any(cells)
    if spec.restore_from is not None:
        check_same_training(Path(spec.restore_from), [c.config.to_dict() for c in cells if c.config is not None])
    for flag, value in (("--cell-timeout", args.cell_timeout), ("--stall-timeout", args.stall_timeout)):
        if value is not None and value <= 0:
            raise UsageError(f"{flag} {value:g}: must be > 0 seconds")
    plan = _rounds_plan(args, spec)
    if args.recalibrate and args.no_calibrate:
        raise UsageError("--recalibrate with --no-calibrate: one measures every calibration again, the other none; "
                         "drop one of them")
    if args.nsys and spec.batch_auto:
        raise UsageError("--nsys with --batch auto: a capture covers one job per cell and the batch search runs "
                         "several; pass a --batch")
    tool = nsys_tool(spec, args.nsys_wait) if args.nsys else None
    node_rank = args.node_rank or 0
    run = start_run(args.out, args.resume, node_rank)
    try:
        with sigterm_as_interrupt():
            return _bench(args, spec, cells, run, node_rank, tool, plan)
    finally:
        run.lock.release()


def _rounds_plan(args: argparse.Namespace, spec) -> RoundsPlan:
    """``--rounds``/``--round-order``, or on ``--resume`` without them the run's own (its rounds.json)."""
    held = recorded_rounds(args.resume) if args.resume is not None else None
    n = int_arg("--rounds", args.rounds, 1) if args.rounds is not None else (held.n if held else 1)
    plan = RoundsPlan(n=n, order=args.round_order or (held.order if held else "shuffle"), seed=spec.seed)
    if plan.n > 1 and args.nsys:
        raise UsageError(f"--rounds {plan.n} with --nsys: a capture covers one job per cell; capture with --rounds 1")
    if plan.n > 1 and spec.batch_auto:
        raise UsageError(f"--rounds {plan.n} with --batch auto: the batch search runs once; find the batch with "
                         f"--rounds 1, then pass it as --batch")
    return plan


def _bench(args: argparse.Namespace, spec, cells: list[PlannedCell], run, node_rank: int, tool,
           plan: RoundsPlan) -> int:
    out = run.out
    if node_rank == 0 and not run.resume:
        save_sweep_args(out, sweep_arg_values(args))
    todo = cells_to_run(cells, finished_cells(existing_records(out)) if run.resume else set(), node_rank == 0)
    print(device_line(spec), flush=True)
    rounds = f" x {plan.n} rounds ({plan.order}, seed {plan.seed})" if plan.n > 1 else ""
    who = f"run {run.run_id}" if node_rank == 0 else f"node {node_rank}"  # node 0 names the run and writes it
    print(f"{who}: {sum(c.valid for c in todo)} cells to run{rounds}, {sum(not c.valid for c in todo)} "
          f"invalid -> {out}", flush=True)
    rdzv = Rendezvous(nnodes=spec.nnodes, node_rank=node_rank, endpoint=args.rdzv_endpoint)
    opts = SweepOptions(out=out, run_id=run.run_id, cell_timeout_s=args.cell_timeout,
                        stall_timeout_s=args.stall_timeout, rdzv=rdzv, resume=run.resume,
                        launcher=args.launcher, nsys=tool, rounds=plan)
    disk = None  # the run directory's storage entry, where cells checkpoint and calibration runs
    try:
        if node_rank == 0:
            if not args.no_calibrate:
                _calibration_store(out)
                disk = ensure_calibrated(spec, [c for c in todo if c.valid], force=args.recalibrate, run_dir=out)
                cells = predict_cells(cells, force=spec.force, storage=disk)  # from everything just measured
            if not run.resume:
                append_record(out / RECORDS_FILENAME, calibration_record(run.run_id, spec.device_kind))
        records = run_sweep(cells, opts, spec.device_kind, replan=lambda c: predict_cells([c], force=True, storage=disk)[0],
                            note=None if args.no_calibrate else lambda rec: misprediction_note(rec, store.default_path()))
    except KeyboardInterrupt as e:
        name, code = ("SIGTERM", 128 + signal.SIGTERM) if isinstance(e, Terminated) else ("Ctrl-C", 130)
        print(f"\ninterrupted ({name}): finished records are kept in {out}/{RECORDS_FILENAME}, the running cell "
              f"has none; finish with: harness bench --resume {out}", file=sys.stderr)
        return code
    if node_rank == 0:
        print(write_report(out))
        print(f"\nrecords: {out / RECORDS_FILENAME}\nsummary: {out / 'summary.md'}")
    failed = [r for r in records if r["status"] not in ("ok", "invalid")]
    untrusted = [r for r in records if (r.get("metrics", {}).get("nsys") or {}).get("problem")]
    return 1 if failed or untrusted else 0


def add_run_args(p: argparse.ArgumentParser) -> None:
    """How the cells run (not which): bench's flags that ``harness slurm`` passes on to every node."""
    p.add_argument("--cell-timeout", type=float, help="seconds per cell before it is killed (default from steps)")
    p.add_argument("--stall-timeout", type=float,
                   help="seconds a rank may go without finishing a measured step before its cell is killed as a "
                        "hang (default: off, only --cell-timeout)")
    p.add_argument("--launcher", choices=LAUNCHERS, default="fork",
                   help="fork: one process imports torch once and forks the cell's ranks (one node; default); "
                        "torchrun: torchrun starts each rank afresh (always across nodes)")
    p.add_argument("--nsys", action="store_true",
                   help="every cell under Nsight Systems: one report per node in cells/<id>/nsys (a process row "
                        "per rank), read back and checked (metrics.nsys); ranks start through torchrun")
    p.add_argument("--nsys-wait", type=float, default=REPORT_WAIT_S, metavar="SECONDS",
                   help="with --nsys: how long a capture may go without progress (no importer, no nsys I/O) once rank 0 "
                        f"is done; past it the capture is ended and taken once more (default {REPORT_WAIT_S:g})")
    p.add_argument("--rounds",
                   help="measure every cell once per round, N rounds, the order changed each round; each record is "
                        "its cell's median round, with the round-to-round spread (default 1; 5 on a shared machine)")
    p.add_argument("--round-order", choices=ORDERS,
                   help="shuffle: a seeded shuffle per round (--seed; default); rotate: the plan's order rotated by one")
    p.add_argument("--no-calibrate", action="store_true", help="skip the automatic matmul-peak calibration")
    p.add_argument("--recalibrate", action="store_true",
                   help="measure every calibration these cells need again, even if stored (and say so)")


def register(sub) -> None:
    b = sub.add_parser("bench", help="run a sweep: each cell's ranks forked by a server that imported torch once -> records, summary, plots")
    add_sweep_args(b)
    b.add_argument("--out", type=path_arg, help="run directory (default results/<run-id>); never overwritten")
    b.add_argument("--resume", type=path_arg, help="finish an interrupted run: re-run cells without an ok record")
    b.add_argument("--or-resume", action="store_true",
                   help="with --out DIR: start DIR, or finish it as --resume would when it already holds this same "
                        "sweep (same flags); another sweep there is refused. For jobs a scheduler may requeue")
    add_run_args(b)
    b.add_argument("--node-rank", type=int, help="this machine's rank in a multi-node sweep")
    b.add_argument("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous (multi-node)")
    b.set_defaults(fn=cmd_bench)
