"""The committed production-layouts reference (results/reference/layouts-llama3-cpu-tiny-mini-w4 and
layouts-pp-llama3-cpu-tiny-mini-w4, issue 42) shows what it claims: every cell matches one device, every rank's
collective bytes equal the model recomputed here from the record's config, the model's peak is within 5% of the
measured tensor peak on mean, and sequence parallel lowers the peak per rank against the same layout without it."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from harness.model.comm import comm_by_rank
from harness.model.memory import peak_bytes
from harness.model.shape import CellShape
from harness.records.reader import latest_per_cell, load_records
from harness.spec import CellConfig
from harness.units import GIB

REFERENCE = Path(__file__).resolve().parents[2] / "results" / "reference"
RUNS = ("layouts-llama3-cpu-tiny-mini-w4", "layouts-pp-llama3-cpu-tiny-mini-w4")
POLICIES = {"none", "attn", "op", "layer2", "full"}


@pytest.fixture(scope="module")
def cells() -> list[dict]:
    out = []
    for run in RUNS:
        out += [r for r in latest_per_cell(load_records(REFERENCE / run))[0] if r.get("kind", "cell") == "cell"]
    return out


def _multi(cells: list[dict]) -> list[dict]:
    return [r for r in cells if r["config"]["world_size"] == 4]


def test_every_layout_ran_ok_at_parity(cells):
    multi = _multi(cells)
    layouts = {(r["config"]["size"], r["config"]["strategy"], r["config"]["sequence_parallel"], r["config"]["ac"])
               for r in multi}
    for size in ("tiny", "mini"):
        assert {ac for s, st, _, ac in layouts if (s, st) == (size, "fsdp")} == POLICIES
        for strategy in ("fsdp+tp", "pp+fsdp+tp"):
            assert {sp for s, st, sp, _ in layouts if (s, st) == (size, strategy)} == {True, False}
    for r in multi:
        assert r["status"] == "ok" and r["metrics"]["parity"]["ok"], (r["cell_id"], r["metrics"].get("parity"))


def test_every_rank_s_bytes_are_the_model_s(cells):
    for r in _multi(cells):
        shape = CellShape.of(CellConfig.from_record(r["config"]))
        assert r["metrics"]["comm_by_rank"] == comm_by_rank(shape), r["cell_id"]


def test_the_model_predicts_the_peak_within_5_percent_on_mean(cells):
    errors = []
    for r in cells:
        predicted = peak_bytes(CellShape.of(CellConfig.from_record(r["config"])), 0.0) / GIB
        measured = r["metrics"]["peak_tensor_gib"]
        errors.append(abs(predicted - measured) / measured)
    assert statistics.mean(errors) <= 0.05, sorted(errors)[-5:]


def test_sequence_parallel_lowers_the_peak_per_rank(cells):
    """Under every policy but ``op``, by 7% or more (9-19% in the reference). ``op`` keeps the reduce-scatters' outputs (d / tp each, two a
    block) beside the block's sequence-sharded input, which at tp 2 outweighs what sequence parallel saves of the
    input (d / 2 against d): there the peaks are within 5% of each other, either way."""
    peak = {r["cell_id"]: r["metrics"]["peak_tensor_gib"] for r in _multi(cells)}
    pairs = [(cid, cid.replace("-nosp", "")) for cid in peak if "-nosp" in cid]
    assert len(pairs) == 16
    for off, on in pairs:
        if "-ac-op" in on:
            assert abs(peak[on] / peak[off] - 1) <= 0.05, (on, peak[on], off, peak[off])
        else:
            assert peak[on] < 0.93 * peak[off], (on, peak[on], off, peak[off])


def test_fit_of_8b_and_70b_under_fsdp_tp_with_sp_and_op():
    """``harness fit`` at 8 and 64 ranks (results/reference/fit-llama3-8b-70b-w8-w64-sp): every role's model states
    equal the model's to the byte, its measured peak within 3% of the model's."""
    fits = latest_per_cell(load_records(REFERENCE / "fit-llama3-8b-70b-w8-w64-sp" / "fit.jsonl"))[0]
    assert {(r["config"]["size"], r["config"]["world_size"]) for r in fits} == {
        (s, n) for s in ("llama3-8b", "llama3-70b") for n in (8, 64)}
    for r in fits:
        assert r["config"]["degrees"]["sp"] == 1 and r["config"]["ac"] == "op"
        for role in r["metrics"]["roles"]:
            assert role["model_state_exact"] and role["model_state_bytes"] == role["predicted_model_state_bytes"]
            assert abs(role["peak_error_pct"]) <= 3.0, (r["cell_id"], role["peak_error_pct"])
