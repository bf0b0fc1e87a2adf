"""``--normalize calibration``: each cell's normaliser from every timing of the machine in its run.

The normaliser workload is :mod:`harness.measure.machine_probe`'s fixed matmul. A run times it
in its ``kind: "calibration"`` record (samples at the start of the run) and, where the sweep
probes the machine, just before and just after each cell (``metrics.machine_probe_s``
``before``/``after``). The run's timings ``T`` are all of them: every calibration sample and
every probe of the run's cells (their latest records).

Normaliser of a cell, ``n`` seconds: the mean of the probes around that cell when it has any
(the machine's speed around the cell), else ``median(T)``. Throughput times ``n`` is in
multiples of the machine's matmul throughput.

Spread, a factor ``f >= 1`` printed as ``f - 1`` in %: the machine's speed for the cell lies,
as far as the run's timings tell, within ``[n / f, n * f]``.

* run: ``max(median(T) / p10(T), p90(T) / median(T))``, the central 80% of the run's timings
  (numpy's linear quantiles), so one cold first sample does not decide it;
* cell: the run's, or ``max(n / min(probes), max(probes) / n)`` over the cell's own probes where
  that is wider. A probed cell keeps the run's spread because a probe is a 0.1 s look between
  cells that run for seconds: on a machine whose speed swings, the speed during the cell is not
  what either probe saw (:mod:`harness.report.model_error`: probes explain only part of the
  drift on the CPU references).

Cand/base is scaled by ``n_cand / n_base``, each known within its factor, so the ratio's
bootstrap CI widens to ``[low / (f_base f_cand), high * f_base f_cand]``
(:func:`harness.compare.stats.judge_samples`' ``ci_factor``). A side whose spread exceeds
:data:`SPREAD_LIMIT` gives no IMPROVED or REGRESSION at all (:func:`harness.compare.stats.withhold_change`):
the speed it was divided by is not one number.

A run timed only by its calibration record (pytest-benchmark output) has the spread of those
samples alone, taken within a second: they cannot see drift later in the run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from harness.errors import UsageError
from harness.records.reader import latest_per_cell

SPREAD_LIMIT = 0.10
"""Above this normaliser spread a side is "not steady": no IMPROVED or REGRESSION from it. The
same 10% bound as a cell's step-time CV (:data:`harness.measure.step_stats.UNSTABLE_CV`, pyperf's),
fixed rather than tied to ``--threshold``: the threshold says what change matters, this says
whether the machine held still; the CI's widening already makes a change exceed the spread."""
SPREAD_QUANTILES = (0.10, 0.90)
"""The central interval of the run's timings whose ends set the run's spread."""


@dataclass(frozen=True)
class Normaliser:
    """One side's normaliser for one cell."""

    time_s: float
    """Seconds of the matmul workload: throughput is multiplied by it."""
    factor: float = 1.0
    """Spread as a factor >= 1: the machine's speed lies within ``[time_s / factor, time_s * factor]``."""
    evidence: str = ""
    """The timings the factor comes from, for a reason: ``matmul 0.015-0.045 s, p10-p90 of 35 timings``."""

    @property
    def spread(self) -> float:
        """``factor - 1``: 0.04 is a normaliser known within 4%."""
        return self.factor - 1.0

    def unsteady_note(self, side: str) -> str | None:
        """Why this side can support no change, or None when its spread is within :data:`SPREAD_LIMIT`."""
        if self.factor <= 1.0 + SPREAD_LIMIT:
            return None
        return (f"{side} normaliser spread {self.spread:.0%} ({self.evidence}): machine not steady "
                f"(limit {SPREAD_LIMIT:.0%}); rerun on a quiet machine")


NO_NORMALISER = Normaliser(1.0)
"""``--normalize none``: throughput as measured, nothing added to the CI."""


def run_normaliser(records: Sequence[dict[str, Any]], label: str) -> Normaliser:
    """The run's normaliser: the median of all its timings, with their spread; UsageError when
    it has no calibration sample and no probe."""
    return spread_of(run_timings_s(records, label))


def spread_of(timings_s: Sequence[float]) -> Normaliser:
    """``median(T)`` and the factor ``max(median / p10, p90 / median)`` (module docstring)."""
    low, high = (float(q) for q in np.quantile(timings_s, SPREAD_QUANTILES))
    median = float(np.median(timings_s))
    lo_pct, hi_pct = (round(100 * q) for q in SPREAD_QUANTILES)
    return Normaliser(median, max(median / low, high / median),
                      f"matmul {low:.3g}-{high:.3g} s, p{lo_pct}-p{hi_pct} of {len(timings_s)} timings")


def cell_normaliser(record: dict[str, Any], run: Normaliser) -> Normaliser:
    """The cell's normaliser: the mean of its own probes if it has any, else the run's; the wider
    of the run's spread and its probes' (module docstring)."""
    probes = cell_probes_s(record)
    if not probes:
        return run
    n = sum(probes) / len(probes)
    factor = max(n / min(probes), max(probes) / n)
    if factor <= run.factor:
        return Normaliser(n, run.factor, run.evidence)
    return Normaliser(n, factor, f"probes around the cell {min(probes):.3g}-{max(probes):.3g} s")


def cell_probes_s(record: dict[str, Any]) -> list[float]:
    """The ``before`` and ``after`` probe seconds of a cell that has them (None: not probed)."""
    probe = (record.get("metrics") or {}).get("machine_probe_s") or {}
    return [_positive(probe[k], record, f"metrics.machine_probe_s.{k}") for k in ("before", "after")
            if probe.get(k) is not None]


def run_timings_s(records: Sequence[dict[str, Any]], label: str) -> list[float]:
    """All calibration samples and cell probes of a run, sorted; UsageError when it has neither."""
    timings: list[float] = []
    for r in latest_per_cell(list(records))[0]:
        if r.get("kind") == "calibration":
            timings += [_positive(t, r, "samples.step_time_s") for t in (r.get("samples") or {}).get("step_time_s") or []]
        elif r.get("kind", "cell") == "cell":
            timings += cell_probes_s(r)
    if not timings:
        raise UsageError(
            f"{label}: no calibration record with samples.step_time_s (kind == 'calibration') and no cell "
            "with metrics.machine_probe_s; rerun with calibration enabled or use --normalize none"
        )
    return sorted(timings)


def _positive(value: Any, record: dict[str, Any], field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise UsageError(f"cell {record.get('cell_id')!r}: {field} ({value!r}) must be a finite number > 0; "
                         "the record is corrupt, rerun the cell")
    return float(value)
