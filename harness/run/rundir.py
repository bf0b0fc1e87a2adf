"""A run directory: created or resumed, never overwritten; its sweep flags kept for ``--resume``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from harness.errors import UsageError
from harness.records.atomic import write_json_atomic
from harness.records.reader import RECORDS_FILENAME, TornTail, load_records
from harness.records.record import new_run_id

SWEEP_ARGS_FILE = "sweep_args.json"
"""A run's sweep flags, so that ``harness bench --resume DIR`` alone re-plans the same cells."""


def prepare_out(out: Path, resume: bool, node_rank: int) -> Path:
    """A run directory is never overwritten: refuse a used one unless resuming it."""
    records = out / RECORDS_FILENAME
    if node_rank == 0 and not resume and records.exists() and records.stat().st_size > 0:
        raise UsageError(f"--out {out} already holds records; pass a new --out, or --resume {out} to finish it")
    if resume and not records.exists():
        raise UsageError(f"--resume {out}: no records.jsonl there; start a new run with --out {out}")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"--out {out} is not writable ({e.strerror}); choose a writable directory") from None
    return out


def set_aside_torn_tail(torn: TornTail) -> Path:
    """Move a torn last line to ``records.jsonl.torn`` (appended, nothing lost) and cut it from the records."""
    side = torn.path.with_name(torn.path.name + ".torn")
    with open(torn.path, "r+b") as f:
        f.seek(torn.offset)
        tail = f.read()
        with open(side, "ab") as s:
            s.write(tail + b"\n")
            s.flush()
            os.fsync(s.fileno())
        f.truncate(torn.offset)
        f.flush()
        os.fsync(f.fileno())
    return side


def existing_records(out: Path) -> list[dict]:
    """The records of a run being resumed; a torn last line is set aside first (its cell re-runs)."""
    if not (out / RECORDS_FILENAME).exists():
        return []
    try:
        return load_records(out)
    except TornTail as torn:
        side = set_aside_torn_tail(torn)
        print(f"resume: the last line of {torn.path} was torn by an interrupted write; moved it to {side}",
              file=sys.stderr, flush=True)
        return load_records(out)


def save_sweep_args(out: Path, values: dict) -> None:
    """Keep the run's sweep flags (``values``: flag dest -> value as given)."""
    write_json_atomic(out / SWEEP_ARGS_FILE,
                      {k: str(Path(v).resolve()) if isinstance(v, Path) else v for k, v in values.items()})


def recorded_sweep_args(out: Path) -> dict:
    """The sweep flags a run was started with; empty for a directory from before flags were recorded."""
    path = out / SWEEP_ARGS_FILE
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"{path} is unreadable ({e}); give the sweep flags again with --resume {out}") from None


def start_run(out: Path | None, resume: Path | None, node_rank: int) -> tuple[Path, str, bool]:
    """(run directory, run id, resuming): a resumed run keeps its run id."""
    if resume is not None:
        recs = existing_records(resume)
        run_id = recs[0]["run_id"] if recs else new_run_id()
        return prepare_out(resume, True, node_rank), run_id, True
    run_id = new_run_id()
    out = out or Path("results") / run_id
    return prepare_out(out, False, node_rank), run_id, False
