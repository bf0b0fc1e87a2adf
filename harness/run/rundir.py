"""A run directory: created or resumed, never overwritten, one writer at a time; its sweep flags
kept for ``--resume``.

One harness per node holds an exclusive ``flock`` on the directory's lock file for the run's
lifetime, with its pid, host and start time in it: a second ``bench`` or ``--resume`` on the
same directory is refused (exit 2) naming the holder. The kernel drops the lock when its
process dies, so a lock left by a killed run is taken over, with a warning.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from harness.errors import UsageError
from harness.records.atomic import write_json_atomic
from harness.records.reader import RECORDS_FILENAME, load_records
from harness.records.record import new_run_id

SWEEP_ARGS_FILE = "sweep_args.json"
"""A run's sweep flags, so that ``harness bench --resume DIR`` alone re-plans the same cells."""


def check_writable(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"--out {out} is not writable ({e.strerror}); choose a writable directory") from None


@dataclass
class RunLock:
    """The held lock of one run directory (released by :meth:`release`, or by the process's death)."""

    path: Path
    file: IO[str]

    def release(self) -> None:
        self.file.truncate(0)  # a cleanly released lock leaves no holder to report
        self.file.flush()
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


def _holder(text: str) -> str:
    try:
        h = json.loads(text)
        return f"pid {h['pid']} on {h['host']}, started {h['started']}"
    except (json.JSONDecodeError, KeyError, TypeError):
        return "a process that has not written its pid yet"


def lock_run(out: Path, node_rank: int = 0) -> RunLock:
    """Hold ``out``'s lock for this process (one per node rank), or refuse with the holder named."""
    path = out / (".harness.lock" if node_rank == 0 else f".harness.lock-node{node_rank}")
    f = open(path, "a+")  # held open for the run's lifetime: the flock lives on this file
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = _holder(f.read())
        f.close()
        raise UsageError(f"{out} is in use by another harness run ({holder}); wait for it to finish, "
                         f"or choose another --out") from None
    f.seek(0)
    stale = f.read().strip()
    if stale:
        print(f"warning: {out}: taking over the lock of a run that is gone ({_holder(stale)})",
              file=sys.stderr, flush=True)
    f.seek(0)
    f.truncate(0)
    f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}))
    f.flush()
    return RunLock(path, f)


def existing_records(out: Path) -> list[dict]:
    """The records of a run being resumed (a torn last line is reported, and set aside by the next append)."""
    return load_records(out) if (out / RECORDS_FILENAME).exists() else []


def save_sweep_args(out: Path, values: dict) -> None:
    """Keep the run's sweep flags (``values``: flag dest -> value as given)."""
    write_json_atomic(out / SWEEP_ARGS_FILE, _as_recorded(values))


def recorded_sweep_args(out: Path) -> dict:
    """The sweep flags a run was started with; empty for a directory from before flags were recorded."""
    path = out / SWEEP_ARGS_FILE
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"{path} is unreadable ({e}); give the sweep flags again with --resume {out}") from None


def check_resumable(out: Path, values: dict) -> None:
    """``--resume DIR`` finishes exactly the sweep DIR recorded: refused when DIR holds no records file or no recorded
    sweep flags (its cells cannot be known), or when ``values`` (the sweep flags given, by dest) change its sweep."""
    if not (out / RECORDS_FILENAME).exists():
        raise UsageError(f"--resume {out}: no {RECORDS_FILENAME} there, so there is no run to finish; start one with "
                         f"harness bench --out {out}")
    held = recorded_sweep_args(out)
    if not held:
        raise UsageError(f"--resume {out}: the run recorded no sweep flags ({SWEEP_ARGS_FILE}), so its cells cannot "
                         f"be known; start the sweep again with harness bench --out <new dir> and its flags")
    existing_records(out)  # a damaged or foreign record is refused here, before the run's lock is taken
    given = _as_recorded(values)
    differ = sorted(k for k in given if held.get(k) != given[k])
    if differ:
        what = ", ".join(f"--{k.replace('_', '-')} {_shown(given, k)} here, {_shown(held, k)} there" for k in differ)
        raise UsageError(f"--resume {out} with flags that change its sweep ({what}); a resumed run finishes its own "
                         f"sweep: harness bench --resume {out} (no sweep flags), or start this sweep with --out <new "
                         f"dir>")


def _as_recorded(values: dict) -> dict:
    """Sweep flag values as :func:`save_sweep_args` keeps them (paths resolved, JSON types)."""
    return json.loads(json.dumps({k: str(Path(v).resolve()) if isinstance(v, Path) else v
                                  for k, v in values.items()}))


def holds_records(out: Path) -> bool:
    """Whether ``out`` already holds records (an empty records file is a run that measured nothing)."""
    records = out / RECORDS_FILENAME
    return records.exists() and records.stat().st_size > 0


def _shown(values: dict, key: str) -> str:
    return repr(values[key]) if key in values else "unset"


def check_same_sweep(out: Path, values: dict) -> None:
    """Refuse to continue ``out`` unless it was started with these sweep flags (``values``, by dest).

    What a requeued or resubmitted scheduler job needs: the same command finishes its own sweep,
    and a directory holding another sweep is never mixed into it.
    """
    held = recorded_sweep_args(out)
    if not held:
        raise UsageError(f"--out {out} holds records without recorded sweep flags ({SWEEP_ARGS_FILE}), so its sweep "
                         f"cannot be known; pass a new --out")
    given = _as_recorded(values)
    differ = sorted(k for k in held.keys() | given.keys() if held.get(k) != given.get(k))
    if differ:
        what = ", ".join(f"--{k.replace('_', '-')} {_shown(held, k)} there, {_shown(given, k)} here" for k in differ)
        raise UsageError(f"--out {out} holds a different sweep ({what}); pass a new --out, or --resume {out} "
                         f"to finish that sweep")


@dataclass
class Run:
    out: Path
    run_id: str
    resume: bool
    lock: RunLock


def start_run(out: Path | None, resume: Path | None, node_rank: int) -> Run:
    """Create (or reopen, for ``--resume``) the run directory and hold its lock.

    The lock is taken before the directory's records are looked at, so two runs started at once
    into one ``--out`` cannot both find it empty. A resumed run keeps its run id.
    """
    run_id = new_run_id()
    out = resume if resume is not None else out or Path("results") / run_id
    records = out / RECORDS_FILENAME
    if resume is not None and not records.exists():
        raise UsageError(f"--resume {out}: no records.jsonl there; start a new run with --out {out}")
    check_writable(out)
    lock = lock_run(out, node_rank)
    try:
        if resume is None and node_rank == 0 and holds_records(out):
            finish = f", or --resume {out} to finish it" if recorded_sweep_args(out) else ""
            raise UsageError(f"--out {out} already holds records; pass a new --out{finish}")
        if resume is not None:
            recs = existing_records(out)
            run_id = recs[0]["run_id"] if recs else run_id
    except BaseException:
        lock.release()
        raise
    return Run(out, run_id, resume is not None, lock)
