"""The moe family under every strategy that places its layers as any other: the same training as one
device, the same routing decisions, and the communication and model states the model predicts.

Tolerances as for every strategy (:mod:`tests.distributed.test_parity`). Routing is discrete: a
strategy that changed one token's top-k choice would move its load table, which must equal the one
device's to the token. Learned (top-k with the DeepSeek-V3 bias step, whose load is summed over every
rank) and balanced (round robin) routing, over 3 steps (2 bias steps); world 2 in the fast tier
(balanced routing under fsdp, pp and fsdp+ep), world 4 in the slow one (expert parallel at ep 4 and 2, and ep 2 x tp 2).

Expert parallel's all-to-all bytes depend on where the routing sent the rows: balanced routing sends and
receives alike on every rank, which the model predicts exactly; under learned routing the bytes must
equal :func:`harness.model.comm.ep_bytes` of the rows each rank recorded for the counted step.
"""

from __future__ import annotations

import pytest

from harness.model.comm import comm_for_routing
from harness.model.shape import CellShape
from harness.run.formulas import max_rel_diff
from harness.run.parity import parity_diffs
from harness.spec import CellConfig
from tests.distributed._spawn import cell, run_cells
from tests.distributed.test_parity import GRAD_NORM_TOL, PARAMS_TOL, TOL, _check_model
from workloads.sizes import get_size

pytestmark = pytest.mark.distributed
ROUTINGS = ("learned", "balanced")
MOE = get_size("tiny", "moe")


def _moe(strategy: str, world: int, routing: str, **kw) -> dict:
    return cell(strategy, world, arch="moe", global_batch=4 * world, moe_routing=routing, steps=3, **kw)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_cells([_moe("single", 2, r, world_size=1) for r in ROUTINGS], 1, tmp_path_factory.mktemp("moe-w1"))


@pytest.fixture(scope="module")
def reference16(tmp_path_factory):
    return run_cells([_moe("single", 4, r, world_size=1) for r in ROUTINGS], 1, tmp_path_factory.mktemp("moe-w1-16"))


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    cells = [_moe(s, 2, "learned", **kw) for s, kw in (("ddp", {}), ("fsdp", {}), ("pp", {"microbatches": 4}),
                                                       ("fsdp+cp", {}))]
    cells += [_moe("fsdp", 2, "balanced"), _moe("pp", 2, "balanced", microbatches=4)]
    cells += [_moe("fsdp+ep", 2, r) for r in ROUTINGS]
    return run_cells(cells, 2, tmp_path_factory.mktemp("moe-w2"))


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    # Learned routing only where no rank exchanges rows (its load all-reduce and bias step are the harder case;
    # balanced routing under these layouts is the fast tier's at world 2); both routings where experts move.
    strategies = {"zero2": {}, "hsdp": {}, "pp+fsdp": {"microbatches": 4}, "fsdp+cp": {"degrees": {"cp": 4}}}
    cells = [_moe(s, 4, "learned", **kw) for s, kw in strategies.items()]
    cells += [_moe("fsdp+ep", 4, r, **kw) for kw in ({}, {"degrees": {"dp_shard": 4, "ep": 2}}) for r in ROUTINGS]
    cells += [_moe("fsdp+tp+ep", 4, r) for r in ROUTINGS]
    return run_cells(cells, 4, tmp_path_factory.mktemp("moe-w4"))


def _reference_of(reference: dict, res: dict) -> dict:
    cfg = res["config"]
    return next(r for r in reference.values()
                if (r["config"]["global_batch"], r["config"]["moe_routing"]) == (cfg["global_batch"], cfg["moe_routing"]))


def _assert_matches_one_device(results: dict, reference: dict, n: int) -> None:
    assert len(results) == n, sorted(results)
    for cid, res in results.items():
        ref = _reference_of(reference, res)
        m = res["metrics"]
        loss = max_rel_diff(m["loss"], ref["metrics"]["loss"])
        assert loss <= TOL, f"{cid}: loss differs by {loss:.1e}"
        diffs = parity_diffs(m, res.get("samples") or {}, ref)
        assert diffs["grad_norm"] is not None and diffs["grad_norm"] <= GRAD_NORM_TOL, f"{cid}: {diffs}"
        assert diffs["params"] is not None and diffs["params"] <= PARAMS_TOL, f"{cid}: {diffs}"
        # the same router decisions: every expert of every layer got the tokens it got on one device
        assert m["moe"]["tokens_per_expert"] == ref["metrics"]["moe"]["tokens_per_expert"], cid


