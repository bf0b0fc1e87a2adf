"""Read measurement records (docs/records.md) and pytest-benchmark JSON into record dicts.

Everything downstream (report, plots, compare, resume) consumes ``list[dict]`` records only;
this module is the single place that reads them, with one policy for malformed lines
(:func:`read_records`): a torn last line is reported and skipped, anything else malformed
raises :class:`harness.errors.UsageError` with one line naming the file, the line and the fix.
"""

from __future__ import annotations

import gzip
import json
import os
import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from harness.errors import UsageError
from harness.records.atomic import append_jsonl
from harness.records.fingerprint import digest
from harness.records.record import SCHEMA_VERSION
from harness.records.record_shape import record_problem

RECORDS_FILENAME = "records.jsonl"
CLOSED_RECORDS_FILENAME = RECORDS_FILENAME + ".gz"
"""A closed run's records, gzip-compressed (committed references: a tenth of the bytes); read like the plain file,
never appended to."""


def records_file(run_dir: str | Path) -> Path | None:
    """A run directory's records file: ``records.jsonl``, else ``records.jsonl.gz``; None when it has neither."""
    for name in (RECORDS_FILENAME, CLOSED_RECORDS_FILENAME):
        if (Path(run_dir) / name).is_file():
            return Path(run_dir) / name
    return None


def resolve_records_path(path: str | Path) -> Path:
    """Return the records file for ``path``: the file itself or its run directory's (:func:`records_file`)."""
    p = Path(path)
    if p.is_dir():
        p = records_file(p) or p / RECORDS_FILENAME
    if not p.is_file():
        raise UsageError(
            f"{p}: no such records file; pass a records.jsonl or a run directory containing one"
        )
    return p


@dataclass(frozen=True)
class TornTail:
    """A last line that is not a record: an append that was interrupted (a crash, a power cut)."""

    path: Path
    lineno: int
    offset: int
    """Byte offset where the torn line starts: everything before it is whole records."""

    def warning(self) -> str:
        return (f"warning: {self.path}: line {self.lineno} is a torn write (an interrupted append) and is "
                f"ignored; the next append sets it aside in {self.path.name}.torn-<time>")


def _parse(line: bytes) -> Any:
    return json.loads(line.decode("utf-8", errors="replace"))


def read_records(path: str | Path) -> tuple[list[dict[str, Any]], TornTail | None]:
    """Every complete record in file order, and the torn last line if there is one.

    The one policy, for every reader (report, compare, resume): each non-blank line must be one
    JSON object. A last line that is not (no newline at its end, or not JSON: an interrupted
    append) is a torn tail: it is not a record, the records before it are read, and it is
    returned so the caller can say so. Any other line that is not a record is corruption:
    UsageError naming the file, the line and the fix. Records are never skipped silently.
    """
    p = resolve_records_path(path)
    data = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
    lines = data.splitlines(keepends=True)
    records: list[dict[str, Any]] = []
    offset = 0
    for lineno, raw in enumerate(lines, start=1):
        start, offset = offset, offset + len(raw)
        if not raw.strip():
            continue
        try:
            obj = _parse(raw)
        except json.JSONDecodeError as exc:
            if lineno == len(lines) and (records or not raw.endswith(b"\n")):
                return records, TornTail(p, lineno, start)
            what = "not a records file (one JSON record per line, docs/records.md)" if not records else \
                "corrupt at that line: restore it from a copy, or remove that line and rerun its cell"
            raise UsageError(f"{p}: line {lineno} is not valid JSON ({exc.msg} at column {exc.colno}); "
                             f"the file is {what}") from exc
        if (problem := record_problem(obj)) is not None:
            raise UsageError(f"{p}: line {lineno} is not a record this harness reads ({problem}); restore the file "
                             f"from a copy, or move that line out of it (docs/records.md, 'A damaged run')")
        records.append(obj)
    return records, None


