"""How often the A/B gate cries wolf, and how often it catches a real slowdown, on this machine.

    .venv/bin/python scripts/gate_power.py --runs 10 --rounds 6 --slowdown 0.15 --hog

``--runs`` unchanged gates (base HEAD vs a worktree of HEAD) and as many gates whose candidate
is slowed by ``--slowdown`` (tests/e2e/inject_gate/sitecustomize.py, a test-only injection copied
into the candidate worktree), each with a busy-looping neighbour process beside it (``--hog``).
Prints a markdown table and the counts; commit the output under results/reference/gate-ab/.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.compare.stats import REGRESSION, CompareOptions  # noqa: E402
from harness.compare.verdicts import compare  # noqa: E402
from harness.run.ab import run_ab, worktree  # noqa: E402

INJECT = REPO / "tests" / "e2e" / "inject_gate" / "sitecustomize.py"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--slowdown", type=float, default=0.15)
    ap.add_argument("--threshold", type=float, default=0.10)
    ap.add_argument("--hog", action="store_true", help="a busy-looping neighbour process during every gate")
    args = ap.parse_args()
    opts = CompareOptions(threshold=args.threshold)
    print("| run | candidate | verdict | ratio cand/base | 95% CI | seconds |\n|---|---|---|---|---|---|", flush=True)
    counts = {"unchanged": 0, "slowed": 0}
    with worktree("HEAD") as base, worktree("HEAD") as cand:
        shutil.copy(INJECT, cand / "sitecustomize.py")
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.hog else None
        try:
            for i in range(args.runs):
                for kind, slowdown in (("unchanged", 0.0), ("slowed", args.slowdown)):
                    os.environ["HARNESS_TEST_SLOWDOWN"] = str(slowdown)
                    t0 = time.monotonic()
                    b, c = run_ab(base, cand, args.rounds, say=lambda *a, **k: None)
                    row = compare(b, c, opts).iloc[0]
                    counts[kind] += row["verdict"] == REGRESSION
                    label = kind if kind == "unchanged" else f"{args.slowdown:.0%} slower"
                    print(f"| {i + 1} | {label} | {row['verdict']} | {row['ratio']:.3f} | "
                          f"[{row['ci_low']:.3f}, {row['ci_high']:.3f}] | {time.monotonic() - t0:.0f} |", flush=True)
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()
    print(f"\nREGRESSION verdicts: {counts['unchanged']} of {args.runs} unchanged gates (false positives), "
          f"{counts['slowed']} of {args.runs} gates with a {args.slowdown:.0%} slower candidate (detections); "
          f"threshold {args.threshold:.0%}, {args.rounds} rounds ABBA, neighbour process: "
          f"{'a busy loop on one core' if args.hog else 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
