"""harness fit, the pure parts: the batch search, rank roles, the tensor-bytes measure, bad input."""

from __future__ import annotations

import pytest
import torch

from harness.cli import main
from harness.fit.cell import plan_fit_cell, run_roles
from harness.fit.roles import rank_roles
from harness.measure.tensor_bytes import TensorBytes
from harness.model.shape import CellShape
from harness.parallel.presets import resolve
from harness.search import largest_passing
from workloads.sizes import get_size


@pytest.mark.parametrize("cap, probes", [
    (0, [1]), (1, [1, 2]), (3, [1, 2, 4, 3]), (5, [1, 2, 4, 8, 6, 5]), (13, [1, 2, 4, 8, 16, 12, 14, 13]),
])
def test_largest_passing_doubles_then_bisects(cap, probes):
    seen = []
    best = largest_passing(lambda n: seen.append(n) or n <= cap, limit=64)
    assert best == (cap or None) and seen == probes


def test_largest_passing_stops_at_the_limit():
    assert largest_passing(lambda n: True, limit=48) == 48


def _shape(strategy: str, world: int, size: str = "tiny", microbatches: int = 1) -> CellShape:
    return CellShape(size=get_size(size), dims=resolve(strategy, world).dims, strategy=strategy, precision="fp32",
                     global_batch=world * microbatches, microbatches=microbatches)


def test_roles_split_uneven_fsdp_shards():
    # tiny at 512: one row per rank; d=128 rows end at rank 127, the vocab (256) at 255, d_ff (512) at 511
    roles = rank_roles(_shape("fsdp", 512))
    assert [(r.rank, len(r.ranks), r.name) for r in roles] == [
        (0, 128, "shard 0-127"), (128, 128, "shard 128-255"), (256, 256, "shard 256-511")]


def test_roles_of_a_pipeline_are_each_pipeline_rank():
    # 1F1B keeps pp - p microbatches in flight on pipeline rank p: even two middle stages differ
    roles = rank_roles(_shape("pp", 4, microbatches=8))
    assert [(r.rank, r.ranks, r.stage) for r in roles] == [(0, (0,), "first"), (1, (1,), "middle 1"),
                                                           (2, (2,), "middle 2"), (3, (3,), "last")]


def test_roles_collapse_tp_and_replicas():
    assert [len(r.ranks) for r in rank_roles(_shape("fsdp+tp", 64))] == [64]
    assert [r.name for r in rank_roles(_shape("tp", 4))] == ["every rank"]


def test_tensor_bytes_counts_live_storages_once_and_keeps_the_peak():
    held = torch.zeros(10)
    with TensorBytes() as tb:
        tb.hold([held, held.view(2, 5)])  # a view shares its storage: counted once
        a = torch.empty(100)
        b = a[10:]  # a view: nothing new
        assert tb.live_bytes == 40 + 400 and b.numel() == 90
        del a, b
        c = torch.empty(50)
        assert tb.live_bytes == 40 + 200 and c.numel() == 50
    assert tb.peak_bytes == 440


def test_tensor_bytes_counts_unreachable_storages_once():
    """DDP's buckets: counted ahead (hold_unseen), then written into by an op; a new allocation is not one."""
    bucket, grad = torch.zeros(100), torch.ones(10)
    with TensorBytes() as tb:
        tb.hold_unseen(400)
        torch.mul(grad, 2.0, out=bucket[:10])  # the reducer copying a gradient into its bucket
        assert tb.live_bytes == 400
        fresh = torch.mul(grad, 2.0)
        assert tb.live_bytes == 440 and fresh.numel() == 10
        del bucket  # the bucket is now tracked: its free is seen
        assert tb.live_bytes == 40
    with pytest.raises(ValueError, match="nbytes >= 0"):
        TensorBytes().hold_unseen(-1)


def test_tensor_bytes_follows_storages_resized_in_place():
    """FSDP2 frees and re-allocates its unsharded parameters with ``UntypedStorage.resize_``."""
    assert "resize_" not in torch.UntypedStorage.__dict__
    with TensorBytes() as tb:
        a = torch.empty(100)
        a.untyped_storage().resize_(0)
        assert tb.live_bytes == 0
        a.untyped_storage().resize_(800)
        assert tb.live_bytes == 800 and tb.peak_bytes == 800
    assert "resize_" not in torch.UntypedStorage.__dict__  # torch's own again once tracking ends
    a.untyped_storage().resize_(0)
    assert tb.live_bytes == 800


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "5", "--strategies", "hsdp"],
     "harness fit: error: strategy hsdp needs a device count >= 4 divisible by 2 (2 replicas x >= 2 shards), "
     "got --gpus 5"),
    (["--gpus", "7", "--strategies", "fsdp+tp"],
     "harness fit: error: strategy fsdp+tp needs a device count >= 4 divisible by 2 (>= 2 shards x tp 2), got --gpus 7"),
    (["--gpus", "8", "--strategies", "tp"],
     "harness fit: error: tp (8) must divide n_heads (4); choose tp in {1, 2, 4}"),
    (["--gpus", "8", "--device-mem", "0"],
     "harness fit: error: --device-mem '0': must be > 0 GiB, e.g. 80 (H100) or a preset: h100, h100-pcie, h200, a100, a100-40gb, b200"),
    (["--gpus", "8", "--device-mem", "h900"],
     "harness fit: error: --device-mem 'h900': not a number of GiB nor a preset; give GiB > 0 (e.g. 80), one of "
     "h100, h100-pcie, h200, a100, a100-40gb, b200 or a device file (DEVICE.toml)"),
    (["--gpus", "8", "--device", "h100"],
     "harness fit: error: --device 'h100': fit runs on auto, cpu or cuda; name a preset's memory with --device-mem h100"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys, tmp_path):
    assert main(["fit", "--device", "cpu", *argv, "--out", str(tmp_path)] if "--device" not in argv
                else ["fit", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == message
    assert not list(tmp_path.iterdir()), "nothing may be written before the input is valid"


def test_a_fit_role_that_printed_nothing_leaves_no_log(tmp_path):
    """Each role runs in its own process with a log; a role that printed nothing leaves its spec and result only."""
    cell = plan_fit_cell("tiny", "fsdp", "fp32", 2, 1, "cpu", compute="fake")
    (outcome,) = run_roles(cell, tmp_path, steps=1)
    assert outcome.status == "ok", outcome.error
    files = sorted(f.name for f in tmp_path.iterdir())
    assert files == [f"{cell.cell_id}-rank0.result.json", f"{cell.cell_id}-rank0.spec.json"]
