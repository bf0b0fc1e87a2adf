"""The calibration store: one JSON file of measured entries, one key, one read-modify-write.

Every calibration (matmul peak, collective bus bandwidth, workload passes) is an entry keyed
by :func:`key` of its kind and fingerprint (what makes a measurement reusable: device, dtype,
thread count, torch, ...). A changed machine gets a new key and is re-measured, never reused.

The file is ``~/.cache/harness/calibration.json`` unless ``HARNESS_CALIBRATION`` names another.
:func:`put` holds an exclusive ``flock`` on a lock file beside it for the whole
read-modify-write and replaces the file atomically, so two processes calibrating at once both
keep their entries, and a reader never sees half a file.
"""

from __future__ import annotations

import copy
import fcntl
import functools
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from harness.errors import UsageError
from harness.records.atomic import write_json_atomic
from harness.records.fingerprint import digest

KINDS = ("matmul", "comm", "workload", "storage", "ops")
ENV = "HARNESS_CALIBRATION"
"""Names the calibration file instead of ``~/.cache/harness/calibration.json``."""


def default_path() -> Path:
    env = os.environ.get(ENV)
    return Path(env) if env else Path.home() / ".cache" / "harness" / "calibration.json"


def unwritable(path: Path) -> str | None:
    """Why the store at ``path`` cannot be written (its folder or lock file), or None when it can."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "a"):
            pass
        if path.is_dir():
            return f"{path} is a folder, not a file"
        if path.exists() and not os.access(path, os.W_OK):
            return f"{path} is read-only"
    except OSError as e:
        return f"{e.strerror}: {e.filename}"
    return None


def key(kind: str, fp: dict) -> str:
    """The entry's key. Matmul entries predate kinds: their key hashes the fingerprint alone, so
    caches written before kinds existed stay valid; the other kinds hash ``{"kind": kind, **fp}``."""
    if kind not in KINDS:
        raise ValueError(f"unknown calibration kind {kind!r}; choose from {', '.join(KINDS)}")
    return digest(fp if kind == "matmul" else {"kind": kind, **fp})


def _read(path: Path) -> dict:
    """The store's entries by key; a store that is not a JSON object of entries (a folder, another file, a damaged
    write) is a UsageError naming it and the fix, for every command that reads it."""
    if not path.exists():
        return {}
    fix = f"move it aside to re-measure, or set {ENV} to another file"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"calibration store {path} is not valid JSON ({e}); {fix}") from None
    except OSError as e:
        raise UsageError(f"calibration store {path} cannot be read ({e.strerror}); {fix}") from None
    if not isinstance(doc, dict) or not all(isinstance(v, dict) for v in doc.values()):
        raise UsageError(f"calibration store {path} is not a JSON object of calibration entries; {fix}")
    return doc


@functools.lru_cache(maxsize=4)
def _parsed(path: str, mtime_ns: int, size: int) -> dict:
    """The file's entries, parsed once per version of the file (a plan looks up many cells)."""
    return _read(Path(path))


def get(kind: str, fp: dict, path: Path | None = None) -> dict | None:
    """A copy of the stored entry of this kind and fingerprint, or None."""
    entry = by_key(key(kind, fp), path)
    return entry if entry is not None and entry.get("kind", "matmul") == kind else None


def entries(kind: str, path: Path | None = None) -> list[dict]:
    """Copies of every stored entry of ``kind``."""
    path = path or default_path()
    try:
        st = path.stat()
    except FileNotFoundError:
        return []
    return [copy.deepcopy(e) for e in _parsed(str(path), st.st_mtime_ns, st.st_size).values()
            if e.get("kind", "matmul") == kind]


def by_key(entry_key: str, path: Path | None = None) -> dict | None:
    """A copy of the stored entry under ``entry_key`` (:func:`key`), or None."""
    path = path or default_path()
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    entry = _parsed(str(path), st.st_mtime_ns, st.st_size).get(entry_key)
    return copy.deepcopy(entry) if entry is not None else None


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def put(kind: str, fp: dict, entry: dict, path: Path | None = None) -> dict:
    """Store ``entry`` (its ``fingerprint`` set to ``fp``; ``kind`` set unless matmul) and return it."""
    path = path or default_path()
    stored = {**entry, "fingerprint": fp}
    if kind != "matmul":
        stored["kind"] = kind
    with _locked(path):
        entries = _read(path)
        entries[key(kind, fp)] = stored
        write_json_atomic(path, entries)
    return stored
