"""``harness trace``: one cell under Nsight Systems (one report per node, every rank a process row, read
back and checked), or torch.profiler without nsys."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from harness.cli.arg_values import path_arg
from harness.cli.args import add_sweep_args, device_line, spec_from_args
from harness.errors import UsageError
from harness.jobs import sigterm_as_interrupt
from harness.measure import nsys as nsys_mod
from harness.measure import nsys_reports
from harness.planner import expand
from harness.run.launch import Rendezvous
from harness.run.nsys_capture import REPORT_WAIT_S, NsysTool, check_report_wait, nsys_tool
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
    tool = _tool(args.tracer, spec, args.nsys_wait)  # bad input is refused before the run directory exists
    run = start_run(args.out, None, 0)
    try:
        with sigterm_as_interrupt():
            return _trace(args, spec, cell, tool, run.out, run.run_id)
    finally:
        run.lock.release()


def _tool(choice: str, spec, report_wait_s: float):
    """The nsys to capture with (None: torch.profiler); nsys asked for and absent is a UsageError."""
    if choice == "torch":
        return None
    if choice == "nsys":
        return nsys_tool(spec, report_wait_s)
    check_report_wait(report_wait_s)
    tool = NsysTool.find(report_wait_s)
    if tool is None:
        print(f"{nsys_mod.NO_NSYS}; writing torch.profiler traces instead (--tracer torch says so up front)")
    elif not spec.nvtx:
        print("--nvtx off: writing torch.profiler traces (an nsys capture needs the NVTX ranges)")
        return None
    return tool


def _trace(args, spec, cell, tool, out: Path, run_id: str) -> int:
    print(device_line(spec))
    if tool is not None:
        print(f"Nsight Systems: {tool.version} ({tool.path}), one report per node, every rank a process row")
    else:
        cell = replace(cell, config=replace(cell.config, profile=True))
    opts = SweepOptions(out=out, run_id=run_id, cell_timeout_s=args.cell_timeout, rdzv=Rendezvous(), nsys=tool)
    records = run_sweep([cell], opts, spec.device_kind)
    rec = records[0]
    cell_dir = out / "cells" / cell.cell_id
    if rec["status"] != "ok":
        print(f"{cell.cell_id}: {rec['status']}: {rec.get('error')}", file=sys.stderr)
        return 1
    if tool is not None:
        return _print_capture(tool, rec["metrics"]["nsys"])
    traces = sorted((cell_dir / "traces").glob("*.json.gz"))
    print(f"torch.profiler traces ({len(traces)}): {cell_dir / 'traces'} (open in Perfetto or chrome://tracing)")
    trace = rec["metrics"].get("trace") or {}
    if trace:
        print("trace analysis: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                              for k, v in trace.items() if not isinstance(v, (dict, list))))
    return 0


def _print_capture(tool, nsys: dict) -> int:
    """Each rank's ranges as read back, nsys stats' own NVTX summary, and how to open the report."""
    report = Path(nsys["report"])
    for r in nsys["ranks"]:
        phases = ", ".join(f"{k} {v['count']}" for k, v in (r.get("phases") or {}).items())
        print(f"rank {r['rank']}: {r.get('steps_in_window', 0)} step ranges in the measured window "
              f"({nsys['measured_steps']} steps run); {phases or 'no ranges'}")
    names = nsys_reports.stats_report_names(tool.path)
    if report.exists() and "nvtx" in names:
        cmd = nsys_reports.stats_command(tool.path, names["nvtx"], report)
        print("$ " + nsys_mod.format_command(cmd), flush=True)
        subprocess.run(cmd, check=False, timeout=300)
    for k, a in enumerate(nsys.get("attempts", [])):
        if a["hung"]:
            print(f"capture {k + 1}: nsys made no progress on its report; ended it {a['report_wait_s']:g} s after rank 0 "
                  "was done" + (", captured once more" if k + 1 < len(nsys["attempts"]) else ""))
    if nsys["processes_ended_after"]:
        print(f"ended {nsys['processes_ended_after']} nsys process(es) still running after the capture")
    print(f"Nsight Systems report (every rank of the node, a process row each): {report}")
    print("open it: " + nsys_mod.format_command(["nsys-ui", str(report)]))
    if nsys["problem"]:
        print(f"error: {nsys['problem']}", file=sys.stderr)
        return 1
    return 0


def register(sub) -> None:
    t = sub.add_parser("trace", help="one cell under nsys (per-rank reports) or torch.profiler without nsys")
    add_sweep_args(t)
    t.add_argument("--cell", help="cell id to trace (default: the first multi-device cell of the sweep)")
    t.add_argument("--out", type=path_arg, help="run directory (default results/<run-id>)")
    t.add_argument("--cell-timeout", type=float)
    t.add_argument("--nsys-wait", type=float, default=REPORT_WAIT_S, metavar="SECONDS",
                   help="how long a capture may go without progress (no importer, no nsys I/O) once rank 0 is done; "
                        f"past it the capture is ended and taken once more (default {REPORT_WAIT_S:g})")
    t.add_argument("--tracer", choices=("auto", "nsys", "torch"), default="auto",
                   help="nsys: one Nsight Systems report per node (a process row per rank), checked; torch: torch.profiler traces; "
                        "auto (default): nsys when installed, else torch.profiler")
    t.set_defaults(fn=cmd_trace)

