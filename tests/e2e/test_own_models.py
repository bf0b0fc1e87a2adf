"""A user's own models through ``harness bench`` (issue 58): a module of their own under data parallel and its tp plan,
and published configs under the layouts whose placement is the architecture's own (MLA, projection q/k norms,
ALiBi), each held to one device, its bytes to the model, its records rebuilding the workload without the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.model.comm import comm_by_rank, comm_for_routing
from harness.model.shape import CellShape
from harness.spec import CellConfig

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "hf_configs"
QUICK = ["--device", "cpu", "--steps", "3", "--warmup", "1", "--no-calibrate", "--monitor-hz", "0"]


def test_a_module_of_your_own_trains_at_parity_under_ddp_fsdp_and_its_tp_plan(harness_cli, e2e, tmp_path):
    """examples/own_model.py: its model states and every collective priced exactly (data parallel), tp by its plan."""
    out = tmp_path / "own"
    res = harness_cli.run("bench", "--model", "examples.own_model:tiny_gpt", "--gpus", "2", "--strategies", "ddp,fsdp,tp",
                      *QUICK, "--out", str(out), timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "note: tiny_gpt-" in res.stdout and "parameters" in res.stdout
    cells = {r["config"]["strategy"]: r for r in e2e.read_records(out)}
    assert set(cells) == {"single", "ddp", "fsdp", "tp"}
    for strategy in ("ddp", "fsdp", "tp"):
        r = cells[strategy]
        assert r["status"] == "ok" and r["metrics"]["parity"]["ok"], (strategy, r["metrics"].get("parity"))
        assert r["config"]["arch"] == "module" and r["config"]["model"]["name"] == "examples.own_model:tiny_gpt"
    for strategy in ("ddp", "fsdp"):
        m, p = cells[strategy]["metrics"], cells[strategy]["predicted"]
        assert m["model_state_bytes_per_rank"] == p["model_state_bytes_per_rank"]
        assert m["comm_by_rank"] == p["comm_by_rank"]
    assert cells["tp"]["predicted"]["comm_bytes_per_step"] is None  # its plan is the factory's: not priced


@pytest.mark.slow
def test_configs_whose_placement_is_their_own_match_one_device_and_the_model(harness_cli, e2e, tmp_path):
    """OLMo 2 (q/k norms over the sharded projection) and MPT (ALiBi's slopes per rank) under fsdp+tp, DeepSeek-V3
    (MLA's whole low-rank path, the shared rotary key's gradient summed over tp, dense first block) under fsdp+tp+ep."""
    out = tmp_path / "configs"
    models = ",".join(str(DATA / f"{n}.json") for n in ("olmo-2-1124-7b", "mpt-7b", "deepseek-v3"))
    res = harness_cli.run("bench", "--model", models, "--gpus", "4", "--strategies", "fsdp+tp,fsdp+tp+ep", *QUICK,
                      "--batch", "4", "--out", str(out), timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    ran = [r for r in e2e.read_records(out) if r["status"] == "ok" and r["config"]["world_size"] == 4]
    assert {r["config"]["size"].split("-")[0] for r in ran} == {"olmo", "mpt", "deepseek"}
    for r in ran:
        assert r["metrics"]["parity"]["ok"], (r["cell_id"], r["metrics"]["parity"])
        shape = CellShape.of(CellConfig.from_record(r["config"]))
        ep = (r["metrics"].get("moe") or {}).get("ep")
        assert r["metrics"]["comm_by_rank"] == (comm_for_routing(shape, ep) if ep else comm_by_rank(shape)), r["cell_id"]
