"""Whether a calibration's own repeats agree, and what to do when they do not.

Every calibration times each probe (a forward+backward at some rows, an AdamW step, a GEMM
shape) several times and keeps the median. Other processes holding the cores for part of the
measurement make the repeats disagree; a measurement is judged by two checks of its own data:

* spread: ``max / min`` of one probe's repeats above :data:`MAX_SPREAD`;
* order: a probe that cannot be faster than another (a pass at 8 rows against one at 1 row, a
  pass through FSDP2's wrappers against the plain pass) measured faster by more than
  :data:`MAX_SPREAD` (``harness.calibration.workload.probe_order`` names the pairs).

:func:`measure_steadily` measures again once when either fails; a second failure is stored with
``unsteady: true``, its predictions flagged, and :func:`why_remeasure` makes ``harness bench``'s
automatic calibration measure it again rather than reuse it. Neither check sees a machine that
was evenly slow for the whole measurement: the misprediction note after each cell
(:mod:`harness.calibration.provenance`) is the check of last resort.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Iterable
from typing import TextIO

MAX_SPREAD = 2.0
"""Largest ``max / min`` of one probe's repeats (and slack of an ordered pair) accepted as steady:
above every quiet calibration's worst probe and below every one that other processes shared, as
measured on this repository's 2-core machine (docs/running.md, "Steady calibrations")."""
ATTEMPTS = 2
"""Measurements of one entry at most: the first, and one more when the first is unsteady."""

Judge = Callable[[dict], str | None]


def stats(times: Iterable[float]) -> dict:
    """``{n, median, min, max, spread}`` of one probe's repeats; spread is ``max / min``."""
    ts = sorted(float(t) for t in times)
    if not ts:
        raise ValueError("a probe needs at least one repeat; got none")
    return {"n": len(ts), "median": statistics.median(ts), "min": ts[0], "max": ts[-1],
            "spread": ts[-1] / ts[0] if ts[0] > 0 else float("inf")}


def worst(repeats: dict[str, list[float]]) -> tuple[str, dict] | None:
    """The probe whose repeats disagree most, with its :func:`stats` (None without repeats)."""
    if not repeats:
        return None
    return max(((name, stats(ts)) for name, ts in repeats.items()), key=lambda kv: kv[1]["spread"])


def judge(repeats: dict[str, list[float]] | None, order: Iterable[tuple[str, str]] = (),
          limit: float | None = None) -> str | None:
    """Why these repeats are not one steady measurement, or None when they are.

    ``order``: ``(fast, slow)`` probe pairs where ``slow`` cannot be faster than ``fast``; a pair
    whose medians say ``slow`` is more than ``limit`` (default :data:`MAX_SPREAD`) times faster is
    inconsistent.
    """
    limit = MAX_SPREAD if limit is None else limit
    hit = worst(repeats or {})
    if hit is not None and hit[1]["spread"] > limit:
        name, st = hit
        return (f"{name} repeats spread {st['spread']:.2g}x over {st['n']} ({st['min']:.3g}-{st['max']:.3g} s) "
                f"> {limit:g}x")
    for fast, slow in order:
        # pairs to check but no repeats at all: a caller's error (it raised a TypeError here before this check)
        assert repeats is not None, f"judge: probe pair ({fast}, {slow}) given without repeats"
        if fast in repeats and slow in repeats:
            f, s = statistics.median(repeats[fast]), statistics.median(repeats[slow])
            if s * limit < f:
                return f"{slow} ({s:.3g} s) measured {f / s:.2g}x faster than {fast} ({f:.3g} s), which it cannot be"
    return None


def summary(repeats: dict[str, list[float]] | None) -> dict | None:
    """The stored spread figure: the worst probe, its ``n``, ``min``, ``max``, ``spread``, and the limit."""
    hit = worst(repeats or {})
    if hit is None:
        return None
    name, s = hit
    return {"probe": name, "n": s["n"], "min_s": s["min"], "max_s": s["max"], "ratio": s["spread"],
            "limit": MAX_SPREAD}


def _total(entry: dict) -> float:
    return sum(statistics.median(ts) for ts in (entry.get("repeats") or {}).values())


def measure_steadily(measure: Callable[[], dict], label: str, judge_entry: Judge | None = None,
                     prefer: Callable[[dict], float] | None = None, err: TextIO | None = None) -> dict:
    """``measure()``, judged; measured once more when unsteady; marked ``unsteady`` when still so.

    ``measure`` returns an entry with ``repeats`` (probe name -> seconds of each repeat);
    ``judge_entry`` defaults to :func:`judge` of those repeats alone. The entry gains ``spread``
    (:func:`summary`), ``unsteady``, ``attempts`` and, when unsteady, ``unsteady_reason``. Of two
    unsteady attempts the one with the lower ``prefer`` is kept (default: the smaller sum of probe
    medians, the faster: load from other processes only ever adds time).
    Messages go to ``err`` (stderr), one line each, starting ``calibration: LABEL:``.
    """
    err = err or sys.stderr
    judge_entry = judge_entry or (lambda e: judge(e.get("repeats")))
    prefer = prefer or _total
    tries: list[tuple[dict, str | None]] = []
    for attempt in range(1, ATTEMPTS + 1):
        entry = measure()
        why = judge_entry(entry)
        tries.append((entry, why))
        if why is None:
            return {**entry, "spread": summary(entry.get("repeats")), "unsteady": False, "attempts": attempt}
        if attempt < ATTEMPTS:
            print(f"calibration: {label}: {why}, machine not steady; measuring again", file=err, flush=True)
    entry, why = min(tries, key=lambda t: prefer(t[0]))
    print(f"calibration: {label}: still unsteady ({why}); stored marked unsteady, predictions from it are "
          f"flagged; re-measure on a quiet machine", file=err, flush=True)
    return {**entry, "spread": summary(entry.get("repeats")), "unsteady": True, "unsteady_reason": why,
            "attempts": ATTEMPTS}


def why_remeasure(entry: dict | None) -> str | None:
    """Why a stored entry must not be reused by the automatic calibration, or None to reuse it."""
    if entry is None:
        return "not measured yet"
    if entry.get("unsteady"):
        return f"stored entry is marked unsteady ({entry.get('unsteady_reason') or 'its repeats disagreed'})"
    if not entry.get("spread"):
        return "stored entry has no record of its repeats' spread (written before calibrations kept it)"
    return None
