"""Regression gate: compare per-step throughput of a candidate run against a baseline.

The statistics are in :mod:`harness.compare.stats`; this module pairs records, judges each
pair and formats the verdicts; ``harness compare`` (:mod:`harness.cli.compare`) is its CLI.

Cells are paired by ``fingerprint`` (docs/records.md). Per pair the statistic is the
ratio of median throughputs cand/base, with a seeded percentile-bootstrap confidence
interval (Efron & Tibshirani 1993) and a one-sided Mann-Whitney U test (H1: cand < base).
With ``--normalize calibration`` each cell's throughput is in multiples of the machine's speed
around it, and the CI is widened by the normalisers' spread (:mod:`harness.compare.cell_normaliser`).
A side that cannot vouch for its own numbers (``metrics.unstable_reason`` set, or a normaliser
spread over its limit) gives INCONCLUSIVE where the numbers alone would say IMPROVED or
REGRESSION (:func:`harness.compare.stats.withhold_change`); a cell that fails only in the
candidate is a REGRESSION whatever the timings.

Exit codes of :func:`run_compare`: 0 all PASS / IMPROVED / INCONCLUSIVE / SKIPPED (same
``invalid`` or ``oom`` status on both sides), 1 any REGRESSION (including a cell that fails
only in the candidate),
2 usage error (missing or malformed input), 3 any NOT COMPARABLE / MISSING /
TOO FEW SAMPLES when there is no regression (a regression outranks "cannot judge").
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, TextIO

import numpy as np
import pandas as pd
from tabulate import tabulate

from harness.compare.cell_normaliser import NO_NORMALISER, Normaliser, cell_normaliser, run_normaliser
from harness.compare.stats import (  # noqa: F401  (re-exported: the gate's verdicts and options)
    CANNOT_JUDGE,
    INCONCLUSIVE,
    MISSING,
    NORMALIZE_CHOICES,
    NOT_COMPARABLE,
    PASS,
    REGRESSION,
    SKIPPED,
    UNCHANGED_FAILURES,
    CompareOptions,
    PairResult,
    judge_samples,
    withhold_change,
)
from harness.errors import UsageError
from harness.records.reader import latest_per_cell, load_any
from harness.text import first_line, fmt_or

COLUMNS = [
    "cell_id", "verdict", "base_median_tok_per_s", "cand_median_tok_per_s", "ratio",
    "ci_low", "ci_high", "p_value", "n_base", "n_cand", "base_normaliser_s", "cand_normaliser_s",
    "base_normaliser_spread_pct", "cand_normaliser_spread_pct", "reason",
]

# ---------------------------------------------------------------- records -> samples


def throughput_samples(record: dict[str, Any]) -> np.ndarray:
    """Per-step throughput ``tokens_per_step / step_time_s`` for each measured step.

    ``tokens_per_step`` comes from ``metrics.tokens_per_step``, else
    ``config.global_batch * config.seq_len``; with neither, no samples are returned.
    """
    times = np.asarray((record.get("samples") or {}).get("step_time_s") or [], dtype=float)
    if np.any(~np.isfinite(times)) or np.any(times <= 0):
        raise UsageError(
            f"cell {record.get('cell_id')!r}: samples.step_time_s must be finite and > 0; "
            "the record is corrupt, rerun the cell"
        )
    tokens = _tokens_per_step(record)
    if tokens is None:
        return np.empty(0)
    return tokens / times


def _tokens_per_step(record: dict[str, Any]) -> float | None:
    metrics = record.get("metrics") or {}
    if metrics.get("tokens_per_step") is not None:
        return float(metrics["tokens_per_step"])
    config = record.get("config") or {}
    if config.get("global_batch") is not None and config.get("seq_len") is not None:
        return float(config["global_batch"] * config["seq_len"])
    return None


def fingerprint_diff(base_fields: dict[str, Any], cand_fields: dict[str, Any]) -> str:
    """Name the fingerprint fields that differ, e.g. ``precision differs (fp32 vs bf16)``."""
    base_flat, cand_flat = _flatten(base_fields), _flatten(cand_fields)
    diffs = [
        f"{key} differs ({base_flat.get(key, 'absent')} vs {cand_flat.get(key, 'absent')})"
        for key in sorted(set(base_flat) | set(cand_flat))
        if base_flat.get(key, "absent") != cand_flat.get(key, "absent")
    ]
    return "; ".join(diffs) if diffs else "fingerprint differs but fingerprint_fields are equal"


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in (d or {}).items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


# ---------------------------------------------------------------- pairing


def _index_cells(records: Sequence[dict[str, Any]], label: str) -> dict[str, dict[str, Any]]:
    """Cells by fingerprint, each cell id's latest record (a resumed run's earlier attempts are history)."""
    by_fp: dict[str, dict[str, Any]] = {}
    for record in latest_per_cell(list(records))[0]:
        if record.get("kind", "cell") != "cell":
            continue
        fp = record.get("fingerprint")
        if not fp:
            raise UsageError(
                f"{label}: cell {record.get('cell_id')!r} has no fingerprint; "
                "records must follow docs/records.md schema_version 1"
            )
        if fp in by_fp and by_fp[fp].get("cell_id") != record.get("cell_id"):
            raise UsageError(
                f"{label}: cells {by_fp[fp].get('cell_id')!r} and {record.get('cell_id')!r} "
                f"share fingerprint {fp}; fingerprints must be unique per cell"
            )
        by_fp[fp] = record
    if not by_fp:
        raise UsageError(f"{label}: no cell records (kind == 'cell'); pass a finished run")
    return by_fp


def _judge_pair(
    base: dict[str, Any], cand: dict[str, Any], opts: CompareOptions, norms: tuple[Normaliser, Normaliser]
) -> PairResult:
    base_status, cand_status = base.get("status", "ok"), cand.get("status", "ok")
    if base_status == cand_status and base_status in UNCHANGED_FAILURES:
        return PairResult(SKIPPED, f"{base_status} on both sides: {first_line(cand.get('error'))}")
    if base_status != "ok":
        reason = f"base status {base_status}: {first_line(base.get('error'))}; rerun the base cell"
        return PairResult(NOT_COMPARABLE, reason)
    if cand_status != "ok":
        reason = f"cand status {cand_status} (base ok): {first_line(cand.get('error'))}"
        return PairResult(REGRESSION, reason)
    result = judge_samples(throughput_samples(base) * norms[0].time_s,
                           throughput_samples(cand) * norms[1].time_s, opts,
                           ci_factor=norms[0].factor * norms[1].factor)
    notes = [f"{side} {(r.get('metrics') or {}).get('unstable_reason')}"
             for side, r in (("base", base), ("cand", cand))
             if (r.get("metrics") or {}).get("unstable_reason")]
    notes += [note for side, n in (("base", norms[0]), ("cand", norms[1]))
              if (note := n.unsteady_note(side)) is not None]
    return withhold_change(result, notes)


def compare(
    base_records: Sequence[dict[str, Any]],
    cand_records: Sequence[dict[str, Any]],
    opts: CompareOptions,
    base_label: str = "base",
    cand_label: str = "cand",
) -> pd.DataFrame:
    """One row per paired, unpaired or not-comparable cell; columns :data:`COLUMNS`.

    With ``opts.normalize == "calibration"`` each side's throughput is multiplied by its cell's
    normaliser time (:func:`harness.compare.cell_normaliser.cell_normaliser`), i.e. expressed in
    units of the machine's matmul throughput around that cell.
    """
    base_cells = _index_cells(base_records, base_label)
    cand_cells = _index_cells(cand_records, cand_label)
    runs = None
    if opts.normalize == "calibration":
        runs = (run_normaliser(base_records, base_label), run_normaliser(cand_records, cand_label))
    cand_only = {fp: r for fp, r in cand_cells.items() if fp not in base_cells}
    cand_only_by_id = {r.get("cell_id"): fp for fp, r in cand_only.items()}
    rows: list[dict[str, Any]] = []
    for fp, base in base_cells.items():
        cell_id = base.get("cell_id")
        if fp in cand_cells:
            norms = (NO_NORMALISER, NO_NORMALISER) if runs is None else \
                (cell_normaliser(base, runs[0]), cell_normaliser(cand_cells[fp], runs[1]))
            rows.append(_row(cell_id, _judge_pair(base, cand_cells[fp], opts, norms),
                             None if runs is None else norms))
        elif cell_id in cand_only_by_id:
            cand = cand_only.pop(cand_only_by_id[cell_id])
            diff = fingerprint_diff(base.get("fingerprint_fields") or {},
                                    cand.get("fingerprint_fields") or {})
            rows.append(_row(cell_id, PairResult(NOT_COMPARABLE, f"not comparable: {diff}")))
        else:
            rows.append(_row(cell_id, PairResult(MISSING, f"only in base; missing from {cand_label}")))
    for cand in cand_only.values():
        reason = f"only in cand; missing from {base_label}"
        rows.append(_row(cand.get("cell_id"), PairResult(MISSING, reason)))
    df = pd.DataFrame(rows, columns=COLUMNS)
    df.attrs["throughput_unit"] = "x calibration" if opts.normalize == "calibration" else "tok/s"
    return df


def _row(cell_id: Any, result: PairResult, norms: tuple[Normaliser, Normaliser] | None = None) -> dict[str, Any]:
    nan = float("nan")
    base_n, cand_n = norms if norms is not None else (None, None)
    return {
        "cell_id": cell_id, "verdict": result.verdict,
        "base_median_tok_per_s": result.base_median, "cand_median_tok_per_s": result.cand_median,
        "ratio": result.ratio, "ci_low": result.ci_low, "ci_high": result.ci_high,
        "p_value": result.p_value, "n_base": result.n_base, "n_cand": result.n_cand,
        "base_normaliser_s": base_n.time_s if base_n else nan, "cand_normaliser_s": cand_n.time_s if cand_n else nan,
        "base_normaliser_spread_pct": 100 * base_n.spread if base_n else nan,
        "cand_normaliser_spread_pct": 100 * cand_n.spread if cand_n else nan,
        "reason": result.reason,
    }


def exit_code(df: pd.DataFrame) -> int:
    """1 if any REGRESSION, else 3 if any cell cannot be judged, else 0."""
    verdicts = set(df["verdict"])
    if REGRESSION in verdicts:
        return 1
    if verdicts & set(CANNOT_JUDGE):
        return 3
    return 0


# ---------------------------------------------------------------- presentation


def format_table(df: pd.DataFrame) -> str:
    """The comparison as a tabulate "github" table; NaN shows as ``n/a``.

    Throughput is in tokens/s (ops/s for pytest-benchmark input), or in multiples of the
    calibration throughput after ``--normalize calibration`` (``df.attrs["throughput_unit"]``).
    A frame with any normaliser spread gets a ``normaliser spread % base/cand`` column.
    """
    spreads = [c for c in ("base_normaliser_spread_pct", "cand_normaliser_spread_pct") if c in df]
    normalised = bool(spreads) and bool(df[spreads].notna().to_numpy().any())
    rows = [
        [r.cell_id, r.verdict, fmt_or(r.base_median_tok_per_s, ",.1f"),
         fmt_or(r.cand_median_tok_per_s, ",.1f"), fmt_or(r.ratio, ".3f"),
         "n/a" if pd.isna(r.ci_low) else f"[{r.ci_low:.3f}, {r.ci_high:.3f}]",
         fmt_or(r.p_value, ".2g"), f"{r.n_base}/{r.n_cand}",
         *([f"{fmt_or(r.base_normaliser_spread_pct, '.1f')}/{fmt_or(r.cand_normaliser_spread_pct, '.1f')}"]
           if normalised else []), r.reason]
        for r in df.itertuples(index=False)
    ]
    unit = df.attrs.get("throughput_unit", "tok/s")
    headers = ["cell", "verdict", f"base median {unit}", f"cand median {unit}", "ratio cand/base",
               "95% CI ratio", "MWU p", "n base/cand", *(["normaliser spread % base/cand"] if normalised else []),
               "reason"]
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)


def verdict_summary(df: pd.DataFrame) -> str:
    """One line counting verdicts, with the remedy for INCONCLUSIVE cells."""
    counts = df["verdict"].value_counts()
    line = ", ".join(f"{n} {v}" for v, n in counts.items())
    code = exit_code(df)
    if INCONCLUSIVE in counts:
        line += (f"; {counts[INCONCLUSIVE]} INCONCLUSIVE: a change beyond the threshold that the "
                 "measurements cannot support (CI or MWU short of confidence, a side unstable, or its "
                 "machine unsteady); each reason gives its remedy")
    return f"verdicts: {line}; exit {code}"


def run_compare(
    base: str,
    cand: str,
    *,
    threshold: float = 0.05,
    alpha: float = 0.05,
    normalize: str = "none",
    n_bootstrap: int = 2000,
    seed: int = 0,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Load both sides, print the table and a verdict line to stdout, return the exit code."""
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    try:
        opts = CompareOptions(threshold=threshold, alpha=alpha, n_bootstrap=n_bootstrap,
                              seed=seed, normalize=normalize)
        df = compare(load_any(base, err), load_any(cand, err), opts, base_label=base, cand_label=cand)
    except UsageError as exc:
        print(f"harness compare: error: {exc}", file=err)
        return 2
    print(format_table(df), file=out)
    print(verdict_summary(df), file=out)
    return exit_code(df)
