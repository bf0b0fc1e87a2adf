"""Ctrl-C mid-sweep keeps every finished record byte for byte; ``--resume DIR`` finishes the rest.

The resume is given no sweep flags: the run directory must be enough to re-plan the same cells
(the interrupt message tells the user exactly ``harness bench --resume DIR``).
"""

from __future__ import annotations

import signal
import time

import pytest

FLAGS = ["--gpus", "2", "--strategies", "ddp,fsdp,zero2", "--no-reference", "--sizes", "tiny", "--steps", "3",
         "--warmup", "1", "--batch", "4", "--device", "cpu"]
FIRST_RECORD_TIMEOUT_S = 240


def _first_cell_line(path) -> bytes | None:
    """The first complete ``kind == cell`` line of records.jsonl, as bytes."""
    import json

    if not path.exists():
        return None
    for line in path.read_bytes().splitlines(keepends=True):
        if line.endswith(b"\n") and json.loads(line).get("kind") == "cell":
            return line
    return None


@pytest.mark.e2e
@pytest.mark.slow
def test_sigint_keeps_finished_records_and_resume_finishes_the_rest(harness_cli, e2e):
    planned = [c.cell_id for c in e2e.planned(*FLAGS) if c.valid]
    assert len(planned) >= 3
    out = harness_cli.tmp / "run"
    records = out / "records.jsonl"
    proc = harness_cli.popen("bench", *FLAGS, "--no-calibrate", "--out", str(out), log="interrupted")
    try:
        deadline = time.monotonic() + FIRST_RECORD_TIMEOUT_S
        while (first := _first_cell_line(records)) is None:
            assert proc.poll() is None, f"harness exited ({proc.returncode}) before the first cell record:\n" \
                                        f"{harness_cli.stderr('interrupted')[-2000:]}"
            assert time.monotonic() < deadline, "no cell record within the time limit"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)  # the harness alone, as a terminal's Ctrl-C would reach it first
        rc = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 130, harness_cli.stderr("interrupted")[-2000:]
    assert f"--resume {out}" in harness_cli.stderr("interrupted")
    assert e2e.survivors(str(out)) == [], "the interrupted cell's job outlived the harness"

    import json

    first_id = json.loads(first)["cell_id"]
    assert first_id == planned[0]
    assert first in records.read_bytes().splitlines(keepends=True), "the finished record changed or vanished"
    result_mtime = (out / "cells" / first_id / "result.json").stat().st_mtime_ns
    before = records.read_bytes()

    res = harness_cli.run("bench", "--resume", str(out), "--no-calibrate", timeout=420, log="resume")
    assert res.returncode == 0, res.stderr[-3000:]
    after = records.read_bytes()
    assert after.startswith(before), "resume must only append to records.jsonl"
    assert after.splitlines(keepends=True).count(first) == 1
    assert (out / "cells" / first_id / "result.json").stat().st_mtime_ns == result_mtime, "the finished cell re-ran"

    cells = e2e.read_records(out)
    ok = [r["cell_id"] for r in cells if r["status"] == "ok"]
    assert sorted(ok) == sorted(planned), f"every planned cell ok exactly once: ok={ok}, planned={planned}"
    assert [r["cell_id"] for r in cells].count(first_id) == 1
    assert all(r["run_id"] == cells[0]["run_id"] for r in cells), "a resumed run keeps its run id"
    assert e2e.survivors(str(out)) == []
