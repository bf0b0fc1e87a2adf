"""Regression gate: compare per-step throughput of a candidate run against a baseline.

Cells are paired by ``fingerprint`` (docs/records.md). Per pair the statistic is the
ratio of median throughputs cand/base, with a seeded percentile-bootstrap confidence
interval (Efron & Tibshirani 1993) and a one-sided Mann-Whitney U test (H1: cand < base).

Exit codes of :func:`run_compare`: 0 all PASS / IMPROVED / INCONCLUSIVE / SKIPPED (same
``invalid`` or ``oom`` status on both sides), 1 any REGRESSION (including a cell that fails
only in the candidate),
2 usage error (missing or malformed input), 3 any NOT COMPARABLE / MISSING /
TOO FEW SAMPLES when there is no regression (a regression outranks "cannot judge").
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from typing import Any, Iterable, Sequence, TextIO

import numpy as np
import pandas as pd
from scipy.stats import mannwhitneyu
from tabulate import tabulate

from harness.errors import UsageError
from harness.records_io import load_any

PASS = "PASS"
IMPROVED = "IMPROVED"
INCONCLUSIVE = "INCONCLUSIVE"
REGRESSION = "REGRESSION"
NOT_COMPARABLE = "NOT COMPARABLE"
MISSING = "MISSING"
TOO_FEW = "TOO FEW SAMPLES"
SKIPPED = "SKIPPED"
UNCHANGED_FAILURES = ("invalid", "oom")
"""Statuses that, identical on both sides, mean "not measurable here", not a change."""
CANNOT_JUDGE = (NOT_COMPARABLE, MISSING, TOO_FEW)
MIN_SAMPLES = 5
NORMALIZE_CHOICES = ("none", "calibration")
COLUMNS = [
    "cell_id", "verdict", "base_median_tok_per_s", "cand_median_tok_per_s", "ratio",
    "ci_low", "ci_high", "p_value", "n_base", "n_cand", "reason",
]


@dataclass(frozen=True)
class CompareOptions:
    """Knobs of the gate; validated at construction."""

    threshold: float = 0.05
    """Relative change that matters: REGRESSION needs ratio < 1 - threshold."""
    alpha: float = 0.05
    """Significance level for the one-sided Mann-Whitney U test."""
    n_bootstrap: int = 2000
    """Bootstrap resamples for the CI of the ratio of medians."""
    seed: int = 0
    """Seed of the bootstrap generator, so a verdict is reproducible."""
    confidence: float = 0.95
    """Two-sided confidence level of the bootstrap interval."""
    normalize: str = "none"
    """``calibration`` divides each side's throughput by its calibration throughput."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold < 1.0:
            raise UsageError(f"--threshold ({self.threshold}) must be in [0, 1); e.g. 0.05 for 5%")
        if not 0.0 < self.alpha < 1.0:
            raise UsageError(f"--alpha ({self.alpha}) must be in (0, 1); e.g. 0.05")
        if self.n_bootstrap < 100:
            raise UsageError(f"--bootstrap ({self.n_bootstrap}) must be >= 100; e.g. 2000")
        if not 0.0 < self.confidence < 1.0:
            raise UsageError(f"confidence ({self.confidence}) must be in (0, 1); e.g. 0.95")
        if self.normalize not in NORMALIZE_CHOICES:
            raise UsageError(
                f"--normalize ({self.normalize!r}) must be one of {', '.join(NORMALIZE_CHOICES)}"
            )


@dataclass(frozen=True)
class PairResult:
    """Outcome of one base/cand pair; throughputs in tokens/s (ops/s for benchmark JSON)."""

    verdict: str
    reason: str
    base_median: float = float("nan")
    cand_median: float = float("nan")
    ratio: float = float("nan")
    ci_low: float = float("nan")
    ci_high: float = float("nan")
    p_value: float = float("nan")
    n_base: int = 0
    n_cand: int = 0


# ---------------------------------------------------------------- statistics (pure)


def median_ratio(base: np.ndarray, cand: np.ndarray) -> float:
    """Ratio of medians ``median(cand) / median(base)``; < 1 means the candidate is slower."""
    return float(np.median(cand) / np.median(base))


