"""Every claim a record makes, with the lie planted (issue 61's must-show 1): the lever recorded, the run not doing
it (``tests.distributed._inject``), and the cell failing that claim (:mod:`harness.run.claims`), its status
``contradicted`` with the reason, as the sweep writes it.

The honest cells of every distributed test are held to the same claims (``run_cells`` judges every cell a run
without a planted fault hands back), so a check that fails an honest layout fails there.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from harness.run import claims
from harness.spec import CellConfig
from tests.distributed._spawn import cell, run_cells

pytestmark = pytest.mark.distributed


def _planted(tmp_path_factory, fault: str, cells: list[dict], world: int) -> dict[str, dict]:
    """Each cell's claims by name, judged as the sweep judges them, the run under ``fault``."""
    res = run_cells(cells, world, tmp_path_factory.mktemp(fault), inject=f"tests.distributed._inject:{fault}")
    out = {}
    for cid, r in res.items():
        judged = claims.judge(CellConfig.from_dict(r["config"]), r["metrics"])
        out[cid] = {"by_claim": {c["claim"]: c for c in judged}, "error": claims.contradicted(judged)}
    return out


def _only(judged: dict[str, dict]) -> dict:
    assert len(judged) == 1, sorted(judged)
    return next(iter(judged.values()))


def _contradicted(j: dict, claim: str, *words: str) -> None:
    c = j["by_claim"][claim]
    assert c["status"] == "contradicted", c
    for w in words:
        assert w in c["compared"], (w, c)
    assert j["error"] is not None and j["error"].startswith("claim contradicted by the run: ") and claim in j["error"]
    others = [k for k, v in j["by_claim"].items() if v["status"] == "contradicted" and k != claim]
    assert others in ([], ["layout"]), j["by_claim"]  # a layout lie also moves the collectives


def test_ac_recorded_but_not_applied(tmp_path_factory):
    j = _only(_planted(tmp_path_factory, "ac_not_applied", [cell("single", 1, steps=2, ac="op")], 1))
    # gpt2 tiny: 4 blocks of 6 matmuls; op recomputes the 2nd, 4th and 6th of each: 12, and 0 ran again
    _contradicted(j, "ac", "0 recomputed, where ac op recomputes 12")


def test_ac_full_applied_for_op(tmp_path_factory):
    j = _only(_planted(tmp_path_factory, "ac_full_for_op", [cell("single", 1, steps=2, ac="op")], 1))
    _contradicted(j, "ac", "24 recomputed, where ac op recomputes 12")


def test_fused_optimizer_recorded_but_not_applied(tmp_path_factory):
    j = _only(_planted(tmp_path_factory, "fused_not_applied", [cell("single", 1, steps=2, optimizer="adamw-fused")], 1))
    _contradicted(j, "optimizer", "dispatched [0] time(s)", "each rank must")


def test_compile_recorded_but_not_applied(tmp_path_factory):
    j = _only(_planted(tmp_path_factory, "compile_not_applied", [cell("single", 1, steps=2, compile=True)], 1))
    _contradicted(j, "compile", "dynamo compiled [0] frame(s)")


def test_balanced_routing_recorded_but_not_applied(tmp_path_factory):
    cfg = cell("single", 1, arch="moe", global_batch=4, steps=2, moe_routing="balanced")
    j = _only(_planted(tmp_path_factory, "balanced_routing_not_applied", [cfg], 1))
    _contradicted(j, "moe_routing", "balanced routing gives 1")


def test_sequence_parallel_recorded_but_not_applied(tmp_path_factory):
    j = _only(_planted(tmp_path_factory, "sp_not_applied", [cell("tp-sp", 2, steps=2)], 2))
    _contradicted(j, "layout", "rank 0's")
    assert "sequence parallel on" in j["by_claim"]["layout"]["value"]


def test_zero_bubble_recorded_but_interleaved_run(tmp_path_factory):
    j = _only(_planted(tmp_path_factory, "zb_as_interleaved",
                       [cell("pp", 2, steps=2, microbatches=4, pp_schedule="zb")], 2))
    _contradicted(j, "pp_schedule", "a split backward (input, then weight) on ranks []", "zb splits every rank")


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                    reason="n/a: torchao is not installed (pip install '.[fp8]'; make setup installs it)")
def test_fp8_recipe_recorded_but_tensorwise_run(tmp_path_factory):
    cfg = cell("single", 1, steps=2, precision="fp8", fp8_emulate=True, fp8_recipe="rowwise")
    j = _only(_planted(tmp_path_factory, "fp8_tensorwise_for_rowwise", [cfg], 1))
    _contradicted(j, "fp8", "recipe(s) ['tensorwise']")


def test_checkpoints_recorded_but_never_saved(tmp_path_factory):
    cfg = cell("single", 1, steps=4, checkpoint="sync", checkpoint_every=2)
    j = _only(_planted(tmp_path_factory, "checkpoint_not_saved", [cfg], 1))
    _contradicted(j, "checkpoint", "0 save(s) logged", "a save every 2: 2 due")


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                    reason="n/a: torchao is not installed (pip install '.[fp8]'; make setup installs it)")
def test_float8_all_gather_recorded_but_bf16_gathered(tmp_path_factory):
    cfg = cell("fsdp", 2, steps=2, precision="fp8", fp8_emulate=True, fp8_all_gather=True)
    j = _only(_planted(tmp_path_factory, "fp8_all_gather_not_applied", [cfg], 2))
    _contradicted(j, "fp8", "float8 all-gather [False]")
    assert j["by_claim"]["layout"]["status"] == "contradicted", j["by_claim"]["layout"]  # bf16 bytes gathered


def test_a_config_model_recorded_shrunk_but_built_with_every_layer(tmp_path_factory):
    from workloads.hf_models import config_model  # noqa: PLC0415

    size = config_model(str(Path(__file__).resolve().parents[1] / "data" / "hf_configs" / "gpt2.json"), shrunk=True)
    c = cell("single", 1, steps=2, size=size.name, arch=size.arch, model=size.origin.as_dict(), seq_len=size.seq_len)
    j = _only(_planted(tmp_path_factory, "shrink_layers_not_applied", [c], 1))
    # the shrunk gpt2: 4 blocks of 198,272 and 82,944 outside them (tokens 256 x 128, positions 128 x 128, the final
    # norm, the head 128 x 256) = 875,264; built with the config's 12 blocks: 8 x 198,272 more = 2,461,440
    _contradicted(j, "model", "rank 0 built 2,461,440 parameters; gpt2 shrunk by rules cpu2 has 875,264")
