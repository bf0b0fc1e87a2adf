"""Where a cell starts and what a restart cost (harness/run/resume.py), with expected values worked by hand: which
save a resumed cell takes, when the cut attempt ended, goodput from its parts, a restored cell's steps against the
source's, and the launcher's record of the last heartbeat."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from harness.errors import UsageError
from harness.run import heartbeat
from harness.run.checkpoint_metrics import start_summary
from harness.run.resume import (
    CURVE,
    Progress,
    Start,
    against_source,
    check_same_training,
    ended_attempts,
    find_start,
    last_beat,
    losses_against,
    own_checkpoint,
    resume_metrics,
    source_curve,
    source_error,
    start_metrics,
    write_curve,
)
from harness.spec import CellConfig, cell_id_of

CELL = CellConfig(size="tiny", strategy="fsdp", precision="fp32", world_size=2, global_batch=8, seq_len=64,
                  steps=6, warmup=1, device_kind="cpu", checkpoint="sync", checkpoint_every=2).to_dict()


def _save(root: Path, step: int, cell: dict, world: int = 2, ranks: int | None = None, saved_at: float = 0.0) -> Path:
    """A save as DCP and the worker leave it: ``.metadata`` and a progress file for ``ranks`` of ``world`` ranks."""
    path = root / f"step-{step:06d}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    for r in range(world if ranks is None else ranks):
        Progress(step, cell, [0.5] * (step + 1), [0.4] * (step + 1), [3.0 - 0.1 * i for i in range(step + 1)],
                 {"grad_norm": 1.0}, [{"started_at": 100.0, "ended_at": None}], saved_at).write(path, r)
    return path


def test_a_resume_takes_the_newest_save_that_is_complete_and_its_own_cells(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, 2, CELL)
    four = _save(root, 4, CELL)
    _save(root, 6, CELL, ranks=1)  # rank 1 never wrote its progress: the save was cut
    _save(root, 8, {**CELL, "steps": 10})  # another cell's (an edited sweep under the same id)
    assert own_checkpoint(root, CELL, world=2) == four
    assert own_checkpoint(root, CELL, world=4) is None  # rank 2 and 3's progress missing: not this world's save
    assert own_checkpoint(tmp_path / "none", CELL, world=2) is None


def test_where_a_cell_starts(tmp_path):
    cell_dir = tmp_path / "cell"
    _save(cell_dir / "checkpoints", 4, CELL, saved_at=120.0)
    source = _save(tmp_path / "other", 2, CELL)
    start = find_start({**CELL, "restore_from": None}, cell_dir, 2, 1, started_at=200.0)
    assert (start.kind, start.first_step, start.offset, start.progress.step) == ("resume", 5, 0, 4)
    # a restored cell cut after a save of its own resumes from that, not from --restore-from's
    restored_cell = {**CELL, "restore_from": str(source)}
    _save(tmp_path / "restored" / "checkpoints", 6, restored_cell)
    own = find_start(restored_cell, tmp_path / "restored", 2, 0, started_at=200.0)
    assert (own.kind, own.first_step) == ("resume", 7)
    assert find_start(restored_cell, cell_dir, 2, 0, 200.0).kind == "restore"  # the other cell's save is not its own
    write_curve(cell_dir / "checkpoints", [3.0] * 7)  # the cell finished before (its kept saves): step 0 again
    assert find_start(CELL, cell_dir, 2, 0, 200.0).kind == "fresh"
    restored = find_start(restored_cell, cell_dir, 2, 0, 200.0)
    assert (restored.kind, restored.first_step, restored.offset) == ("restore", 0, 3)  # step 0 is the source's 3
    assert find_start({**CELL, "checkpoint": "off"}, tmp_path / "empty", 2, 0, 200.0) == Start(started_at=200.0)


def test_the_cut_attempt_ended_at_its_last_step_after_the_save():
    p = Progress(4, CELL, [], [], [], {}, [{"started_at": 50.0, "ended_at": 80.0}, {"started_at": 100.0,
                                                                                    "ended_at": None}], 120.0)
    assert ended_attempts(p, beat=131.5)[-1] == {"started_at": 100.0, "ended_at": 131.5}
    assert ended_attempts(p, beat=110.0)[-1]["ended_at"] == 120.0  # a beat before the save: an older job's
    assert ended_attempts(p, beat=None)[-1]["ended_at"] == 120.0
    assert ended_attempts(p, beat=131.5)[0] == {"started_at": 50.0, "ended_at": 80.0}  # earlier ones as they were


def test_goodput_is_each_step_once_over_every_attempts_wall_time():
    """Attempt 1 ran 100-135 s, saved after step 4 at 120 s (15 s of work after it lost); attempt 2's process
    started at 200 s, ran its first step at 206 s (6 s restart) and closed its window at 216 s: 35 + 16 = 51 s of
    wall time for 7 steps of 2 s (14 s productive)."""
    p = Progress(4, CELL, [], [], [], {}, [{"started_at": 100.0, "ended_at": None}], saved_at=120.0)
    attempts = ended_attempts(p, beat=135.0)
    m = resume_metrics(p, attempts, started_at=200.0, resumed_at=206.0, window_end=216.0, times=[2.0] * 7)
    assert m == {"from_step": 4, "attempt": 2, "lost_s": 15.0, "restart_s": 6.0, "productive_s": 14.0,
                 "wall_s": 51.0, "goodput": pytest.approx(14 / 51)}
    start = Start("resume", Path("x"), p, attempts, 200.0, {"load_s": 1.5, "bytes_read": 10})
    assert start_metrics(start, [2.0] * 7, 206.0, 216.0) == {"kind": "resume", "load_s": 1.5, "bytes_read": 10, **m}


def test_a_restored_cells_step_i_is_the_sources_step_offset_plus_i():
    source = [5.0, 4.0, 3.0, 2.5, None, 2.0]  # a step without a loss is not compared
    assert losses_against(source, [2.5 + 1e-3, 9.0, 2.0 - 2e-3, 1.0], offset=3) == {
        "steps_compared": 2, "loss_max_abs_diff": pytest.approx(2e-3)}  # step 4 has no source loss, 6 is past it
    assert losses_against([], [1.0], offset=0) == {"steps_compared": 0, "loss_max_abs_diff": None}


def test_a_restore_source_must_be_a_complete_save_of_the_same_training(tmp_path):
    path = _save(tmp_path, 2, CELL)
    assert source_error(path) is None
    (path / ".metadata").unlink()
    assert "not a complete harness checkpoint (no .metadata or harness-rank0.json)" in source_error(path)
    path = _save(tmp_path / "b", 2, CELL)
    check_same_training(path, [{**CELL, "world_size": 4, "strategy": "fsdp+tp"}])  # another layout: its purpose
    with pytest.raises(UsageError, match=rf"cell {cell_id_of({**CELL, 'global_batch': 16})} \(global_batch 8 there, "
                                         r"16 here\)"):
        check_same_training(path, [CELL, {**CELL, "global_batch": 16}])
    check_same_training(path, [{**CELL, "precision": "bf16"}])  # fp32 state into bf16 autocast: loads
    with pytest.raises(UsageError, match="precision 'fp32' there, 'fp16' here: an fp16 cell loads the loss scale"):
        check_same_training(path, [{**CELL, "precision": "fp16"}])


def test_the_launcher_keeps_when_the_last_step_ended(tmp_path):
    beat = heartbeat.Heartbeat(tmp_path, 0)
    beat.open_window()
    other = heartbeat.Heartbeat(tmp_path, 1)
    other.open_window()
    os.utime(beat.path, (1000.0, 1000.0))
    os.utime(other.path, (1234.5, 1234.5))
    heartbeat.clear(tmp_path)
    assert heartbeat.heartbeat_files(tmp_path) == []
    assert json.loads((tmp_path / heartbeat.LAST_BEAT).read_text()) == {"epoch": 1234.5}
    heartbeat.clear(tmp_path)  # no beats: the last one stays
    assert json.loads((tmp_path / heartbeat.LAST_BEAT).read_text()) == {"epoch": 1234.5}


def test_the_record_takes_the_restart_as_the_worst_rank_saw_it():
    base = {"kind": "resume", "from_step": 4, "load_s": 1.0, "bytes_read": 10, "attempt": 2, "lost_s": 3.0,
            "restart_s": 5.0, "productive_s": 10.0, "wall_s": 20.0, "goodput": 0.5}
    worse = {**base, "load_s": 2.0, "bytes_read": 12, "restart_s": 6.0, "wall_s": 25.0, "goodput": 0.4}
    s = start_summary([base, worse])
    assert s == {"kind": "resume", "from_step": 4, "load_s": 2.0, "bytes_read_by_rank": [10, 12], "attempt": 2,
                 "lost_s": 3.0, "restart_s": 6.0, "productive_s": 10.0, "wall_s": 25.0, "goodput": 0.4}
    restore = start_summary([{"kind": "restore", "from_step": 2, "load_s": 0.5, "source_bytes": 99, "source": "p"}])
    assert restore == {"kind": "restore", "from_step": 2, "load_s": 0.5, "source_bytes": 99, "source": "p"}


def test_a_restored_cell_is_named_by_the_step_it_starts_after(tmp_path):
    assert cell_id_of({**CELL, "restore_from": "/runs/a/step-000010"}).endswith("-ckpt-sync2-from10")
    with pytest.raises(UsageError, match="checkpoint_keep keeps the saves of a cell that checkpoints"):
        CellConfig.from_dict({**CELL, "checkpoint": "off", "checkpoint_keep": True})
    assert CURVE == "curve.json"


def test_a_restored_cell_reads_the_sources_curve_and_says_where_it_came_from(tmp_path):
    """Issue 61: the round trip held by value: rank 0 writes the curve beside the kept saves, a cell restored from
    one of them reads it and holds its own losses against the source's from the step after the save."""
    root = tmp_path / "source" / "checkpoints"
    path = _save(root, 2, CELL, saved_at=50.0)
    write_curve(root, [3.0, 2.5, 2.0, 1.5, 1.25])
    assert json.loads((root / CURVE).read_text()) == {"losses": [3.0, 2.5, 2.0, 1.5, 1.25]}
    start = find_start({**CELL, "restore_from": str(path)}, tmp_path / "cell", 2, 1, started_at=300.0)
    assert (start.kind, start.path, start.started_at, start.progress.step) == ("restore", path, 300.0, 2)
    assert start.progress == Progress.read(path, 0)  # the source's rank 0's, whichever rank reads it
    assert against_source(start, [1.5 + 0.25, 1.25]) == {"steps_compared": 2, "loss_max_abs_diff": 0.25}
    assert source_curve(tmp_path / "nowhere" / "step-000002") == []
    m = start_metrics(Start("restore", path, start.progress, [], 300.0, {"load_s": 0.5}), [1.0], 301.0, 302.0)
    assert m == {"kind": "restore", "load_s": 0.5, "from_step": 2, "source": str(path)}
    assert start_metrics(Start(started_at=1.0), [1.0], 2.0, 3.0) == {"kind": "fresh"}


