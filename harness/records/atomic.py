"""Atomic writes: whole files via temp + rename, records via append + flush + fsync."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    """Write via a temp file in the same directory and ``os.replace``: readers never see half a file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    # A unique name opened with "xb" (not mkstemp) keeps the umask's usual permissions.
    tmp = p.with_name(f".{p.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with tmp.open("xb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)  # remove the partial temp file, then let the error propagate
        raise
    return p


def write_text_atomic(path: str | Path, text: str) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


def append_jsonl(path: Path, obj: dict) -> None:
    """One record per line; a crash mid-write can leave at most a torn last line, never lose earlier ones."""
    line = json.dumps(obj, sort_keys=False, allow_nan=False) + "\n"
    with open(path, "a") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())