def _assert_load_counted(results: dict) -> None:
    for cid, res in results.items():
        cfg = CellConfig.from_dict(res["config"])
        moe = res["metrics"]["moe"]
        assert moe["routing"] == cfg.moe_routing
        slots = cfg.global_batch * cfg.seq_len * MOE.moe.top_k  # each token at k experts, counted once
        assert [sum(layer) for layer in moe["tokens_per_expert"]] == pytest.approx([slots] * MOE.n_layers), cid
        if cfg.moe_routing == "balanced":
            assert moe["imbalance_max_over_mean"] == moe["imbalance_max_over_mean_worst"] == 1.0, cid
        else:
            assert moe["imbalance_max_over_mean_worst"] >= moe["imbalance_max_over_mean"] > 1.0, cid
        # the same step counted on total parameters: E / k more expert FLOPs, labelled apart
        ratio = moe["tflops_per_device_total_params"] / res["metrics"]["tflops_per_device"]
        assert ratio == pytest.approx(MOE.flops_per_token_total(cfg.seq_len) / MOE.flops_per_token(cfg.seq_len))


def _check_ep_model(results: dict) -> None:
    """:func:`_check_model`, with learned expert-parallel cells held to the model for the routing that happened."""
    results = dict(results)
    for cid, res in results.items():
        ep = res["metrics"]["moe"].get("ep")
        if ep is None or res["config"]["moe_routing"] == "balanced":
            continue
        shape = CellShape.of(CellConfig.from_dict(res["config"]))
        sent, received = ep["counted_step_rows_sent_by_rank"], ep["counted_step_rows_received_by_rank"]
        assert sent != received, f"{cid}: learned routing moved no rows between ranks unevenly"
        assert res["metrics"]["comm_by_rank"] == comm_for_routing(shape, ep), cid
        # the rest of the check with the model's own (balanced) rows in place of the routing's
        balanced = {"counted_step_rows_sent_by_rank": sent, "counted_step_rows_received_by_rank": sent}
        results[cid] = {**res, "metrics": {**res["metrics"], "comm_by_rank": comm_for_routing(shape, balanced)}}
    _check_model(results)


def _assert_ep(results: dict, ep_degrees: set[int]) -> None:
    ep = {cid: r for cid, r in results.items() if r["config"]["strategy"] in ("fsdp+ep", "fsdp+tp+ep")}
    assert {r["degrees"]["ep"] for r in ep.values()} == ep_degrees
    for cid, res in ep.items():
        moe, comm = res["metrics"]["moe"], res["metrics"]["comm"]
        share = moe["ep"]["tokens_left_rank_share"]
        degree = res["degrees"]["ep"]
        if res["config"]["moe_routing"] == "balanced":  # the round robin sends each expert its share
            assert share == pytest.approx(1 - 1 / degree), cid
        else:
            assert 0 < share < 1, cid
        assert comm["all_to_all"]["calls_per_step"] == 5 * MOE.n_layers, cid  # counts, 2 forward, 2 backward


def test_moe_world2_matches_one_device(world2, reference):
    _assert_matches_one_device(world2, reference, 8)


def test_moe_world2_load_and_model(world2, reference):
    _assert_load_counted({**world2, **reference})
    _assert_ep(world2, {2})
    _check_ep_model(world2)  # the load all-reduce (L x E fp32) beside each strategy's own collectives


@pytest.mark.slow
def test_moe_world4_matches_one_device(world4, reference16):
    _assert_matches_one_device(world4, reference16, 4 + 3 * len(ROUTINGS))
    _assert_load_counted({**world4, **reference16})
    _assert_ep(world4, {2, 4})
    _check_ep_model(world4)
