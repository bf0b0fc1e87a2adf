"""``harness diff A B``: every metric of every cell of two runs, and where the step time went."""

from __future__ import annotations

import argparse
import sys

from harness.cli.arg_values import path_arg
from harness.compare.run_diff import diff_markdown, diff_runs
from harness.compare.stats import CompareOptions
from harness.records.atomic import write_text_atomic
from harness.records.reader import load_run, resolve_records_path


def cmd_diff(args: argparse.Namespace) -> int:
    a_path, b_path = resolve_records_path(args.a), resolve_records_path(args.b)
    opts = CompareOptions(threshold=args.threshold, alpha=args.alpha, n_bootstrap=args.bootstrap, seed=args.seed)
    a_records, b_records = load_run(a_path), load_run(b_path)
    diff = diff_runs(a_records, b_records, opts, a_label=str(args.a), b_label=str(args.b))
    markdown = diff_markdown(diff, str(args.a), str(args.b), a_records, b_records)
    out = args.out if args.out is not None else b_path.parent / "diff.md"
    write_text_atomic(out, markdown)
    sys.stdout.write(markdown)
    print(f"\ndiff: {out}")
    return 0


def register(sub) -> None:
    d = sub.add_parser("diff", help="A against B, cell by cell: throughput statistics, every metric, step composition")
    d.add_argument("a", type=path_arg, help="run directory or records.jsonl (the reference)")
    d.add_argument("b", type=path_arg, help="run directory or records.jsonl (the one explained)")
    d.add_argument("--out", type=path_arg, default=None, help="markdown file (default: diff.md in B's run directory)")
    d.add_argument("--threshold", type=float, default=0.05, help="relative throughput change that matters")
    d.add_argument("--alpha", type=float, default=0.05, help="Mann-Whitney U significance level")
    d.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples for the ratio CI")
    d.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    d.set_defaults(fn=cmd_diff)
