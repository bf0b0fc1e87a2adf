"""``harness history RUN_DIR...``: throughput per cell over runs in commit order, with step detection."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import cast

from harness.cli.arg_values import path_arg
from harness.compare.run_history import Run, find_changes, history_frame, history_markdown
from harness.errors import UsageError
from harness.records.atomic import write_text_atomic
from harness.records.reader import load_run, resolve_records_path

ORDERS = ("git", "time", "given")


def _git_positions() -> dict[str, int]:
    """Commit -> position in this checkout's first-parent history, oldest first."""
    try:
        out = subprocess.run(["git", "rev-list", "--first-parent", "--reverse", "HEAD"], check=True,
                             capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise UsageError(f"--order git needs a git checkout ({exc}); use --order time") from exc
    return {sha: i for i, sha in enumerate(out.split())}


def order_runs(runs: list[Run], order: str) -> list[Run]:
    """Runs in commit order (``git``: this checkout's history; ``time``: run ids, which start with the
    run's start time), or as given; ties keep the given order."""
    if order == "given":
        return runs
    if order == "time":
        return sorted(runs, key=lambda r: r.run_id)
    positions = _git_positions()
    missing = [r.label for r in runs if r.git_sha not in positions]
    if missing:
        raise UsageError(f"--order git: commit of {', '.join(missing)} is not in this checkout's history; "
                         "fetch it or use --order time")
    # every run's commit is in positions, checked above
    return sorted(runs, key=lambda r: (positions[cast(str, r.git_sha)], r.run_id))


def cmd_history(args: argparse.Namespace) -> int:
    if len(args.runs) < 2:
        raise UsageError(f"history needs at least 2 run directories, got {len(args.runs)}")
    runs = [Run(str(p), load_run(resolve_records_path(p))) for p in args.runs]
    runs = order_runs(runs, args.order)
    frame = history_frame(runs)
    if frame.empty:
        raise UsageError("no ok cell with tokens_per_s_per_device in any run; pass run directories of harness bench")
    changes = find_changes(frame, alpha=args.alpha, min_shift=args.min_shift, seed=args.seed)
    markdown = history_markdown(frame, changes, runs, args.order, args.alpha, args.min_shift)
    args.out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out / "history.md", markdown)
    from harness.report.plot_files import save_history_plot  # noqa: PLC0415  (heavy: matplotlib only when drawing)

    plot = save_history_plot(frame, changes, args.out / "history.png")
    sys.stdout.write(markdown)
    print(f"\nhistory: {args.out / 'history.md'}" + (f", plot: {plot}" if plot else ""))
    return 0


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"{value} must be in (0, 1), e.g. 0.01")
    return value


def register(sub) -> None:
    h = sub.add_parser("history", help="throughput per cell over runs in commit order; names the run after a step")
    h.add_argument("runs", nargs="+", type=path_arg, help="run directories (or records.jsonl), any order")
    h.add_argument("--order", choices=ORDERS, default="time",
                   help="git: this checkout's first-parent history; time: run start (default); given: as listed")
    h.add_argument("--out", type=path_arg, default=Path("."), help="directory for history.md and history.png")
    h.add_argument("--alpha", type=_fraction, default=0.01, help="permutation-test significance of a step")
    h.add_argument("--min-shift", type=_fraction, default=0.05, help="smallest relative shift reported")
    h.add_argument("--seed", type=int, default=0, help="permutation and bootstrap seed")
    h.set_defaults(fn=cmd_history)
