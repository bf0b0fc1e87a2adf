"""Checkpoints: a save and a restore through torch.distributed.checkpoint on one gloo rank (the state comes back
whole, training after it is the same), the bytes a rank wrote, and the record's numbers by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from harness.errors import UsageError
from harness.model.checkpoint_cost import checkpoint_bytes_by_rank, cost_per_step, save_seconds
from harness.model.shape import CellShape
from harness.model.whatif import predict_row, scenario, shape_for
from harness.records.reader import load_records
from harness.run.checkpoint import Checkpointer, load_state, rank_bytes
from harness.run.checkpoint_metrics import checkpoint_metrics
from harness.run.resume import Progress, is_complete
from harness.spec import CellConfig
from workloads.model import Decoder
from workloads.sizes import get_size

REFERENCE = Path(__file__).resolve().parents[2] / "results" / "reference" / "checkpoint-cpu-tiny-mini-w2-w4"


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))  # each step's batch is its own
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_restored_state_trains_on_exactly_as_the_first_run_did(gloo_world1, tmp_path, mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer([model], opt, tmp_path / "ck", mode, every=2)
    before = _train(model, opt, range(0, 3))
    save = ckpt.save(2, Progress(2, {"cell": 1}, [0.1] * 3, [0.1] * 3, before, {}))
    first = _train(model, opt, range(3, 6))  # the uninterrupted run's steps 3-5
    ckpt.wait()
    # the save is complete once DCP's metadata and the rank's progress (written when the write ended) are there
    assert is_complete(ckpt.path(2), world=1) and Progress.read(ckpt.path(2), 0).losses == before
    assert save.blocking_s > 0 and (save.background_s is not None) == (mode == "async")
    # what a checkpoint holds: fp32 parameters and AdamW's two moments (gradients are not saved), DCP's headers beside
    params = sum(p.numel() for p in model.parameters())
    assert 12 * params <= save.bytes_written == rank_bytes(ckpt.path(2), 0) < 12 * params + 64 * 1024
    loaded = ckpt.load(ckpt.path(2))  # back to the state after step 2, moments and step counts included
    assert loaded["bytes_read"] == save.bytes_written and loaded["load_s"] > 0
    assert _train(model, opt, range(3, 6)) == first
    assert ckpt.replay_step(5) == 2 and ckpt.replay_step(2) is None  # a save at the last step has nothing after it
    ckpt.finish(keep=False)
    assert not (tmp_path / "ck").exists()


def test_fp16s_loss_scale_and_its_growth_count_come_back(gloo_world1, tmp_path):
    model = nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    scaler.scale(torch.ones(()))  # the scale exists once a loss was scaled
    scaler.update(new_scale=256.0)
    scaler._growth_tracker = torch.tensor(2, dtype=torch.int32)  # two good steps toward the next growth
    ckpt = Checkpointer([model], opt, tmp_path / "ck", "sync", every=1, scaler=scaler)
    ckpt.save(0, Progress(0, {}, [0.1], [0.1], [1.0], {}))
    scaler.update(new_scale=8.0)
    scaler._growth_tracker = torch.tensor(0, dtype=torch.int32)
    ckpt.load(ckpt.path(0))
    assert scaler.get_scale() == 256.0 and scaler.state_dict()["_growth_tracker"] == 2
    fresh = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)  # a resumed process: no step yet
    load_state(model, opt, ckpt.path(0), 0, fresh)
    assert fresh.get_scale() == 256.0 and fresh.state_dict()["_growth_tracker"] == 2
    ckpt.finish(keep=False)


def test_bad_settings_are_refused(gloo_world1, tmp_path):
    model = nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="mode sync, async, async-pinned, every >= 1"):
        Checkpointer([model], opt, tmp_path, "sync", every=0)
    with pytest.raises(ValueError, match="mode 'off' every 5: mode sync, async, async-pinned"):
        Checkpointer([model], opt, tmp_path, "off", every=5)


def _log(mode: str, blocking: list[float], background: list[float | None], written: int, restore: dict | None):
    return {"mode": mode, "every": 5, "restore": restore,
            "saves": [{"step": 5 * (i + 1), "blocking_s": b, "background_s": g, "bytes_written": written}
                      for i, (b, g) in enumerate(zip(blocking, background))]}


def test_the_record_takes_the_slowest_rank_per_save_and_prices_the_interval():
    restore = {"from_step": 10, "steps_replayed": 5, "load_s": 0.2, "bytes_read": 100, "loss_max_abs_diff": 0.0}
    logs = [_log("async", [0.1, 0.3, 0.2], [1.0, 2.0, 3.0], 100, restore),
            _log("async", [0.2, 0.1, 0.1], [1.5, 1.0, 1.0], 300, {**restore, "load_s": 0.4, "bytes_read": 300})]
    m = checkpoint_metrics(logs, step_median_s=0.5, states_by_rank=[190, 190], replicas=1)
    assert m["blocking_s"] == [0.2, 0.3, 0.2] and m["blocking_s_median"] == 0.2  # per save, the slower rank
    assert m["background_s_median"] == 2.0  # per save the slower rank: 1.5, 2.0, 3.0
    assert m["cost_per_step_pct"] == pytest.approx(100 * 0.2 / 5 / 0.5)  # 8% of every step at one save in 5
    assert m["bytes_written_by_rank"] == [100, 300] and m["written_over_states"] == pytest.approx(400 / 380)
    assert m["write_gib_per_s"] == pytest.approx(400 / 2.0 / 2**30)  # both ranks' bytes over the write's seconds
    assert m["restore"] == {"from_step": 10, "steps_replayed": 5, "load_s": 0.4, "bytes_read_by_rank": [100, 300],
                            "loss_max_abs_diff": 0.0}
    ddp = checkpoint_metrics([_log("sync", [0.1], [None], 50, None)] * 2, 1.0, [100, 100], replicas=2)
    # two replicas of 100 B each: DCP writes each tensor once, half per rank, so 100 B over one replica's 100
    assert ddp["written_over_states"] == 1.0 and ddp["background_s_median"] is None and ddp["restore"] is None


def test_the_model_prices_a_save_from_the_states_it_counts():
    """Llama-3 8B under FSDP on 8 H100: 8,030,261,248 parameters (Meta's release), 12 bytes each saved (fp32
    parameter and AdamW's two moments), an eighth per rank; at 1 GB/s a save takes 12.05 s."""
    s = scenario("llama3-8b", "h100", 8, "bf16", checkpoint_every=500)
    c = shape_for(s, "fsdp")
    assert c.size.params == 8_030_261_248
    assert max(checkpoint_bytes_by_rank(c)) == pytest.approx(12 * 8_030_261_248 / 8, rel=1e-6)  # shard padding aside
    assert save_seconds(c, 1.0) == pytest.approx(12.045, rel=1e-3)
    row = predict_row(s, "fsdp")
    assert row["checkpoint_pct"] == pytest.approx(100 * row["checkpoint_save_s"] / (500 * row["step_time_s"]))
    assert cost_per_step(12.0, 500, 1.2) == pytest.approx(0.02)  # 12 s over 500 steps of 1.2 s
    # DDP's two replicas share the write: each rank a half of the 12 bytes a parameter and AdamW's 4-byte step
    # per tensor (the tensors counted by torch on the real model)
    ddp = shape_for(scenario("tiny", "h100", 2, "bf16"), "ddp")
    with torch.device("meta"):
        tensors = len(list(Decoder(get_size("tiny")).parameters()))
    assert checkpoint_bytes_by_rank(ddp) == [(12 * ddp.size.params + 4 * tensors) / 2] * 2
    with pytest.raises(UsageError, match="--checkpoint-gbps 0: must be a write bandwidth per GPU"):
        scenario("llama3-8b", "h100", 8, "bf16", checkpoint_every=500, checkpoint_gbps=0)


def test_the_models_bytes_are_what_the_cpu_reference_wrote():
    """Every cell of results/reference/checkpoint-cpu-tiny-mini-w2-w4: the bytes DCP wrote over the model's (its
    per-item headers above; tensor parallel's norms, replicated on each tp rank and written once, below)."""
    ratios = {}
    for r in load_records(REFERENCE):
        if r.get("kind") != "cell" or r.get("status") != "ok":
            continue
        predicted = sum(checkpoint_bytes_by_rank(CellShape.of(CellConfig.from_dict(r["config"]))))
        ratios[r["cell_id"]] = sum(r["metrics"]["checkpoint"]["bytes_written_by_rank"]) / predicted
    assert len(ratios) == 28
    assert all(0.95 < x < 1.15 for x in ratios.values()), ratios


def test_the_records_checkpoint_metrics_whole_by_hand():
    """Issue 61: every key held by value, two ranks whose saves differ. Rank 0 blocked 0.1 and 0.3 s, rank 1 0.2 and
    0.1 (the slower per save: 0.2, 0.3; median 0.25), written 100 and 300 B, states 200 B each on one replica:
    400 / 400; a sync save's write is its blocking (0.25 s); 0.25 s every 5 steps of 0.5 s is 10% of a step."""
    logs = [{**_log("sync", [0.1, 0.3], [None, None], 100, None), "start": None},
            _log("sync", [0.2, 0.1], [None, None], 300, None)]
    assert checkpoint_metrics(logs, step_median_s=0.5, states_by_rank=[200, 200]) == {
        "mode": "sync", "every": 5, "saves": 2, "blocking_s": [0.2, 0.3], "blocking_s_median": 0.25,
        "background_s_median": None, "cost_per_step_pct": pytest.approx(10.0), "bytes_written_by_rank": [100, 300],
        "state_bytes_by_rank": [200, 200], "written_over_states": 1.0, "write_gib_per_s": 400 / 0.25 / 2**30,
        "restore": None, "start": None}
    # a rank that saved once fewer: the saves every rank made; a step of 0 s prices nothing; no states, no ratio
    short = checkpoint_metrics([_log("sync", [0.1], [None], 0, None), logs[1]], step_median_s=0.0,
                               states_by_rank=[0, 0])
    assert (short["saves"], short["blocking_s"], short["cost_per_step_pct"], short["written_over_states"]) == \
        (1, [0.2], None, None)
    assert short["bytes_written_by_rank"] == [0, 300] and short["write_gib_per_s"] == 300 / 0.2 / 2**30


def test_a_cell_that_took_no_save_of_its_own_says_where_it_started():
    """Restored from another run's save, checkpoints off: the mode, the interval, 0 saves and the start (the
    slowest rank's load, every rank's bytes read, the source)."""
    starts = [{"kind": "restore", "from_step": 8, "load_s": 0.5, "bytes_read": 10, "source": "/runs/a/step8"},
              {"kind": "restore", "from_step": 8, "load_s": 0.7, "bytes_read": 12, "source": "/runs/a/step8"}]
    logs = [{"mode": "off", "every": 0, "saves": [], "start": s} for s in starts]
    assert checkpoint_metrics(logs, 0.5, [100, 100]) == {
        "mode": "off", "every": 0, "saves": 0,
        "start": {"kind": "restore", "from_step": 8, "load_s": 0.7, "bytes_read_by_rank": [10, 12],
                  "source": "/runs/a/step8"}}
    assert checkpoint_metrics([{**log, "start": None} for log in logs], 0.5, [100, 100])["start"] is None


def test_a_resumes_restart_cost_is_the_rank_with_the_lowest_goodput():
    from harness.run.checkpoint_metrics import start_summary  # noqa: PLC0415

    def start(goodput):
        return {"kind": "resume", "from_step": 10, "attempt": 2, "lost_s": 1.0, "restart_s": 2.0,
                "productive_s": 8.0, "wall_s": 11.0 if goodput else 12.0, "goodput": goodput}

    s = start_summary([start(0.8), start(None), start(0.7)])
    assert s == {"kind": "resume", "from_step": 10, "attempt": 2, "lost_s": 1.0, "restart_s": 2.0,
                 "productive_s": 8.0, "wall_s": 11.0, "goodput": 0.7}
    assert start_summary([start(None), start(None)])["goodput"] is None


def test_a_restore_check_without_a_loss_to_compare_says_none():
    restore = {"from_step": 5, "steps_replayed": 0, "load_s": 0.1, "bytes_read": 10, "loss_max_abs_diff": None}
    m = checkpoint_metrics([_log("sync", [0.1], [None], 10, restore)], 1.0, [10])
    assert m["restore"] == {"from_step": 5, "steps_replayed": 0, "load_s": 0.1, "bytes_read_by_rank": [10],
                            "loss_max_abs_diff": None}
