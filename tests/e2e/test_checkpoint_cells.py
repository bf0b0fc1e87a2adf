"""Checkpoint cells end to end: ``harness bench --checkpoint sync,async`` under FSDP (sharded state) and an
interleaved pipeline (two stages per rank) at 2 CPU ranks; each cell's saves, bytes and restore check in its
record and in summary.md, and no checkpoint left behind."""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import HarnessCLI, kill_all

pytestmark = pytest.mark.e2e
SWEEP = ["--device", "cpu", "--gpus", "2", "--sizes", "tiny", "--strategies", "fsdp,pp", "--pp-schedule",
         "interleaved1f1b", "--checkpoint", "sync,async", "--checkpoint-every", "2", "--steps", "4", "--warmup", "1",
         "--batch", "8", "--no-calibrate", "--no-reference"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("checkpoint")
    cli = HarnessCLI(tmp)
    try:
        res = cli.run("bench", *SWEEP, "--out", str(tmp / "run"), timeout=600)
    finally:
        kill_all(str(tmp))
    assert res.returncode == 0, res.stderr[-3000:]
    records = [json.loads(line) for line in (tmp / "run" / "records.jsonl").read_text().splitlines()]
    return tmp / "run", {r["cell_id"]: r for r in records if r["kind"] == "cell"}


def test_every_layout_and_mode_saves_twice_and_restores_the_state_whole(run):
    out, cells = run
    assert sorted(cells) == ["tiny-fsdp-fp32-w2-gb8-strong-ckpt-async2", "tiny-fsdp-fp32-w2-gb8-strong-ckpt-sync2",
                             "tiny-pp-fp32-w2-gb8-strong-interleaved1f1b-m4-ckpt-async2",
                             "tiny-pp-fp32-w2-gb8-strong-interleaved1f1b-m4-ckpt-sync2"]
    for cell_id, rec in cells.items():
        assert rec["status"] == "ok", (cell_id, rec.get("error"))
        ck = rec["metrics"]["checkpoint"]
        assert ck["mode"] == rec["config"]["checkpoint"] and ck["every"] == 2 and ck["saves"] == 2  # 4 steps / 2
        assert len(ck["blocking_s"]) == 2 and all(b > 0 for b in ck["blocking_s"])
        assert (ck["background_s_median"] is not None) == (ck["mode"] == "async"), cell_id
        # each rank wrote its own shard or stages: parameters and AdamW's moments, DCP's headers beside them
        assert len(ck["bytes_written_by_rank"]) == 2 and all(b > 0 for b in ck["bytes_written_by_rank"])
        assert 1.0 <= ck["written_over_states"] < 1.1, (cell_id, ck["written_over_states"])
        # the save after measured step 2 (step 2 with one warmup step) reloaded, steps 3-4 run again: same losses
        assert ck["restore"]["from_step"] == 2 and ck["restore"]["steps_replayed"] == 2
        assert ck["restore"]["loss_max_abs_diff"] == 0.0, cell_id
        assert ck["restore"]["bytes_read_by_rank"] == ck["bytes_written_by_rank"]
        assert not (out / "cells" / cell_id / "checkpoints").exists(), "saves are removed once measured"


def test_the_summary_prices_each_cells_saves(run):
    out, cells = run
    section = (out / "summary.md").read_text().split("## Checkpoints: what a save costs")[1]
    for cell_id in cells:
        assert f"| {cell_id}" in section
    assert "| fsdp (ckpt async)" in section and "| pp (interleaved1f1b, ckpt sync)" in section
