"""``harness trace``: one cell under Nsight Systems (one report per rank), or torch.profiler without nsys."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from harness.cli.args import add_sweep_args, device_line, spec_from_args
from harness.errors import UsageError
from harness.jobs import sigterm_as_interrupt
from harness.measure import nsys as nsys_mod
from harness.planner import expand
from harness.run.launch import Rendezvous
from harness.run.rundir import start_run
from harness.run.sweep import SweepOptions, run_sweep


def _pick(cells, cell_id: str | None):
    valid = [c for c in cells if c.valid]
    if cell_id is None:
        if not valid:
            raise UsageError("no valid cell in this sweep to trace; check `harness plan` with the same flags")
        multi = [c for c in valid if c.config.world_size > 1]
        return (multi or valid)[0]
    for c in cells:
        if c.cell_id == cell_id:
            if not c.valid:
                raise UsageError(f"--cell {cell_id} is invalid: {c.reason}")
            return c
    ids = ", ".join(c.cell_id for c in valid[:8])
    raise UsageError(f"--cell {cell_id!r} is not in this sweep; valid cells: {ids} (match --gpus/--sizes/...)")


def cmd_trace(args) -> int:
    spec = spec_from_args(args)
    cell = _pick(expand(replace(spec, reference=False)), args.cell)
    run = start_run(args.out, None, 0)
    try:
        with sigterm_as_interrupt():
            return _trace(args, spec, cell, run.out, run.run_id)
    finally:
        run.lock.release()


def _trace(args, spec, cell, out: Path, run_id: str) -> int:
    print(device_line(spec))
    nsys = nsys_mod.nsys_available() if spec.device_kind == "cuda" else None
    prefix = None
    if nsys is not None:
        nsys_dir = out / "cells" / cell.cell_id / "nsys"
        prefix = [sys.executable, "-m", "harness.measure.nsys", "--nsys", nsys, "--out-dir", str(nsys_dir),
                  "--gpu-metrics-devices", "all", "--"]
        example = nsys_mod.nsys_command(nsys, nsys_dir, ["python", "-m", "harness.run.worker", "..."], "all", True)
        print("nsys per rank (local rank 0 also samples GPU metrics):\n  " + nsys_mod.format_command(example))
    else:
        why = "no CUDA device in use" if spec.device_kind != "cuda" else "nsys not found on PATH or /opt/nvidia"
        print(f"n/a: Nsight Systems trace ({why}); writing torch.profiler traces instead")
        cell = replace(cell, config=replace(cell.config, profile=True))
    opts = SweepOptions(out=out, run_id=run_id, cell_timeout_s=args.cell_timeout, rdzv=Rendezvous())
    records = run_sweep([cell], opts, spec.device_kind, worker_prefix=prefix)
    rec = records[0]
    cell_dir = out / "cells" / cell.cell_id
    if rec["status"] != "ok":
        print(f"{cell.cell_id}: {rec['status']}: {rec.get('error')}", file=sys.stderr)
        return 1
    if nsys is not None:
        for report in sorted((cell_dir / "nsys").glob("*.nsys-rep")):
            for cmd in nsys_mod.nsys_stats_commands(nsys, report, cell_dir / "nsys" / report.stem):
                print("  " + nsys_mod.format_command(cmd))
                subprocess.run(cmd, check=False)
        print(f"Nsight Systems reports: {cell_dir / 'nsys'} (open *.nsys-rep in nsys-ui)")
    else:
        traces = sorted((cell_dir / "traces").glob("*.json.gz"))
        print(f"torch.profiler traces ({len(traces)}): {cell_dir / 'traces'} (open in Perfetto or chrome://tracing)")
        trace = rec["metrics"].get("trace") or {}
        if trace:
            print("trace analysis: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                  for k, v in trace.items() if not isinstance(v, (dict, list))))
    return 0


def register(sub) -> None:
    t = sub.add_parser("trace", help="one cell under nsys (per-rank reports) or torch.profiler without nsys")
    add_sweep_args(t)
    t.add_argument("--cell", help="cell id to trace (default: the first multi-device cell of the sweep)")
    t.add_argument("--out", type=Path, help="run directory (default results/<run-id>)")
    t.add_argument("--cell-timeout", type=float)
    t.set_defaults(fn=cmd_trace)

