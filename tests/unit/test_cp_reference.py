"""The committed context-parallel reference (results/reference/cp-llama3-mini-w4, issue 32) shows what it
claims: every cell matches one device, the K/V bytes the counter filed under cp equal the formula
recomputed here from each record's config, the peak per rank falls with cp at one sequence per
data-parallel rank, and the model predicts that peak within 10% on mean."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from harness.records.reader import latest_per_cell, load_records
from workloads.sizes import get_size

REF = Path(__file__).resolve().parents[2] / "results" / "reference" / "cp-llama3-mini-w4"
RUNS = ("fsdp", "cp2", "cp4")


@pytest.fixture(scope="module")
def cells() -> list[dict]:
    out = []
    for run in RUNS:
        out += [r for r in latest_per_cell(load_records(REF / run))[0]
                if r.get("kind", "cell") == "cell" and r["config"]["world_size"] == 4]
    return out


def _cp(r: dict) -> int:
    return (r["config"]["degrees"] or {}).get("cp", 1)


def test_the_reference_holds_every_layout_at_every_length_ok_and_at_parity(cells):
    assert {(r["config"]["seq_len"], _cp(r)) for r in cells} == {(s, cp) for s in (256, 512, 1024, 2048)
                                                                 for cp in (1, 2, 4)}
    assert all(r["status"] == "ok" and r["metrics"]["parity"]["ok"] for r in cells)


def test_kv_bytes_equal_the_formula(cells):
    checked = 0
    for r in cells:
        c, d = r["config"], r["config"]["degrees"] or {}
        if _cp(r) == 1:
            assert "cp_comm_bytes_per_step" not in r["metrics"]
            continue
        size = get_size(c["size"], c["arch"])
        rows = c["global_batch"] // d.get("dp_shard", 1)
        per_call = 2 * rows * c["seq_len"] * size.kv_dim * 4  # k and v of the whole sequence, fp32
        assert r["metrics"]["cp_comm_bytes_per_step"] == 2 * per_call * size.n_layers, r["cell_id"]
        checked += 1
    assert checked == 8


def test_peak_per_rank_falls_with_cp_and_the_model_predicts_it(cells):
    peak = {(r["config"]["seq_len"], _cp(r)): r["metrics"]["peak_tensor_gib"] for r in cells}
    for seq in (256, 512, 1024, 2048):
        assert peak[seq, 1] > peak[seq, 2] > peak[seq, 4], seq
    errors = [abs(r["predicted"]["peak_tensor_gib"] - r["metrics"]["peak_tensor_gib"]) / r["metrics"]["peak_tensor_gib"]
              for r in cells]
    assert statistics.mean(errors) <= 0.10, errors
