"""The committed expert-parallel reference (results/reference/moe-ep-cpu-tiny-mini-w2-w4, issue 31) shows what
it claims: moe tiny and mini at 2 and 4 ranks under ddp, fsdp, fsdp+ep (ep 2 and 4) and fsdp+tp+ep, learned
and balanced routing; every cell at parity with one device and routing every token as it did; the
per-expert load table in summary.md; and every rank's all-to-all bytes equal to the formula for the routing
that happened (recomputed here from the rows each rank recorded), every other collective and model state
equal to the model's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.model.comm import comm_for_routing
from harness.model.shape import CellShape
from harness.records.reader import latest_per_cell, load_records
from harness.report.model_error import comm_exact
from harness.spec import CellConfig
from workloads.sizes import get_size

REF = Path(__file__).resolve().parents[2] / "results" / "reference" / "moe-ep-cpu-tiny-mini-w2-w4"
FIT = REF.parent / "fit-qwen3-30b-a3b-w64-ep"
EP_STRATEGIES = ("fsdp+ep", "fsdp+tp+ep")


@pytest.fixture(scope="module")
def cells() -> list[dict]:
    return [r for r in latest_per_cell(load_records(REF))[0] if r.get("kind", "cell") == "cell"]


def _ok(cells: list[dict]) -> list[dict]:
    return [r for r in cells if r["status"] == "ok"]


def _layout(r: dict) -> tuple:
    c = r["config"]
    return c["strategy"], c["world_size"], r["config"]["degrees"].get("ep", 1), r["config"]["degrees"].get("tp", 1)


def test_every_layout_ran_at_parity_with_one_device(cells):
    ok = _ok(cells)
    invalid = [r for r in cells if r["status"] == "invalid"]
    assert len(ok) + len(invalid) == len(cells)
    # fsdp+tp+ep needs tp 2 x 2 shards: at 2 ranks it is refused with the reason
    assert {r["config"]["strategy"] for r in invalid} == {"fsdp+tp+ep"}
    assert len(invalid) == 4 and all(r["config"]["world_size"] == 2 for r in invalid)
    for size in ("tiny", "mini"):
        for routing in ("learned", "balanced"):
            mine = {_layout(r) for r in ok if (r["config"]["size"], r["config"]["moe_routing"]) == (size, routing)}
            assert mine == {("single", 1, 1, 1), ("ddp", 2, 1, 1), ("fsdp", 2, 1, 1), ("fsdp+ep", 2, 2, 1),
                            ("ddp", 4, 1, 1), ("fsdp", 4, 1, 1), ("fsdp+ep", 4, 2, 1), ("fsdp+ep", 4, 4, 1),
                            ("fsdp+tp+ep", 4, 2, 2)}, (size, routing)
    multi = [r for r in ok if r["config"]["world_size"] > 1]
    assert all(r["metrics"]["parity"]["ok"] for r in multi), [r["cell_id"] for r in multi if not r["metrics"]["parity"]["ok"]]


def test_every_layout_routes_as_the_one_device(cells):
    """The same expert load at every step, or a recorded rounding flip of at most 2 slots per layer (learned only)."""
    ok = _ok(cells)
    single = {(r["config"]["size"], r["config"]["moe_routing"]): r["samples"]["moe_load_per_step"]
              for r in ok if r["config"]["world_size"] == 1}
    for r in ok:
        c, parity = r["config"], r["metrics"]["parity"]
        same = r["samples"]["moe_load_per_step"] == single[c["size"], c["moe_routing"]]
        assert same == ("routing_diverged" not in parity), r["cell_id"]
        if not same:
            assert c["moe_routing"] == "learned" and parity["routing_diverged"]["max_slots_moved_per_layer"] <= 2


def test_all_to_all_bytes_equal_the_formula_for_the_routing_that_happened(cells):
    ep_cells = [r for r in _ok(cells) if r["config"]["strategy"] in EP_STRATEGIES]
    assert len(ep_cells) == 2 * 2 * 4
    for r in ep_cells:
        shape = CellShape.of(CellConfig.from_record(r["config"]))
        ep = r["metrics"]["moe"]["ep"]
        sent, received = ep["counted_step_rows_sent_by_rank"], ep["counted_step_rows_received_by_rank"]
        size = get_size(r["config"]["size"], "moe")
        # every rank routes its own tokens, k rows each, in every layer
        assert sent == [shape.local_batch * shape.local_seq * size.moe.top_k * size.n_layers] * shape.dims.world_size
        assert sum(received) == sum(sent)  # every row lands on some rank's experts
        assert r["metrics"]["comm_by_rank"] == comm_for_routing(shape, ep), r["cell_id"]
        if r["config"]["moe_routing"] == "balanced":  # the prediction made before the run was exact
            assert received == sent and r["metrics"]["comm_by_rank"] == r["predicted"]["comm_by_rank"]


def test_the_report_says_whose_bytes_are_exact_and_for_which_routing(cells):
    """summary.md's "bytes exact": yes against the prediction, routed against the model of the recorded rows
    (learned expert-parallel cells), and no once a rank's recorded rows disagree with its bytes."""
    verdicts = {r["cell_id"]: comm_exact(r) for r in _ok(cells)}
    learned_ep = {r["cell_id"] for r in _ok(cells)
                  if r["config"]["strategy"] in EP_STRATEGIES and r["config"]["moe_routing"] == "learned"}
    assert {c for c, v in verdicts.items() if v != "yes"} == learned_ep and len(learned_ep) == 8
    assert set(verdicts[c] for c in learned_ep) == {"routed"}
    r = next(r for r in _ok(cells) if r["cell_id"] in learned_ep)
    tampered = json.loads(json.dumps(r))
    received = tampered["metrics"]["moe"]["ep"]["counted_step_rows_received_by_rank"]
    received[0], received[1] = received[0] + 1, received[1] - 1
    assert comm_exact(tampered) == "no"
    summary = (REF / "summary.md").read_text()
    assert all(f"| {c} " in summary for c in learned_ep) and "| routed " in summary


