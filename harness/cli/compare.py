"""``harness compare BASE CAND``: the regression gate (exit 0 pass, 1 regression, 2 usage, 3 n/c)."""

from __future__ import annotations

import argparse

from harness.compare.verdicts import NORMALIZE_CHOICES, run_compare


def cmd_compare(args: argparse.Namespace) -> int:
    return run_compare(str(args.base), str(args.cand), threshold=args.threshold, alpha=args.alpha,
                       normalize=args.normalize, n_bootstrap=args.bootstrap, seed=args.seed)


def register(sub) -> None:
    c = sub.add_parser("compare", help="regression gate: BASE vs CAND throughput (exit 0 pass, 1 regression, 3 n/c)")
    c.add_argument("base", help="baseline: records.jsonl, run directory or pytest-benchmark JSON")
    c.add_argument("cand", help="candidate: records.jsonl, run directory or pytest-benchmark JSON")
    c.add_argument("--threshold", type=float, default=0.05, help="relative change that matters")
    c.add_argument("--alpha", type=float, default=0.05, help="Mann-Whitney U significance level")
    c.add_argument("--normalize", choices=NORMALIZE_CHOICES, default="none",
                   help="divide each cell's throughput by the matmul workload timed around it in the "
                        "same run; a side whose timings spread over 10%% gives INCONCLUSIVE, not a change")
    c.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples for the ratio CI")
    c.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    c.set_defaults(fn=cmd_compare)
