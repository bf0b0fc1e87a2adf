"""``harness fit``'s model-state bytes per rank role equal the analytic model's exactly, at N = 8, 64, 512.

The roles run on fake process groups (FakeTensorMode: shapes without arithmetic, one step, so
the optimizer state exists); the model (harness/model/memory.py) never sees them. A cell the
strategy's degrees cannot run at N is invalid for fit and the model alike (same planner check).
"""

from __future__ import annotations

import pytest

from harness.errors import UsageError
from harness.fit.cell import plan_fit_cell
from harness.fit.roles import rank_roles
from harness.model.memory import peak_bytes, state_bytes_by_rank
from tests.fit._fake import run_fake_roles

STRATEGIES = ("ddp", "fsdp", "zero2", "hsdp", "tp", "fsdp+tp", "pp", "pp+fsdp")
WORLDS = (8, 64, 512)
SEQ = 64


def _cells(size: str, worlds: tuple[int, ...] = WORLDS):
    valid, invalid = [], {}
    for n in worlds:
        for s in STRATEGIES:
            try:
                valid.append(plan_fit_cell(size, s, "fp32", n, 1, "cpu", seq_len=SEQ, compute="fake"))
            except UsageError as e:
                invalid[(s, n)] = str(e)
    return valid, invalid


@pytest.mark.parametrize("size, worlds, expect_invalid", [
    # tiny: 4 heads and 4 layers; mini: 8 heads and 6 layers (tp = N and pp = N are presets). N = 512 is
    # tiny's: mini's shape adds nothing the scale needs, and its N = 512 roles cost a third of the test
    ("tiny", WORLDS, {("tp", 8), ("tp", 64), ("tp", 512), ("pp", 8), ("pp", 64), ("pp", 512)}),
    pytest.param("mini", (8, 64), {("tp", 64), ("pp", 8), ("pp", 64)}, marks=pytest.mark.slow),
])
def test_model_states_per_role_equal_the_model_exactly(size, worlds, expect_invalid, tmp_path):
    cells, invalid = _cells(size, worlds)
    assert set(invalid) == expect_invalid, invalid
    _assert_states_exact(cells, run_fake_roles(cells, tmp_path, steps=1))


def _assert_states_exact(cells, results) -> None:
    checked = 0
    for cell in cells:
        predicted = state_bytes_by_rank(cell.shape)
        for role in rank_roles(cell.shape):
            measured = results[(cell.cell_id, role.rank)]["model_state_bytes"]
            for rank in role.ranks:  # every rank the role stands for holds what the model says
                assert measured["total"] == predicted[rank].total, (cell.cell_id, role.name, rank)
            assert measured == predicted[role.rank].as_dict(), (cell.cell_id, role.name)
            checked += 1
    assert checked >= len(cells)


def test_moe_model_states_per_role_equal_the_model_exactly(tmp_path):
    """The moe family: the stacked experts (FSDP shards them along the experts), the router and the shared
    expert, under fake compute, whose tokens split evenly over the experts (no values to route by);
    expert parallel (ep 4, and ep 2 x tp 2: the experts' width split too) under fake collectives; tensor
    parallel without expert parallel is refused with its reason, for fit as for bench."""
    grid = [(s, 8, None) for s in ("ddp", "fsdp", "zero2", "hsdp", "pp+fsdp")] + [("fsdp", 64, None)]
    grid += [("fsdp+ep", 8, {"dp_shard": 8, "ep": 4}), ("fsdp+tp+ep", 8, {"dp_shard": 4, "tp": 2, "ep": 2})]
    cells = [plan_fit_cell("moe-mini", s, "fp32", n, 1, "cpu", seq_len=SEQ, degrees=d, compute="fake") for s, n, d in grid]
    _assert_states_exact(cells, run_fake_roles(cells, tmp_path, steps=1))
    with pytest.raises(UsageError, match=r"tp \(2\) on a mixture of experts needs expert parallel"):
        plan_fit_cell("moe-mini", "fsdp+tp", "fp32", 8, 1, "cpu", seq_len=SEQ)


def test_activation_checkpointing_keeps_the_states_and_lowers_each_role_peak(tmp_path):
    """``harness fit --ac full``: the same model states per role (exact), a lower measured peak in
    every role, and the model predicting the lower peak too (FakeTensorMode roles, tiny at N = 8)."""
    cells = [plan_fit_cell("tiny", s, "fp32", 8, 2, "cpu", seq_len=SEQ, ac=ac, compute="fake") for s in ("fsdp", "pp+fsdp")
             for ac in ("none", "full")]
    results = run_fake_roles(cells, tmp_path, steps=1)
    for eager, full in zip(cells[::2], cells[1::2]):
        assert full.cell_id == eager.cell_id.replace(f"-s{SEQ}", f"-ac-full-s{SEQ}")  # the length's part comes last
        assert peak_bytes(full.shape, 0.0) < peak_bytes(eager.shape, 0.0)
        for role in rank_roles(eager.shape):
            a, b = results[(eager.cell_id, role.rank)], results[(full.cell_id, role.rank)]
            assert b["model_state_bytes"] == a["model_state_bytes"], (full.cell_id, role.name)
            assert b["peak_bytes"] < a["peak_bytes"], (full.cell_id, role.name, a["peak_bytes"], b["peak_bytes"])


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16"])
def test_llama3_peak_within_10_percent_of_the_model_on_mean(precision, tmp_path):
    """The llama3 block's activations (GQA's narrower k/v, SwiGLU's four d_ff-wide tensors, RMSNorm's fp32
    saves, RoPE's tables; bf16, where RMSNorm's fp32 saves matter; llama3's model states per role are exact
    in the fit references and the parity tests) against FakeTensorMode roles at N = 8, micro-batch 2, seq 128: each cell's
    highest role (the model predicts the peak over ranks) within 10% of the model on mean, as the
    issue holds the CPU reference to (the same cells of gpt2 tiny: 12% at seq 64)."""
    cells = [plan_fit_cell("llama3-tiny", s, precision, 8, 2, "cpu", seq_len=128, ac=ac, compute="fake")
             for s in ("fsdp", "fsdp+tp", "pp+fsdp", "ddp") for ac in ("none", "full")]
    results = run_fake_roles(cells, tmp_path, steps=1)
    errors = {}
    for cell in cells:
        measured = max(results[(cell.cell_id, role.rank)]["peak_bytes"] for role in rank_roles(cell.shape))
        errors[cell.cell_id] = (peak_bytes(cell.shape, 0.0) - measured) / measured
    assert sum(abs(e) for e in errors.values()) / len(errors) <= 0.10, errors
    assert max(abs(e) for e in errors.values()) <= 0.20, errors
