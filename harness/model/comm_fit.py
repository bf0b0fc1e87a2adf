"""Collective time from a comm calibration entry: the alpha-beta (Hockney) fit.

Pure functions of an entry of :mod:`harness.calibration.collectives` (its ``collectives`` rows
and ``sync_s``); the planner looks the entry up and hands it to the model.
"""

from __future__ import annotations

from harness.measure.step_stats import fit_line


def alpha_beta(entry: dict, collective: str) -> tuple[float, float]:
    """Weighted least-squares fit of ``t = alpha + S / beta`` over every measured size (Hockney 1994).

    Returns ``(alpha_s, beta_bytes_per_s)``. Weights ``1 / t^2`` minimise the relative error, so
    the microsecond-scale small messages (which set ``alpha``) count as much as the large ones
    (which set ``beta``); fitting all sizes at once is robust to the scheduling noise that makes
    single small-message times on a shared CPU jump by milliseconds. ``alpha`` is clipped at 0
    (then the fit goes through the origin).
    """
    rows = entry["collectives"].get(collective)
    if not rows:
        raise ValueError(f"no measurement of {collective!r} in this entry; it has {', '.join(entry['collectives'])}")
    sizes_, times = [float(r["bytes"]) for r in rows], [float(r["time_s"]) for r in rows]
    alpha, slope = fit_line(sizes_, times, weights=[1.0 / t**2 for t in times])
    return alpha, 1.0 / slope


def fitted_time_s(entry: dict, collective: str, nbytes: int, after_compute: bool = False) -> float:
    """Predicted seconds for one call from the :func:`alpha_beta` fit; 0 for 0 bytes.

    ``after_compute`` adds the measured synchronisation cost (:func:`measure_sync_cost`) of a
    collective that follows compute, as every blocking collective in a training step does.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    alpha, beta = alpha_beta(entry, collective)
    if nbytes == 0:
        return 0.0
    return alpha + nbytes / beta + (entry.get("sync_s", 0.0) if after_compute else 0.0)
