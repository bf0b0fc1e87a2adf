"""Power and false alarms of `harness history`'s step detection on synthetic series.

    .venv/bin/python scripts/history_power.py --series 150 --alpha 0.01,0.05,0.1

Each series is 20 runs of Gaussian run-to-run noise at the given CV; the stepped ones lose 15% of
their throughput from run 10 on. "found" counts stepped series with at least one change point,
"located" those whose first change point is within one run of run 10, "false alarm" unchanged
series with any change point. Seeds are fixed, so the table is reproducible.
"""

from __future__ import annotations

import argparse

import numpy as np
from tabulate import tabulate

from harness.compare.changepoint import detect_steps

RUNS = 20
STEP_AT = 10
STEP = 0.85


def series(seed: int, cv: float, stepped: bool) -> np.ndarray:
    x = 5000.0 * (1.0 + cv * np.random.default_rng(seed).standard_normal(RUNS))
    if stepped:
        x[STEP_AT:] *= STEP
    return x


def rates(cv: float, alpha: float, min_shift: float, n_series: int, permutations: int) -> dict[str, float]:
    found = located = alarms = 0
    for s in range(n_series):
        steps = detect_steps(series(100 + s, cv, True), alpha=alpha, min_shift=min_shift,
                             n_permutations=permutations, seed=s)
        found += bool(steps)
        located += bool(steps) and abs(steps[0].index - STEP_AT) <= 1
        alarms += bool(detect_steps(series(100_000 + s, cv, False), alpha=alpha, min_shift=min_shift,
                                    n_permutations=permutations, seed=s))
    return {"found": found / n_series, "located": located / n_series, "false alarm": alarms / n_series}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--series", type=int, default=150, help="series per row (stepped and unchanged each)")
    ap.add_argument("--permutations", type=int, default=499)
    ap.add_argument("--alpha", default="0.01,0.05,0.1", help="comma-separated significance levels")
    ap.add_argument("--min-shift", type=float, default=0.05, help="as harness history --min-shift")
    ap.add_argument("--cv", default="0.05,0.08,0.10", help="comma-separated run-to-run CVs")
    args = ap.parse_args()
    rows = []
    for cv in (float(c) for c in args.cv.split(",")):
        for alpha in (float(a) for a in args.alpha.split(",")):
            r = rates(cv, alpha, args.min_shift, args.series, args.permutations)
            rows.append({"run-to-run CV": f"{cv:.0%}", "alpha": alpha, "min shift": f"{args.min_shift:.0%}",
                         **{k: f"{v:.0%}" for k, v in r.items()}})
    print(tabulate(rows, headers="keys", tablefmt="github"))


if __name__ == "__main__":
    main()
