"""The committed MoE reference (results/reference/moe-cpu-tiny-mini-w2-w4, issue 31) shows what it claims:
every cell matches one device and routes every token as the one device did (its load table equals the
one-device table of its routing), balanced routing loads every expert alike, each layer counts every
token k times, the load all-reduce and every other collective are what the model predicts, and the
summary prints the per-expert load table."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.records.reader import latest_per_cell, load_records
from harness.report.load_table import expert_load_frame, expert_load_section
from workloads.sizes import get_size

REF = Path(__file__).resolve().parents[2] / "results" / "reference" / "moe-cpu-tiny-mini-w2-w4"


@pytest.fixture(scope="module")
def cells() -> list[dict]:
    return [r for r in latest_per_cell(load_records(REF))[0] if r.get("kind", "cell") == "cell"]


def _ok(cells: list[dict]) -> list[dict]:
    return [r for r in cells if r["status"] == "ok"]


def test_every_valid_cell_ran_and_matches_one_device(cells):
    ok = _ok(cells)
    assert {r["status"] for r in cells} <= {"ok", "invalid"}
    assert {(r["config"]["size"], r["config"]["moe_routing"]) for r in ok} == \
        {(s, rt) for s in ("tiny", "mini") for rt in ("learned", "balanced")}
    assert {r["config"]["world_size"] for r in ok} == {1, 2, 4}
    multi = [r for r in ok if r["config"]["world_size"] > 1]
    assert len(multi) >= 40 and all(r["metrics"]["parity"]["ok"] for r in multi)


def test_every_strategy_routes_as_the_one_device(cells):
    """The same expert load at every step as the one device's, or, where rounding flipped a near-tie of the
    top-k, at most 2 expert slots moved in any layer at the first step that differs (balanced routing never flips)."""
    ok = _ok(cells)
    single = {(r["config"]["size"], r["config"]["moe_routing"]): r["samples"]["moe_load_per_step"]
              for r in ok if r["config"]["world_size"] == 1}
    flips = 0
    for r in ok:
        c, parity = r["config"], r["metrics"]["parity"]
        same = r["samples"]["moe_load_per_step"] == single[c["size"], c["moe_routing"]]
        assert same == ("routing_diverged" not in parity), r["cell_id"]
        if not same:
            flips += 1
            assert c["moe_routing"] == "learned", r["cell_id"]
            assert parity["routing_diverged"]["max_slots_moved_per_layer"] <= 2, r["cell_id"]
            assert 0 < parity["routing_diverged"]["loss_compared_steps"] == parity["routing_diverged"]["step"]
    assert flips < len(ok) // 2


def test_load_counts_every_token_k_times_and_balanced_is_even(cells):
    for r in _ok(cells):
        c, moe = r["config"], r["metrics"]["moe"]
        size = get_size(c["size"], "moe")
        slots = c["global_batch"] * c["seq_len"] * size.moe.top_k
        assert [sum(layer) for layer in moe["tokens_per_expert"]] == pytest.approx([slots] * size.n_layers)
        if c["moe_routing"] == "balanced":
            assert moe["imbalance_max_over_mean"] == moe["imbalance_max_over_mean_worst"] == 1.0
        else:
            assert moe["imbalance_max_over_mean"] > 1.0


def test_collectives_and_states_are_the_models(cells):
    """The load all-reduce (layers x experts fp32 over every rank) is in the counted comm, as the model has it."""
    for r in _ok(cells):
        m, p = r["metrics"], r["predicted"]
        assert m["comm_by_rank"] == p["comm_by_rank"], r["cell_id"]
        assert m["model_state_bytes_by_rank"] == p["model_state_bytes_by_rank"], r["cell_id"]
        if r["config"]["world_size"] > 1:
            size = get_size(r["config"]["size"], "moe")
            assert m["comm"]["all_reduce"]["bytes_per_step"] >= 4 * size.n_layers * size.moe.n_experts


def test_summary_prints_the_per_expert_load_table(cells):
    frame = expert_load_frame(cells)
    assert len(frame) == len(_ok(cells))
    section = expert_load_section(frame)
    assert section.startswith("## Expert load (MoE)") and "| e7 " in section
    assert "## Expert load (MoE)" in (REF / "summary.md").read_text()