def bootstrap_ratio_ci(
    base: np.ndarray, cand: np.ndarray, n_resamples: int, seed: int, confidence: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap CI of ``median(cand*) / median(base*)``.

    Each side is resampled with replacement independently (two-sample bootstrap),
    ``n_resamples`` times with ``numpy.random.default_rng(seed)``; the interval is the
    ``(1 - confidence) / 2`` and ``(1 + confidence) / 2`` quantiles of the resampled ratios.
    """
    rng = np.random.default_rng(seed)
    base_idx = rng.integers(0, len(base), size=(n_resamples, len(base)))
    cand_idx = rng.integers(0, len(cand), size=(n_resamples, len(cand)))
    ratios = np.median(cand[cand_idx], axis=1) / np.median(base[base_idx], axis=1)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(ratios, [tail, 1.0 - tail])
    return float(low), float(high)


def mannwhitney_less_p(base: np.ndarray, cand: np.ndarray) -> float:
    """One-sided Mann-Whitney U p-value for H1: cand is stochastically smaller than base."""
    return float(mannwhitneyu(cand, base, alternative="less").pvalue)


def decide(
    ratio: float, ci_low: float, ci_high: float, p_value: float, threshold: float, alpha: float
) -> tuple[str, str]:
    """Verdict and reason from the ratio of medians, its CI and the MWU p-value.

    REGRESSION: ratio < 1 - threshold, CI high < 1 and p < alpha. INCONCLUSIVE: ratio <
    1 - threshold otherwise. IMPROVED: ratio > 1 + threshold and CI low > 1. Else PASS.
    """
    change = f"{abs(1.0 - ratio):.1%}"
    ci = f"CI [{ci_low:.3f}, {ci_high:.3f}]"
    if ratio < 1.0 - threshold:
        if ci_high < 1.0 and p_value < alpha:
            return REGRESSION, f"slower by {change} ({ci}, MWU p={p_value:.2g})"
        why = f"{ci} crosses 1" if ci_high >= 1.0 else f"MWU p={p_value:.2g} >= alpha {alpha}"
        return INCONCLUSIVE, f"slower by {change} but {why}; rerun with more steps"
    if ratio > 1.0 + threshold and ci_low > 1.0:
        return IMPROVED, f"faster by {change} ({ci})"
    if ratio > 1.0 + threshold:
        return PASS, f"faster by {change} but {ci} crosses 1"
    return PASS, f"within +/-{threshold:.0%} (ratio {ratio:.3f}, {ci})"


def judge_samples(base: np.ndarray, cand: np.ndarray, opts: CompareOptions) -> PairResult:
    """Compare two arrays of per-step throughput samples (higher is better)."""
    n_base, n_cand = len(base), len(cand)
    medians = {
        "base_median": float(np.median(base)) if n_base else float("nan"),
        "cand_median": float(np.median(cand)) if n_cand else float("nan"),
    }
    if min(n_base, n_cand) < MIN_SAMPLES:
        reason = (
            f"{n_base} base and {n_cand} cand samples, need >= {MIN_SAMPLES} per side; "
            "rerun with more measured steps"
        )
        return PairResult(TOO_FEW, reason, n_base=n_base, n_cand=n_cand, **medians)
    ratio = median_ratio(base, cand)
    low, high = bootstrap_ratio_ci(base, cand, opts.n_bootstrap, opts.seed, opts.confidence)
    p_value = mannwhitney_less_p(base, cand)
    verdict, reason = decide(ratio, low, high, p_value, opts.threshold, opts.alpha)
    return PairResult(verdict, reason, ratio=ratio, ci_low=low, ci_high=high,
                      p_value=p_value, n_base=n_base, n_cand=n_cand, **medians)


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


def calibration_time_s(records: Iterable[dict[str, Any]], label: str) -> float:
    """Median time of the run's calibration workload (``kind == "calibration"``)."""
    for record in records:
        if record.get("kind") == "calibration":
            times = (record.get("samples") or {}).get("step_time_s") or []
            if not times:
                break
            return float(np.median(np.asarray(times, dtype=float)))
    raise UsageError(
        f"{label}: no calibration record with samples.step_time_s (kind == 'calibration'); "
        "rerun with calibration enabled or use --normalize none"
    )


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
    """Cells by fingerprint. A cell measured twice (resumed run) keeps its last record."""
    by_fp: dict[str, dict[str, Any]] = {}
    for record in records:
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
    base: dict[str, Any], cand: dict[str, Any], opts: CompareOptions, scales: tuple[float, float]
) -> PairResult:
    base_status, cand_status = base.get("status", "ok"), cand.get("status", "ok")
    if base_status == cand_status and base_status in UNCHANGED_FAILURES:
        return PairResult(SKIPPED, f"{base_status} on both sides: {_short(cand.get('error'))}")
    if base_status != "ok":
        reason = f"base status {base_status}: {_short(base.get('error'))}; rerun the base cell"
        return PairResult(NOT_COMPARABLE, reason)
    if cand_status != "ok":
        reason = f"cand status {cand_status} (base ok): {_short(cand.get('error'))}"
        return PairResult(REGRESSION, reason)
    result = judge_samples(
        throughput_samples(base) * scales[0], throughput_samples(cand) * scales[1], opts
    )
    notes = [f"{side} {(r.get('metrics') or {}).get('unstable_reason')}"
             for side, r in (("base", base), ("cand", cand))
             if (r.get("metrics") or {}).get("unstable_reason")]
    if notes:
        result = replace(result, reason="; ".join([result.reason, *notes]))
    return result