def test_the_share_of_tokens_that_left_their_rank(cells):
    for r in _ok(cells):
        if r["config"]["strategy"] not in EP_STRATEGIES:
            assert "ep" not in r["metrics"]["moe"], r["cell_id"]
            continue
        share, ep = r["metrics"]["moe"]["ep"]["tokens_left_rank_share"], r["config"]["degrees"]["ep"]
        if r["config"]["moe_routing"] == "balanced":
            assert share == pytest.approx(1 - 1 / ep), r["cell_id"]
        else:
            assert 0 < share < 1, r["cell_id"]


def test_model_states_are_the_models_and_summary_prints_the_load_table(cells):
    for r in _ok(cells):
        assert r["metrics"]["model_state_bytes_by_rank"] == r["predicted"]["model_state_bytes_by_rank"], r["cell_id"]
    summary = (REF / "summary.md").read_text()
    assert "## Expert load (MoE)" in summary and "| e7 " in summary


def test_fit_holds_qwen3_model_states_exact_at_every_ep():
    """``harness fit --arch moe --sizes qwen3-30b-a3b --gpus 64 --strategies fsdp+ep``: one cell per ep dividing
    64 ranks and 128 experts, each rank's measured model states equal to the model's to the byte."""
    records = [json.loads(line) for line in (FIT / "fit.jsonl").read_text().splitlines() if line.strip()]
    assert sorted(r["config"]["degrees"]["ep"] for r in records) == [2, 4, 8, 16, 32, 64]
    for r in records:
        assert r["status"] == "ok" and r["config"]["strategy"] == "fsdp+ep" and r["config"]["world_size"] == 64
        assert r["metrics"]["model_state_bytes_per_rank"] == r["predicted"]["model_state_bytes_per_rank"], r["cell_id"]
    # FSDP already shards every expert over the 64 ranks: expert parallel moves them, it does not shrink them
    assert len({r["metrics"]["model_state_bytes_per_rank"] for r in records}) == 1