def load_records(path: str | Path, warn: TextIO | None = None) -> list[dict[str, Any]]:
    """:func:`read_records`, with a one-line warning about a torn tail on ``warn`` (default stderr)."""
    records, torn = read_records(path)
    if torn is not None:
        print(torn.warning(), file=warn or sys.stderr, flush=True)
    return records


def load_run(path: str | Path, warn: TextIO | None = None) -> list[dict[str, Any]]:
    """A finished or partial run's records for a reader that compares or renders cells (report, diff, history,
    compare): :func:`load_records`, refused when the run holds no cell record (an empty run: nothing was measured,
    by every reader's definition)."""
    records = load_records(path, warn)
    if not any(r.get("kind", "cell") == "cell" for r in records):
        what = "is empty" if not records else f"holds {len(records)} record(s) but no cell record (kind == 'cell')"
        raise UsageError(f"{resolve_records_path(path)} {what}: nothing was measured; pass a run of harness bench "
                         f"that measured a cell")
    return records


def set_aside_torn_tail(path: Path) -> Path | None:
    """Before an append: move a torn last line to ``records.jsonl.torn-<time>`` and cut the file
    back to its last complete record, so the next record starts on a line of its own. Returns the
    side file, or None when the file ends with a whole record (the usual case: nothing is read
    but the file's last line)."""
    if not path.exists() or path.stat().st_size == 0:
        return None
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - TAIL_PROBE))
        tail = f.read()
        if tail.endswith(b"\n") and _last_line_parses(tail[:-1]):
            return None
        _, torn = read_records(path)
        if torn is None:
            return None
        f.seek(torn.offset)
        bad = f.read()
        side = path.with_name(f"{path.name}.torn-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
        with open(side, "xb") as s:
            s.write(bad)
            s.flush()
            os.fsync(s.fileno())
        f.truncate(torn.offset)
        f.flush()
        os.fsync(f.fileno())
    return side


TAIL_PROBE = 1 << 20
"""Bytes read from the end of records.jsonl to check its last line (a record is far smaller)."""


def _last_line_parses(body: bytes) -> bool:
    last = body.rsplit(b"\n", 1)[-1]
    if not last.strip():
        return True
    try:
        return isinstance(_parse(last), dict)
    except json.JSONDecodeError:
        return False


def append_record(path: Path, record: dict[str, Any]) -> Path | None:
    """Append one record (flush + fsync) after setting a torn tail aside; the side file, if any."""
    side = set_aside_torn_tail(path)
    append_jsonl(path, record)
    return side


def latest_per_cell(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str | None, int]]:
    """Latest wins: each cell's last record (in file order, at the place of its first), and the
    number of records (attempts) of every cell id (None: cell records without one). Earlier attempts
    stay in the file."""
    attempts: dict[str | None, int] = {}
    latest: dict[str | None, dict[str, Any]] = {}
    order: list[str | None] = []
    for i, r in enumerate(records):
        key: str | None = r.get("cell_id") if r.get("kind", "cell") == "cell" else f"\0{r.get('kind')}-{i}"
        if key not in latest:
            order.append(key)
        latest[key] = r
        if r.get("kind", "cell") == "cell":
            attempts[key] = attempts.get(key, 0) + 1
    return [latest[k] for k in order], attempts


def calibration_medians(records: Iterable[dict[str, Any]]) -> dict[Any, float | None]:
    """Per run id, in file order, the median ``samples.step_time_s`` of the run's first calibration
    record (``kind == "calibration"``: the normaliser workload), or None when it has no samples."""
    out: dict[Any, float | None] = {}
    for r in records:
        if r.get("kind") == "calibration" and r.get("run_id") not in out:
            times = (r.get("samples") or {}).get("step_time_s")
            out[r.get("run_id")] = statistics.median(times) if times else None
    return out


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


def load_any(path: str | Path, warn: TextIO | None = None) -> list[dict[str, Any]]:
    """Load records from a records.jsonl, a run directory or a pytest-benchmark JSON file."""
    if is_benchmark_json(path):
        return load_benchmark_json(path)
    return load_run(path, warn)
