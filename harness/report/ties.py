"""Which cells a sweep cannot tell apart: step-time intervals of ``--rounds`` that overlap.

With rounds, each cell's row carries the interval of its median over the rounds
(:func:`harness.measure.intervals.median_spread`, computed by :mod:`harness.report.frame`). The fastest cell is a winner only when no other
cell's interval reaches it; otherwise they are a tie, and the tables and "What to pick" say so.
Without rounds there is no interval, and nothing is called a tie. Pure: frames in, rows out.
"""

from __future__ import annotations

import math

import pandas as pd

from harness.measure.intervals import overlaps


def interval(row: pd.Series) -> tuple[float, float] | None:
    """The cell's step-time interval over its rounds, or None without rounds."""
    lo, hi = row.get("round_ci_low_s"), row.get("round_ci_high_s")
    if lo is None or hi is None or math.isnan(lo) or math.isnan(hi):
        return None
    return float(lo), float(hi)


def tied_with(df: pd.DataFrame, best: pd.Series) -> pd.DataFrame:
    """Other ok rows whose step-time interval overlaps ``best``'s (same world size or not: the interval
    is of the step, and tokens/s/dev is tokens per step over it, so overlap in one is overlap in both
    only for equal tokens per device; rows of other batch or world size are compared on tokens/s/dev
    scaled into the best row's step time)."""
    mine = interval(best)
    if mine is None:
        return df.iloc[0:0]
    keep = []
    for idx, row in df.iterrows():
        theirs = interval(row)
        if idx == best.name or theirs is None or row["status"] != "ok":
            continue
        # the other cell's interval in the best cell's units: same tokens/s/dev <=> same scaled step time
        scale = best["tokens_per_s_per_device"] * best["step_time_median_s"] / (
            row["tokens_per_s_per_device"] * row["step_time_median_s"])
        if overlaps(mine, (theirs[0] * scale, theirs[1] * scale)):
            keep.append(idx)
    return df.loc[keep]


def spread_text(row: pd.Series) -> str:
    """`` ± 3.1%`` after a median measured over rounds, else nothing."""
    spread = row.get("round_spread_pct")
    return "" if spread is None or math.isnan(spread) else f" ± {spread:.1f}%"