def _short(text: Any, limit: int = 60) -> str:
    """First line of an error message, at most ``limit`` characters."""
    if not text:
        return "no error message"
    return str(text).splitlines()[0][:limit]


def compare(
    base_records: Sequence[dict[str, Any]],
    cand_records: Sequence[dict[str, Any]],
    opts: CompareOptions,
    base_label: str = "base",
    cand_label: str = "cand",
) -> pd.DataFrame:
    """One row per paired, unpaired or not-comparable cell; columns :data:`COLUMNS`.

    With ``opts.normalize == "calibration"`` each side's throughput is multiplied by its
    calibration median time, i.e. expressed in units of the calibration throughput.
    """
    base_cells = _index_cells(base_records, base_label)
    cand_cells = _index_cells(cand_records, cand_label)
    scales = (1.0, 1.0)
    if opts.normalize == "calibration":
        scales = (calibration_time_s(base_records, base_label),
                  calibration_time_s(cand_records, cand_label))
    cand_only = {fp: r for fp, r in cand_cells.items() if fp not in base_cells}
    cand_only_by_id = {r.get("cell_id"): fp for fp, r in cand_only.items()}
    rows: list[dict[str, Any]] = []
    for fp, base in base_cells.items():
        cell_id = base.get("cell_id")
        if fp in cand_cells:
            rows.append(_row(cell_id, _judge_pair(base, cand_cells[fp], opts, scales)))
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


def _row(cell_id: Any, result: PairResult) -> dict[str, Any]:
    return {
        "cell_id": cell_id, "verdict": result.verdict,
        "base_median_tok_per_s": result.base_median, "cand_median_tok_per_s": result.cand_median,
        "ratio": result.ratio, "ci_low": result.ci_low, "ci_high": result.ci_high,
        "p_value": result.p_value, "n_base": result.n_base, "n_cand": result.n_cand,
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
    """
    def num(x: float, fmt: str) -> str:
        return "n/a" if pd.isna(x) else format(x, fmt)

    rows = [
        [r.cell_id, r.verdict, num(r.base_median_tok_per_s, ",.1f"),
         num(r.cand_median_tok_per_s, ",.1f"), num(r.ratio, ".3f"),
         "n/a" if pd.isna(r.ci_low) else f"[{r.ci_low:.3f}, {r.ci_high:.3f}]",
         num(r.p_value, ".2g"), f"{r.n_base}/{r.n_cand}", r.reason]
        for r in df.itertuples(index=False)
    ]
    unit = df.attrs.get("throughput_unit", "tok/s")
    headers = ["cell", "verdict", f"base median {unit}", f"cand median {unit}", "ratio cand/base",
               "95% CI ratio", "MWU p", "n base/cand", "reason"]
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)


def verdict_summary(df: pd.DataFrame) -> str:
    """One line counting verdicts, with the remedy for INCONCLUSIVE cells."""
    counts = df["verdict"].value_counts()
    line = ", ".join(f"{n} {v}" for v, n in counts.items())
    code = exit_code(df)
    if INCONCLUSIVE in counts:
        line += (f"; {counts[INCONCLUSIVE]} INCONCLUSIVE: slower beyond the threshold without "
                 "statistical confidence, rerun with more steps")
    return f"verdicts: {line}; exit {code}"


def run_compare(
    base: str,
    cand: str,
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
        df = compare(load_any(base), load_any(cand), opts, base_label=base, cand_label=cand)
    except UsageError as exc:
        print(f"harness compare: error: {exc}", file=err)
        return 2
    print(format_table(df), file=out)
    print(verdict_summary(df), file=out)
    return exit_code(df)


def build_parser() -> argparse.ArgumentParser:
    """Argument parser of ``harness compare``."""
    p = argparse.ArgumentParser(prog="harness compare", description=__doc__.splitlines()[0])
    p.add_argument("base", help="baseline: records.jsonl, run directory or pytest-benchmark JSON")
    p.add_argument("cand", help="candidate: records.jsonl, run directory or pytest-benchmark JSON")
    p.add_argument("--threshold", type=float, default=0.05, help="relative change that matters")
    p.add_argument("--alpha", type=float, default=0.05, help="Mann-Whitney U significance level")
    p.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    p.add_argument("--normalize", choices=NORMALIZE_CHOICES, default="none",
                   help="calibration: divide by each run's calibration throughput")
    return p


def main_compare(argv: Sequence[str] | None = None) -> int:
    """CLI entry: parse ``argv`` and run the gate; argparse errors exit 2 on their own."""
    args = build_parser().parse_args(argv)
    return run_compare(args.base, args.cand, threshold=args.threshold, alpha=args.alpha,
                       normalize=args.normalize, n_bootstrap=args.bootstrap, seed=args.seed)
