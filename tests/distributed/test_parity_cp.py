"""Context parallel computes the same training as one device, counts each token once, and moves the
K/V bytes the formula says (:mod:`harness.parallel.cp`).

Tolerances as for every strategy (:mod:`tests.distributed.test_parity`). cp = 2 runs in the fast
tier (gpt2's learned positions, llama3's RoPE and grouped-query K/V); cp = 4, CP under tensor
parallel and CP with activation checkpointing in the slow one.
"""

from __future__ import annotations

import pytest

from harness.model.comm import comm_by_rank
from harness.model.memory import state_bytes_by_rank
from harness.model.shape import CellShape
from harness.run.formulas import max_rel_diff
from harness.run.parity import parity_diffs
from harness.spec import CellConfig
from tests.distributed._spawn import cell, run_cells
from tests.distributed.test_parity import GRAD_NORM_TOL, PARAMS_TOL, TOL
from workloads.sizes import get_size

pytestmark = pytest.mark.distributed
ARCHS = ("gpt2", "llama3")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_cells([cell("single", 1, arch=a) for a in ARCHS], 1, tmp_path_factory.mktemp("cp-w1"))


@pytest.fixture(scope="module")
def cp2(tmp_path_factory):
    return run_cells([cell("fsdp+cp", 2, arch=a) for a in ARCHS], 2, tmp_path_factory.mktemp("cp-w2"))


@pytest.fixture(scope="module")
def cp4(tmp_path_factory):
    """cp = 4 over every rank (one id per strategy in a run, so the tp and AC cells run beside it)."""
    # 3 measured steps (5 before issue 43): a wrong layout shows in step 1's gradients and loss
    cells = [cell("fsdp+cp", 4, arch=a, degrees={"cp": 4}, steps=3) for a in ARCHS]
    return run_cells(cells, 4, tmp_path_factory.mktemp("cp-w4"))


@pytest.fixture(scope="module")
def cp_hybrids(tmp_path_factory):
    cells = [cell("fsdp+tp+cp", 4, arch="llama3", steps=3), cell("fsdp+cp", 4, arch="llama3", ac="selective", steps=3)]
    return run_cells(cells, 4, tmp_path_factory.mktemp("cp-w4-hybrids"))


@pytest.fixture(scope="module")
def cp_compiled(tmp_path_factory):
    """torch.compile per block around the K/V gather's autograd function (the collective is a graph break)."""
    return run_cells([cell("fsdp+cp", 2, compile=True, steps=3)], 2, tmp_path_factory.mktemp("cp-w2-compile"))


def _reference(reference: dict, cid: str) -> dict:
    arch = "llama3" if cid.startswith("llama3-") else "gpt2"
    return next(r for k, r in reference.items() if k.startswith("llama3-") == (arch == "llama3"))


def _assert_parity(results: dict, reference: dict, n: int) -> None:
    assert len(results) == n, sorted(results)
    for cid, res in results.items():
        ref = _reference(reference, cid)
        loss = max_rel_diff(res["metrics"]["loss"], ref["metrics"]["loss"])
        assert loss <= TOL, f"{cid}: loss differs by {loss:.1e}"
        diffs = parity_diffs(res["metrics"], res.get("samples") or {}, ref)
        assert diffs["grad_norm"] is not None and diffs["grad_norm"] <= GRAD_NORM_TOL, f"{cid}: {diffs}"
        assert diffs["params"] is not None and diffs["params"] <= PARAMS_TOL, f"{cid}: {diffs}"


def _kv_bytes_by_formula(cfg: CellConfig) -> int:
    """Per step on one rank: each layer gathers the whole sequence's k and v of its local batch (fp32), once
    more when the attention is recomputed; the gradients' reduce-scatter takes the same size."""
    size, dims = get_size(cfg.size, cfg.arch), cfg.layout.dims
    rows = cfg.global_batch // dims.dp
    per_call = 2 * rows * cfg.seq_len * size.kv_dim // dims.tp * 4
    gathers = 2 if cfg.ac != "none" else 1
    return (gathers + 1) * per_call * size.n_layers


def _assert_counted(results: dict) -> None:
    for cid, res in results.items():
        cfg = CellConfig.from_dict(res["config"])
        m = res["metrics"]
        assert m["cp_comm_bytes_per_step"] == _kv_bytes_by_formula(cfg), cid
        assert set(m["comm_cp"]) == {"all_gather", "reduce_scatter"}, cid
        for coll, v in m["comm_cp"].items():  # the CP calls are among the collectives counted in comm
            assert m["comm"][coll]["bytes_per_step"] >= v["bytes_per_step"], cid
        shape = CellShape.of(cfg)
        assert comm_by_rank(shape) == m["comm_by_rank"], f"{cid}: predicted comm differs from counted"
        assert [s.total for s in state_bytes_by_rank(shape)] == m["model_state_bytes_by_rank"], cid
        # every token once: tokens/s x the median step = the global batch's tokens, not cp times them
        tokens = m["tokens_per_s"] * m["step_time_s"]["median"]
        assert tokens == pytest.approx(cfg.global_batch * cfg.seq_len, rel=1e-9), cid
        assert m["tokens_per_s_per_device"] == pytest.approx(m["tokens_per_s"] / cfg.world_size), cid


def test_cp2_matches_one_device_for_both_families(cp2, reference):
    _assert_parity(cp2, reference, len(ARCHS))


def test_cp2_counts_kv_bytes_by_the_formula_and_tokens_once(cp2):
    _assert_counted(cp2)


@pytest.mark.slow
def test_cp4_matches_one_device_for_both_families(cp4, reference):
    _assert_parity(cp4, reference, len(ARCHS))
    _assert_counted(cp4)


@pytest.mark.slow
def test_cp_under_tensor_parallel_and_recompute_matches_one_device(cp_hybrids, reference):
    _assert_parity(cp_hybrids, reference, 2)
    _assert_counted(cp_hybrids)


@pytest.mark.slow
def test_cp_compiled_matches_one_device(cp_compiled, reference):
    for cid, res in cp_compiled.items():  # 3 steps: the loss curve's prefix against the reference's
        ref = _reference(reference, cid)
        assert max_rel_diff(res["metrics"]["loss"], ref["metrics"]["loss"]) <= TOL, cid
        diffs = parity_diffs(res["metrics"], res.get("samples") or {}, ref)
        assert diffs["grad_norm"] is not None and diffs["grad_norm"] <= GRAD_NORM_TOL, f"{cid}: {diffs}"
    _assert_counted(cp_compiled)
