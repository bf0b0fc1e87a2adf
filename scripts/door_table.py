"""Print docs/bad-input.md's table: every case of tests/unit/test_inputs_at_the_door.py run as the test runs it, with
its exit status and the line it got, as they are now.

    .venv/bin/python scripts/door_table.py > docs/bad-input.md
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.cli import main  # noqa: E402
from tests.unit.test_inputs_at_the_door import CASES, Case, record, write_files  # noqa: E402

HEAD = """# Bad input: what each kind gets

Every input is checked before anything is launched or written: flags, sweep files and device files by the same
typed checks (finite numbers where a number is meant, TOML booleans for switches, lists that name a value, a flag
that applies to a strategy or precision of the sweep), records by `harness/records/record_shape.py` in every reader. A
refusal is one line on stderr naming the value, where it came from (the flag, or the file and its key) and the fix,
and exit status 2. The kinds below are issue 60's, one row per case of `tests/unit/test_inputs_at_the_door.py`, which
holds each line; `tests/unit/test_input_properties.py` throws generated inputs at the same readers (docs/testing.md).
What a damaged results folder looks like to each reader, and its repair: docs/records.md, "A damaged run".

Produced by `.venv/bin/python scripts/door_table.py > docs/bad-input.md` (each command run in a folder of its own
holding the files named, with a calibration store of its own).

| kind | files | command | exit | the line |
|---|---|---|---|---|
"""


def _record_lines(text: str) -> str | None:
    """Records as how each differs from the test's good one (``record()``), or None when the text is not records."""
    try:
        parsed = [json.loads(line) for line in text.splitlines()]
    except json.JSONDecodeError:
        return None
    good = record()
    if not all(isinstance(r, dict) for r in parsed):
        return None
    said = [json.dumps(r) if not r.keys() & good.keys() else
            ", ".join(f"{k} = {json.dumps(r.get(k))}" for k in sorted(r.keys() | good.keys()) if r.get(k) != good.get(k))
            for r in parsed]
    return "; ".join(f"`{d}`" if d.startswith("{") else f"a record with {d}" if d else "a good record" for d in said)


def _files(case: Case) -> str:
    def shown(name: str, content: str | bytes) -> str:
        text = content.decode("utf-8", "backslashreplace") if isinstance(content, bytes) else content
        if name.endswith(".jsonl") and text.strip() and (records := _record_lines(text)) is not None:
            return records
        return repr(text if len(text) <= 60 else text[:57] + "...")

    return "<br>".join(f"`{name}`: {shown(name, c)}" if c else f"`{name}`: empty" for name, c in case.files.items())


def _run(case: Case) -> tuple[int, str]:
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        os.environ.update(HARNESS_FORCE_CPU="1", HARNESS_CALIBRATION=str(where / "store.json"))
        write_files(case, where)
        err = io.StringIO()
        before = os.getcwd()
        os.chdir(where)
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                try:
                    rc = main(list(case.argv))
                except SystemExit as e:
                    rc = int(e.code or 0)
        finally:
            os.chdir(before)
        return rc, err.getvalue().strip().replace(tmp + "/", "").replace("|", "\\|")


def main_table() -> None:
    sys.stdout.write(HEAD)
    for case in CASES:
        rc, line = _run(case)
        print(f"| {case.kind} | {_files(case).replace('|', chr(92) + '|')} | `harness {' '.join(case.argv)}` | {rc} "
              f"| {line} |")


if __name__ == "__main__":
    main_table()
