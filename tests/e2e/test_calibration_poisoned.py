"""A poisoned calibration is not reused silently: the run names it after the first cell it mispredicts.

``harness calibrate`` fills a fresh store with what the single-device cell reads (the matmul peak and the tiny
workload; no collectives: one rank; a first bench calibrated the same and ran a cell besides, issue 43); the test
then makes its tiny workload entry 30x slower, evenly
(every pass and repeat, so its own spread stays steady and the store's checks cannot see it: the case
of a calibration taken while a neighbour slowed every repeat alike). The next bench predicts the cell
~30x too slow, and its stderr must name the entry, its age and the command that re-measures it.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import TINY

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
CELL = [*[a for a in TINY if a != "--no-calibrate"], "--gpus", "1", "--strategies", "single"]
POISON = 30.0


def _slower(value, factor: float):
    """Every time in a workload entry (``*_s``, ``*_s_per_*`` numbers and their lists) times ``factor``."""
    if isinstance(value, dict):
        return {k: (_slower(v, factor) if "_s" in k or k == "repeats" or isinstance(v, dict) else v)
                for k, v in value.items()}
    if isinstance(value, list):
        return [_slower(v, factor) for v in value]
    return value * factor if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def test_a_poisoned_workload_entry_is_named_after_the_cell_it_mispredicts(harness_cli):
    first = harness_cli.run("calibrate", "--device", "cpu", "--no-comm", "--workloads", "tiny", timeout=420, log="first")
    assert first.returncode == 0, first.stderr[-2000:]
    store = harness_cli.tmp / "calibration.json"
    entries = json.loads(store.read_text())
    poisoned = [k for k, e in entries.items() if e.get("kind") == "workload" and e.get("size") == "tiny"]
    assert poisoned, f"no tiny workload entry in {list(entries)}"
    for k in poisoned:  # evenly slower, so steady: also when this busy machine made the first one unsteady
        entries[k] = {**_slower(entries[k], POISON), "unsteady": False}
        entries[k].pop("unsteady_reason", None)
    store.write_text(json.dumps(entries))

    second = harness_cli.run("bench", *CELL, "--out", str(harness_cli.tmp / "second"), timeout=420, log="second")
    assert second.returncode == 0, second.stderr[-2000:]
    note = [line for line in second.stderr.splitlines() if "than predicted" in line]
    assert note, f"no misprediction note on stderr:\n{second.stderr[-2000:]}"
    assert "faster than predicted" in note[0] and "tiny" in note[0] and "measured " in note[0], note[0]
    assert "harness calibrate --force" in note[0], note[0]
