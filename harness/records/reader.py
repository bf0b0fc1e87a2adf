"""Read measurement records (docs/records.md) and pytest-benchmark JSON into record dicts.

Everything downstream (report, plots, compare, resume) consumes ``list[dict]`` records only;
this module is the single place that reads them, with one policy for malformed lines
(:func:`load_records`). Malformed input raises
:class:`harness.errors.UsageError` with one line naming the file, the line and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness.errors import UsageError
from harness.records.fingerprint import digest
from harness.records.record import SCHEMA_VERSION

RECORDS_FILENAME = "records.jsonl"


def resolve_records_path(path: str | Path) -> Path:
    """Return the records.jsonl for ``path``: the file itself or ``<dir>/records.jsonl``."""
    p = Path(path)
    if p.is_dir():
        p = p / RECORDS_FILENAME
    if not p.is_file():
        raise UsageError(
            f"{p}: no such records file; pass a records.jsonl or a run directory containing one"
        )
    return p


class TornTail(UsageError):
    """The last line is not a record and has no newline: the append that wrote it was interrupted."""

    def __init__(self, message: str, path: Path, offset: int) -> None:
        super().__init__(message)
        self.path = path
        self.offset = offset
        """Byte offset where the torn line starts: everything before it is whole records."""


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """Load every record of a records.jsonl file or run directory, in file order.

    The one policy, for every reader (report, compare, resume): each non-blank line must be one
    JSON object, or the file is refused with a UsageError naming the file, the line and the fix.
    A torn last line (not JSON and no newline at its end: an append that was interrupted) raises
    :class:`TornTail`, which says where the whole records end; ``harness bench --resume`` sets
    that tail aside (:func:`harness.run.rundir.set_aside_torn_tail`) and re-runs its cell.
    Records are never skipped silently.
    """
    p = resolve_records_path(path)
    data = p.read_bytes()
    records: list[dict[str, Any]] = []
    offset = 0
    for lineno, raw in enumerate(data.splitlines(keepends=True), start=1):
        start, offset = offset, offset + len(raw)
        line = raw.decode("utf-8", errors="replace")
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            where = f"{p}: line {lineno} is not valid JSON ({exc.msg} at column {exc.colno})"
            if offset == len(data) and not raw.endswith(b"\n"):
                raise TornTail(f"{where}; a write was interrupted there: finish the run with "
                               f"harness bench --resume {p.parent} (the torn line is set aside)", p, start) from exc
            raise UsageError(f"{where}; the file is corrupt at that line: restore it from a copy, "
                             "or remove that line and rerun its cell") from exc
        if not isinstance(obj, dict):
            raise UsageError(
                f"{p}: line {lineno} is a JSON {type(obj).__name__}, expected one record object "
                "per line (docs/records.md)"
            )
        records.append(obj)
    return records


def is_benchmark_json(path: str | Path) -> bool:
    """True when ``path`` is a single JSON file (``.json``), i.e. pytest-benchmark output."""
    p = Path(path)
    return p.is_file() and p.suffix == ".json"


def load_benchmark_json(path: str | Path) -> list[dict[str, Any]]:
    """Convert a ``pytest --benchmark-json`` file into cell records (one per benchmark).

    Per benchmark: ``cell_id`` = fullname; samples = ``extra_info["step_time_s"]`` when
    present, else ``stats["data"]`` (seconds per iteration); ``tokens_per_step`` =
    ``extra_info.get("tokens_per_step", 1)`` so throughput is 1/time unless told otherwise.
    Fingerprint = sha256 of fullname + machine_info cpu brand + extra_info["fingerprint"].
    A benchmark named ``calibration`` (or with ``extra_info["kind"] == "calibration"``)
    becomes the run's calibration record.
    """
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{p}: no such file; pass a pytest --benchmark-json output file")
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UsageError(
            f"{p}: line {exc.lineno} is not valid JSON ({exc.msg}); the file is truncated or "
            "not pytest-benchmark output: regenerate it with pytest --benchmark-json"
        ) from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("benchmarks"), list):
        raise UsageError(
            f"{p}: no 'benchmarks' list; expected pytest --benchmark-json output"
        )
    cpu_brand = _cpu_brand(doc.get("machine_info") or {})
    commit = doc.get("commit_info") or {}
    return [_benchmark_to_record(b, cpu_brand, commit, p) for b in doc["benchmarks"]]


def _cpu_brand(machine_info: dict[str, Any]) -> str:
    cpu = machine_info.get("cpu") or {}
    return str(cpu.get("brand_raw") or cpu.get("brand") or "unknown cpu")


def _benchmark_to_record(
    bench: dict[str, Any], cpu_brand: str, commit: dict[str, Any], path: Path
) -> dict[str, Any]:
    if not isinstance(bench, dict) or "fullname" not in bench:
        raise UsageError(f"{path}: a benchmark entry has no 'fullname'; regenerate the file")
    extra = bench.get("extra_info") or {}
    stats = bench.get("stats") or {}
    samples = extra.get("step_time_s")
    if samples is None:
        samples = stats.get("data") or []
    fields = {
        "fullname": bench["fullname"],
        "cpu": cpu_brand,
        "fingerprint": extra.get("fingerprint"),
    }
    is_calibration = bench.get("name") == "calibration" or extra.get("kind") == "calibration"
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "calibration" if is_calibration else "cell",
        "cell_id": "calibration" if is_calibration else bench["fullname"],
        "status": "ok",
        "error": None,
        "fingerprint": digest(fields),
        "fingerprint_fields": fields,
        "config": {},
        "env": {"git_sha": commit.get("id"), "cpu_model": cpu_brand},
        "metrics": {"tokens_per_step": float(extra.get("tokens_per_step", 1.0))},
        "samples": {"step_time_s": [float(x) for x in samples]},
    }


def load_any(path: str | Path) -> list[dict[str, Any]]:
    """Load records from a records.jsonl, a run directory or a pytest-benchmark JSON file."""
    if is_benchmark_json(path):
        return load_benchmark_json(path)
    return load_records(path)