def test_a_resumed_attempt_ends_at_the_last_beat_the_launcher_kept(tmp_path):
    cell_dir = tmp_path / "cell"
    _save(cell_dir / "checkpoints", 4, CELL, saved_at=120.0)
    assert last_beat(cell_dir) is None
    (cell_dir / heartbeat.LAST_BEAT).write_text(json.dumps({"epoch": 131.5}))
    assert last_beat(cell_dir) == 131.5
    start = find_start(CELL, cell_dir, 2, 0, started_at=200.0)
    assert start.attempts == [{"started_at": 100.0, "ended_at": 131.5}] and start.started_at == 200.0
    assert start.attempts_now() == [{"started_at": 100.0, "ended_at": 131.5}, {"started_at": 200.0, "ended_at": None}]
    assert Progress.read(cell_dir / "checkpoints" / "step-000004", 7) is None  # no such rank's progress
    p = Progress(4, CELL, [], [], [], {}, [{"started_at": 100.0, "ended_at": None}], saved_at=120.0)
    equal = ended_attempts(p, beat=120.0)  # a beat at the save itself is the attempt's end
    assert equal[-1]["ended_at"] == 120.0
    none = resume_metrics(p, [{"started_at": None, "ended_at": None}], started_at=5.0, resumed_at=5.0,
                          window_end=5.0, times=[])  # no wall time at all: goodput is not a number
    assert none["goodput"] is None and none["lost_s"] == 0.0 and none["wall_s"] == 0.0
