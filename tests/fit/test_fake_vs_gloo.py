"""At N = 4, ``harness fit`` on fake collectives measures what a real 4-rank gloo run does.

The same role code (``harness.fit.role_process.run_role``) runs on a real gloo group of 4 processes and,
one role at a time, on fake groups; both measure with the same tensor-bytes tracker. Model-state
bytes must be equal (and equal to the model, which the harness worker's records equal on gloo), peaks within 10%
per rank role.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from harness.fit.cell import plan_fit_cell
from harness.fit.roles import rank_roles
from harness.model.memory import state_bytes_by_rank
from tests.distributed._spawn import _free_port, start_ranks
from tests.fit._fake import run_fake_roles

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
STRATEGIES = ("ddp", "fsdp", "zero2", "hsdp", "tp", "fsdp+tp", "pp", "pp+fsdp")
WORLD, SEQ, MICRO, STEPS = 4, 64, 2, 2
PEAK_TOL = 0.10


def _gloo_main(rank: int, world: int, port: int, specs: list[dict], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from harness.fit.role_process import RoleSpec, run_role

    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = [run_role(RoleSpec.from_dict({**s, "rank": rank}), torch.device("cpu")) for s in specs]
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def cells():
    return [plan_fit_cell("tiny", s, "fp32", WORLD, MICRO, "cpu", seq_len=SEQ) for s in STRATEGIES]


@pytest.fixture(scope="module")
def gloo(cells, tmp_path_factory):
    """rank -> [result per cell], from one real 4-rank gloo group running every cell in turn."""
    out = tmp_path_factory.mktemp("gloo")
    specs = [c.role_spec(rank_roles(c.shape)[0], STEPS).to_dict() for c in cells]
    start_ranks(_gloo_main, (WORLD, _free_port(), specs, str(out)), WORLD)
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)}


@pytest.fixture(scope="module")
def fake(cells, tmp_path_factory):
    return run_fake_roles(cells, tmp_path_factory.mktemp("fake"), steps=STEPS)


def test_model_states_equal_the_real_run_exactly(cells, gloo, fake):
    """Fake == real gloo, rank by rank, and both == the model. The harness worker's recorded states equal
    the same model for these eight strategies at 4 ranks (tests/distributed/test_parity.py's world4
    cells, `_check_model`), so fit's fake roles measure what a bench cell records without running the
    eight cells a second time here."""
    for i, c in enumerate(cells):
        predicted = state_bytes_by_rank(c.shape)
        for role in rank_roles(c.shape):
            f = fake[(c.cell_id, role.rank)]["model_state_bytes"]
            for rank in role.ranks:
                assert f == gloo[rank][i]["model_state_bytes"], (c.cell_id, role.name, rank)
                assert f["total"] == predicted[rank].total, (c.cell_id, role.name, rank)


def test_peaks_per_role_within_10_percent_of_the_real_run(cells, gloo, fake):
    errors = {}
    for i, c in enumerate(cells):
        for role in rank_roles(c.shape):
            f = fake[(c.cell_id, role.rank)]["peak_bytes"]
            for rank in role.ranks:
                errors[(c.cell_id, role.name, rank)] = (f - gloo[rank][i]["peak_bytes"]) / gloo[rank][i]["peak_bytes"]
    print("\n".join(f"{k}: {100 * v:+.2f}%" for k, v in errors.items()))
    bad = {k: f"{100 * v:+.1f}%" for k, v in errors.items() if abs(v) > PEAK_TOL}
    assert not bad, bad
