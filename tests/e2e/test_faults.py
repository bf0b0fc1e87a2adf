"""Faults: a sweep survives a rank that dies, hangs or runs out of memory; bad input launches nothing.

One sweep of six 2-rank CPU cells (gloo) carries three injected faults (tests/e2e/inject):
rank 1 SIGKILLs itself mid-step in one cell, SIGSTOPs itself before its gradient all-reduce in
another (rank 0 blocks in the collective until the cell timeout), and allocates past the
``--mem-cap-gib`` limit in a third. Every other cell must still be ``ok``, and no process the
sweep started may outlive it.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness.cli import main

GPUS = "2"
STRATEGIES = "ddp,fsdp,zero2,tp,tp-sp,pp"
CELL_TIMEOUT_S = 300
"""Far above a healthy tiny cell on a shared 2-core box (12-17 s idle, up to ~40 s loaded)."""
STALL_TIMEOUT_S = 8
"""The hang is caught by the stall watchdog: no measured step on a rank for this long (a healthy tiny
step takes well under a second), long before the cell timeout."""
MEM_CAP_GIB = 2
"""Address-space growth each rank may use: tiny cells need far less; the injected 4 GiB does not fit."""
KILLED, STOPPED, OVER_CAP = "ddp", "zero2", "tp-sp"
"""Strategies whose cell gets a fault (rank 1, second train step); the rest must be ok."""
SWEEP_TIMEOUT_S = 540


def _flags() -> list[str]:
    return ["--gpus", GPUS, "--strategies", STRATEGIES, "--no-reference", "--sizes", "tiny", "--steps", "3",
            "--warmup", "1", "--batch", "4", "--device", "cpu"]


@dataclass
class Sweep:
    cli: object
    out: Path
    returncode: int
    stderr: str
    cells: dict[str, str]
    """strategy -> cell id."""
    records: list[dict]
    leftover: list[str]
    wall_s: float
    injected: set[str] = field(default_factory=set)

    def record(self, cell_id: str) -> dict:
        found = [r for r in self.records if r["cell_id"] == cell_id]
        assert len(found) == 1, f"{cell_id}: expected one record, got {len(found)}; stderr:\n{self.stderr[-2000:]}"
        return found[0]

    def after(self, cell_id: str) -> list[dict]:
        ids = [r["cell_id"] for r in self.records]
        return self.records[ids.index(cell_id) + 1:]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, e2e) -> Sweep:
    tmp = tmp_path_factory.mktemp("faults")
    cli = e2e.CLI(tmp)
    cells = {c.raw["strategy"]: c.cell_id for c in e2e.planned(*_flags()) if c.valid}
    assert set(cells) == set(STRATEGIES.split(",")), f"expected every strategy valid at --gpus {GPUS}: {cells}"
    faults = [
        {"cell": cells[KILLED], "rank": 1, "call": 2, "fault": "sigkill"},
        {"cell": cells[STOPPED], "rank": 1, "call": 2, "fault": "sigstop"},
        {"cell": cells[OVER_CAP], "rank": 1, "call": 2, "fault": "alloc", "gib": 4},
    ]
    out = tmp / "run"
    t0 = time.monotonic()
    try:
        res = cli.run("bench", *_flags(), "--no-calibrate", "--cell-timeout", str(CELL_TIMEOUT_S),
                      "--stall-timeout", str(STALL_TIMEOUT_S), "--mem-cap-gib", str(MEM_CAP_GIB), "--out", str(out),
                      timeout=SWEEP_TIMEOUT_S, faults=faults)
        wall = time.monotonic() - t0
        leftover = e2e.survivors(str(out))
    finally:
        e2e.kill_all(str(tmp))
    return Sweep(cli=cli, out=out, returncode=res.returncode, stderr=res.stderr, cells=cells,
                 records=e2e.read_records(out), leftover=leftover, wall_s=wall,
                 injected={cells[KILLED], cells[STOPPED], cells[OVER_CAP]})


@pytest.mark.e2e
@pytest.mark.slow
def test_every_cell_has_one_record_and_healthy_cells_are_ok(sweep):
    assert [r["cell_id"] for r in sweep.records] == list(sweep.cells.values()), "one record per cell, in plan order"
    for r in sweep.records:
        if r["cell_id"] not in sweep.injected:
            assert r["status"] == "ok", f"{r['cell_id']} (no fault injected): {r['status']}: {r['error']}"
    assert sweep.returncode == 1, "a sweep with failed cells exits 1"


@pytest.mark.e2e
@pytest.mark.slow
def test_records_carry_the_models_prediction_even_when_uncalibrated(sweep):
    """Every record, failed ones too, has ``predicted``; the counted bytes of ok cells equal it exactly.

    The sweep ran with --no-calibrate and an empty calibration file: the step time is n/a and says why.
    """
    for r in sweep.records:
        p = r["predicted"]
        assert p["model_state_bytes_per_rank"] > 0 and p["peak_mem_gib"] > 0, r["cell_id"]
        assert p["step_time_s"] is None and any("harness calibrate" in n for n in p["notes"]), p["notes"]
        assert set(r["metrics"]["machine_probe_s"]) == {"before", "after"}, r["cell_id"]  # CPU: failed cells too
        if r["status"] == "ok":
            m = r["metrics"]
            assert p["comm_bytes_per_step"] == m["comm_bytes_per_step"], r["cell_id"]
            assert p["model_state_bytes_per_rank"] == m["model_state_bytes_per_rank"], r["cell_id"]


@pytest.mark.e2e
@pytest.mark.slow
def test_rank_killed_mid_step_is_crashed_naming_rank_and_signal(sweep):
    cell = sweep.cells[KILLED]
    assert sweep.cli.fired(cell, "sigkill"), "the injected SIGKILL never fired; the test proves nothing"
    rec = sweep.record(cell)
    assert rec["status"] == "crashed", rec["error"]
    first_line = rec["error"].splitlines()[0]
    assert "rank 1 " in first_line and "SIGKILL" in first_line, f"must name rank 1 and SIGKILL: {first_line!r}"
    later = [r for r in sweep.after(cell) if r["cell_id"] not in sweep.injected]
    assert later and all(r["status"] == "ok" for r in later), [(r["cell_id"], r["status"]) for r in later]
    assert sweep.returncode == 1
    assert sweep.leftover == [], "processes outlived the sweep:\n" + "\n".join(sweep.leftover)


@pytest.mark.e2e
@pytest.mark.slow
def test_rank_stopped_in_a_collective_times_out_and_is_killed(sweep):
    cell = sweep.cells[STOPPED]
    assert sweep.cli.fired(cell, "sigstop"), "the injected SIGSTOP never fired; the test proves nothing"
    rec = sweep.record(cell)
    assert rec["status"] == "timeout", rec["error"]
    named = re.search(r"no measured step finished for \d+ s on ranks? ([\d, ]+) \(", rec["error"])
    assert named and "1" in named.group(1).split(", "), f"must name the stopped rank 1: {rec['error']!r}"
    assert f"--stall-timeout {STALL_TIMEOUT_S}" in rec["error"], rec["error"]
    assert rec["metrics"]["wall_s"] < CELL_TIMEOUT_S, "the watchdog, not the cell timeout, must end the hang"
    nxt = sweep.after(cell)[0]
    assert nxt["status"] == "ok", f"the cell after the hang ({nxt['cell_id']}): {nxt['status']}: {nxt['error']}"
    stopped = [p for p in sweep.leftover if "[stopped]" in p]
    assert stopped == [] and sweep.leftover == [], "processes outlived the sweep:\n" + "\n".join(sweep.leftover)


@pytest.mark.e2e
@pytest.mark.slow
def test_rank_over_its_memory_cap_is_oom_and_the_sweep_goes_on(sweep):
    cell = sweep.cells[OVER_CAP]
    assert sweep.cli.fired(cell, "alloc"), "the injected allocation never ran; the test proves nothing"
    rec = sweep.record(cell)
    assert rec["status"] == "oom", rec["error"]
    assert rec["error"].startswith("rank 1:") and "allocate memory" in rec["error"], rec["error"]
    nxt = sweep.after(cell)[0]
    assert nxt["status"] == "ok", f"the cell after the oom ({nxt['cell_id']}): {nxt['status']}: {nxt['error']}"


# --- plan and bad input: nothing launched, so fast -------------------------------------------------

def test_plan_lists_each_invalid_cell_with_its_reason(capsys, e2e):
    flags = ["--gpus", "4", "--device", "cpu"]
    assert main(["plan", *flags]) == 0
    printed = capsys.readouterr().out.splitlines()
    cells = e2e.planned(*flags)
    invalid = [c for c in cells if not c.valid]
    assert any(c.raw["strategy"] == "pp+fsdp+tp" for c in invalid), "pp+fsdp+tp cannot run on 4 ranks"
    for c in cells:
        rows = [line for line in printed if f" {c.cell_id} " in line]
        assert len(rows) == 1, f"{c.cell_id}: expected one row in the plan, got {rows}"
        if c.valid:
            assert "invalid" not in rows[0]
        else:
            assert c.reason and "invalid" in rows[0] and c.reason in rows[0], (c.reason, rows[0])


BAD_INPUT = [
    (["--gpus", "0"], "--gpus '0'"),
    (["--gpus", "x"], "--gpus 'x'"),
    (["--steps", "0"], "--steps '0'"),
    (["--sizes", "huge"], "huge"),
    (["--strategies", "pp", "--gpus", "2", "--pp-schedule", "zb", "--compile", "on"], "--pp-schedule zb with --compile on"),
    (["--strategies", "pp", "--gpus", "2", "--pp-schedule", "zbx"], "--pp-schedule 'zbx'"),
]


@pytest.mark.parametrize("command", ["plan", "bench"])
@pytest.mark.parametrize("flags,named", BAD_INPUT, ids=[" ".join(f) for f, _ in BAD_INPUT])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(command, flags, named, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HARNESS_CALIBRATION", str(tmp_path / "calibration.json"))
    out = tmp_path / "run"
    extra = ["--out", str(out), "--no-calibrate"] if command == "bench" else []
    rc = main([command, "--device", "cpu", *flags, *extra])
    cap = capsys.readouterr()
    assert rc == 2
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"harness {command}: error: ") and named in lines[0], cap.err
    assert cap.out == ""
    assert list(tmp_path.iterdir()) == [], "bad input must write nothing"


@pytest.mark.e2e
def test_bad_input_through_the_real_cli(harness_cli, tmp_path):
    out = tmp_path / "run"
    res = harness_cli.run("bench", "--gpus", "x", "--out", str(out), "--no-calibrate", timeout=120)
    assert res.returncode == 2, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert res.stdout == "" and not out.exists()
