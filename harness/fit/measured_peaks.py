"""``harness plan --device ... --fit-from DIR``: the what-if with measured peaks where ``fit`` measured them.

A fit record matches a what-if row when size, strategy, device count, precision, global batch
and sequence length are the same; its largest measured peak then replaces the model's, and
``fits`` is judged on it. Rows without a matching record keep the prediction and say so.
"""

from __future__ import annotations

from pathlib import Path

from harness.errors import UsageError
from harness.fit.fit_cells import RECORDS
from harness.model.whatif import rank_rows
from harness.records.reader import load_records


def load_fit_records(run_dir: Path) -> list[dict]:
    path = run_dir / RECORDS if run_dir.is_dir() else run_dir
    if not path.is_file():
        raise UsageError(f"--fit-from {run_dir}: no {RECORDS} there; run harness fit --out {run_dir} first")
    return [r for r in load_records(path) if r.get("kind") == "fit"]


def measured_peaks(records: list[dict]) -> dict[tuple, float]:
    """(size, strategy, world, precision, global batch, seq len) -> largest measured peak GiB (latest record wins)."""
    out = {}
    for r in records:
        c, peak = r["config"], r["metrics"].get("peak_mem_gib")
        if r["status"] == "ok" and peak is not None:
            out[(c["size"], c["strategy"], c["world_size"], c["precision"], c["global_batch"], c["seq_len"])] = peak
    return out


def with_measured_peaks(rows: list[dict], records: list[dict], size: str, precision: str, seq_len: int,
                        hbm_gib: float, source: Path) -> list[dict]:
    """The rows with measured peaks substituted (and fits re-judged), ranked again."""
    peaks = measured_peaks(records)
    for row in rows:
        if not row["valid"]:
            continue
        key = (size, row["strategy"], row["world_size"], precision, row["global_batch"], seq_len)
        if key not in peaks:
            row["notes"].append(f"peak predicted: no fit record in {source} at global batch {row['global_batch']}")
            continue
        predicted = row["peak_mem_gib_per_rank"]
        row["peak_mem_gib_per_rank"] = peaks[key]
        row["fits"] = peaks[key] <= hbm_gib
        row["reason"] = None if row["fits"] else (f"measured peak {peaks[key]:.1f} GiB > {hbm_gib:.1f} GiB per GPU; "
                                                  f"shard more or a smaller --batch")
        row["notes"].append(f"peak measured by harness fit ({source}; the model predicted {predicted:.1f} GiB)")
        row["rank"] = None
    return rank_rows(rows)
