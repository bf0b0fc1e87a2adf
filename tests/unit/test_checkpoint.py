"""Checkpoints: a save and a restore through torch.distributed.checkpoint on one gloo rank (the state comes back
whole, training after it is the same), the bytes a rank wrote, and the record's numbers by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.run.checkpoint import Checkpointer, rank_bytes
from harness.run.checkpoint_metrics import checkpoint_metrics


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
    _train(model, opt, range(0, 3))
    save = ckpt.save(2)
    first = _train(model, opt, range(3, 6))  # the uninterrupted run's steps 3-5
    ckpt.wait()
    assert save.blocking_s > 0 and (save.background_s is not None) == (mode == "async")
    # what a checkpoint holds: fp32 parameters and AdamW's two moments (gradients are not saved), DCP's headers beside
    params = sum(p.numel() for p in model.parameters())
    assert 12 * params <= save.bytes_written == rank_bytes(ckpt.path(2), 0) < 12 * params + 64 * 1024
    loaded = ckpt.load(2)  # back to the state after step 2, moments and step counts included
    assert loaded["bytes_read"] == save.bytes_written and loaded["load_s"] > 0
    assert _train(model, opt, range(3, 6)) == first
    assert ckpt.replay_step(5) == 2 and ckpt.replay_step(2) is None  # a save at the last step has nothing after it
    ckpt.remove()
    assert not (tmp_path / "ck").exists()


def test_bad_settings_are_refused(gloo_world1, tmp_path):
    model = nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="mode sync or async, every >= 1"):
        Checkpointer([model], opt, tmp_path, "sync", every=0)
    with pytest.raises(ValueError, match="mode sync or async"):
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
