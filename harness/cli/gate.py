"""``harness gate --base REF``: the CI regression gate as an A/B on this machine (exit 0, 1, 3)."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

from harness.compare.stats import INCONCLUSIVE, CompareOptions
from harness.compare.verdicts import compare, exit_code, format_table, verdict_summary
from harness.errors import UsageError
from harness.jobs import REPO, sigterm_as_interrupt
from harness.run.ab import run_ab, worktree


def cmd_gate(args: argparse.Namespace) -> int:
    cand = Path(args.cand).resolve() if args.cand else REPO
    if not cand.is_dir():
        raise UsageError(f"--cand {args.cand}: not a directory; give a checkout of the harness")
    opts = CompareOptions(threshold=args.threshold, alpha=args.alpha, seed=args.seed)
    with sigterm_as_interrupt(), worktree(args.base) as base:  # a killed gate still removes its worktree
        more = f" (up to {args.max_rounds} while a cell is {INCONCLUSIVE})" if args.max_rounds else ""
        print(f"A/B gate: base {args.base} ({base}) vs candidate {cand}, {args.rounds} rounds ABBA{more}, "
              f"threshold {args.threshold:.0%}", flush=True)
        base_records, cand_records = run_ab(base, cand, args.rounds, max_rounds=args.max_rounds,
                                            undecided=functools.partial(_undecided, opts))
    df = compare(base_records, cand_records, opts, base_label=f"base {args.base}", cand_label="candidate")
    print(format_table(df))
    print(verdict_summary(df))
    sys.stdout.flush()
    return exit_code(df)


def _undecided(opts: CompareOptions, base_records: list[dict], cand_records: list[dict]) -> bool:
    """Whether a cell's verdict so far is INCONCLUSIVE: a change past the threshold that more rounds may decide."""
    return INCONCLUSIVE in set(compare(base_records, cand_records, opts)["verdict"])


def register(sub) -> None:
    g = sub.add_parser("gate", help="regression gate as an A/B: a base commit's CI cells and the candidate's, "
                                    "alternately on this machine (exit 0 pass, 1 regression, 3 n/c)")
    g.add_argument("--base", default="HEAD~1", help="git ref of the base (default HEAD~1, the previous commit)")
    g.add_argument("--cand", help="checkout to measure as the candidate (default: this one)")
    g.add_argument("--rounds", type=int, default=6, help="A/B rounds (ABBA order), one median per side each, >= 5 (default 6)")
    g.add_argument("--max-rounds", type=int, help="while a cell is INCONCLUSIVE after --rounds, one round more "
                   "up to this many (the remedy taken in the same gate; default: none)")
    g.add_argument("--threshold", type=float, default=0.10, help="relative slowdown that matters (default 0.10)")
    g.add_argument("--alpha", type=float, default=0.05, help="Mann-Whitney U significance level")
    g.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    g.set_defaults(fn=cmd_gate)
