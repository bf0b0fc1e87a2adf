"""What-if planning: hardware table, alpha-beta comm time, model states, MFU and ranking, held to hand arithmetic."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from harness.cli import main
from harness.errors import UsageError
from harness.measure.peaks import datasheet_peak_tflops
from harness.model.compute import recompute_factor
from harness.model.hardware import (
    DEFAULT_EFFICIENCY,
    DEVICES,
    GIB,
    KERNEL_EFFICIENCY,
    MAMF_FRACTION,
    GroupPlacement,
    collective_time_s,
    comm_time_fn,
    get_device,
    placement,
)
from harness.model.inventory import param_specs
from harness.model.memory import state_bytes_by_rank
from harness.model.whatif import plan_at_scale, predict_row, scenario, shape_for
from harness.parallel.dims import ParallelDims
from harness.report.model_error import model_error
from workloads.sizes import get_size

H100 = DEVICES["h100"]
XL = get_size("xl")
N_XL = XL.params
T_XL = len(param_specs(XL))  # parameter tensors: one AdamW `step` scalar (4 bytes) each


# ---- hardware table ----

def test_presets_use_the_one_peak_table_and_measured_fractions():
    for d in DEVICES.values():
        for dtype, peak in d.peak_tflops.items():
            assert datasheet_peak_tflops(d.product, dtype, "cuda") == (peak, None)
    assert DEVICES["h100"].peak_tflops["bf16"] == 989.5 and DEVICES["h100-pcie"].peak_tflops["bf16"] == 756.0
    assert DEVICES["a100"].peak_tflops["bf16"] == 312.0
    assert MAMF_FRACTION == pytest.approx(700.9 / 989.5) and KERNEL_EFFICIENCY == 0.589
    assert DEFAULT_EFFICIENCY == pytest.approx(700.9 / 989.5 * 0.589)
    assert H100.intra.gbps == 450.0 and H100.inter.gbps == 50.0 and DEVICES["a100"].intra.gbps == 300.0
    assert DEVICES["a100"].inter.gbps == 25.0 and get_device("H200").hbm_gib == pytest.approx(143771 / 1024)


def test_unknown_device_names_the_presets():
    with pytest.raises(UsageError, match=r"--device 'h999' is not in the hardware table; .* h100, h100-pcie, h200, a100"):
        get_device("h999")


def test_placement_keeps_tp_in_a_node_and_strides_dp_over_nodes():
    where = placement(ParallelDims(dp_shard=8, tp=8, world_size=64), gpus_per_node=8)
    assert where["tp"] == GroupPlacement(8, 8) and not where["tp"].spans_nodes
    assert where["dp_shard"] == GroupPlacement(8, 1) and where["dp_shard"].spans_nodes
    where = placement(ParallelDims(pp=2, dp_shard=16, tp=2, world_size=64), gpus_per_node=8)
    assert where["tp"] == GroupPlacement(2, 2) and where["dp_shard"] == GroupPlacement(16, 4)
    assert where["pp"] == GroupPlacement(2, 1) and where["pp_p2p"] == GroupPlacement(2, 1)
    assert placement(ParallelDims(pp=8, world_size=8), gpus_per_node=8)["pp_p2p"] == GroupPlacement(2, 2)
    assert placement(ParallelDims(pp=4, tp=4, world_size=16), gpus_per_node=8)["pp_p2p"] == GroupPlacement(2, 1)


# ---- alpha-beta communication time ----

def test_all_reduce_of_1gb_over_8_gpus_on_nvlink4():
    # NVLink 4's 450 GB/s line rate, of which NCCL reaches 370 (nccl-tests #212)
    expected = 5e-6 + 1e9 * 2 * 7 / 8 / 370e9
    assert collective_time_s(H100, "all_reduce", 1e9, GroupPlacement(8, 8)) == pytest.approx(expected, rel=1e-12)
    ddp8 = comm_time_fn(H100, ParallelDims(dp_replicate=8, world_size=8))
    assert ddp8("all_reduce", 10**9, 8) == pytest.approx(expected, rel=1e-12)
    assert ddp8("send_recv", 10**9, 1) == 0.0  # a group of one moves nothing


def test_group_spanning_nodes_runs_at_its_nics():
    # dp_shard 2 strides over tp 8: one rank per node, so one NDR NIC (NCCL at 47 of its 50 GB/s), IB latency
    one_per_node = comm_time_fn(H100, ParallelDims(dp_shard=2, tp=8, world_size=16))
    assert one_per_node("all_gather", 10**9, 2) == pytest.approx(10e-6 + 1e9 * (1 / 2) / 47e9, rel=1e-12)
    assert one_per_node("all_reduce", 10**9, 8) == pytest.approx(5e-6 + 1e9 * 2 * 7 / 8 / 370e9, rel=1e-12)  # tp: NVLink
    # DDP over 2 full nodes: 8 NICs per node carry the ring, min(NVLink's 370, 8 x 47 = 376) = 370 GB/s
    ddp16 = comm_time_fn(H100, ParallelDims(dp_replicate=16, world_size=16))
    assert ddp16("all_reduce", 10**9, 16) == pytest.approx(10e-6 + 1e9 * 2 * 15 / 16 / 370e9, rel=1e-12)
    # pp 2 over 2 nodes of the A100 preset: one HDR NIC (25 GB/s at NDR's 0.94: 23.5), send_recv factor 1
    pp = comm_time_fn(DEVICES["a100"], ParallelDims(pp=2, dp_shard=8, world_size=16))
    assert pp("send_recv", 10**8, 2) == pytest.approx(10e-6 + 1e8 / 23.5e9, rel=1e-12)
    # pp 8 inside one node: every stage pair on NVLink, whatever pp's size
    assert comm_time_fn(H100, ParallelDims(pp=8, world_size=8))("send_recv", 10**8, 2) == \
        pytest.approx(5e-6 + 1e8 / 370e9, rel=1e-12)


def test_same_size_dims_are_priced_at_the_slower_placement_unless_dim_is_given():
    f = comm_time_fn(H100, ParallelDims(dp_shard=8, tp=8, world_size=64))
    nic = 10e-6 + 1e9 * 7 / 8 / 47e9
    assert f("all_gather", 10**9, 8) == pytest.approx(nic, rel=1e-12)
    assert f("all_gather", 10**9, 8, dim="dp") == pytest.approx(nic, rel=1e-12)
    assert f("all_gather", 10**9, 8, dim="tp") == pytest.approx(5e-6 + 1e9 * 7 / 8 / 370e9, rel=1e-12)


# ---- model states (exact) ----

def test_zero3_states_at_64_ranks_are_16n_over_64():
    s = scenario("xl", "h100", 64)
    c = shape_for(s, "fsdp")
    states = state_bytes_by_rank(c)
    # every xl dim 0 (50304, 1024, 2048, 8192) divides by 64: each rank holds exactly N / 64 elements
    assert N_XL % 64 == 0
    assert all(b.total == 16 * N_XL // 64 + 4 * T_XL for b in states)
    assert sum(b.total for b in states) == 16 * N_XL + 64 * 4 * T_XL
    row = predict_row(s, "fsdp")
    assert row["model_states_gib_per_rank"] * GIB == pytest.approx(16 * N_XL / 64, rel=1e-3)
    assert row["model_states_gib_per_rank"] * GIB == 16 * N_XL // 64 + 4 * T_XL


def test_ddp_states_are_16n_per_rank():
    c = shape_for(scenario("xl", "h100", 64), "ddp")
    assert {b.total for b in state_bytes_by_rank(c)} == {16 * N_XL + 4 * T_XL}


def test_tp_local_states():
    d, v, s, L = XL.d_model, XL.vocab_size, XL.seq_len, XL.n_layers
    per_layer = (4 * d * d + 8 * d * d) // 2 + 3 * d // 2 + d + 4 * d // 2 + d + 4 * d  # sharded weights, biases, LNs
    local = v * d + s * d + L * per_layer + 2 * d + v * d // 2  # embeddings, blocks, final norm, half the head
    c = shape_for(scenario("xl", "h100", 2), "tp")
    assert {b.total for b in state_bytes_by_rank(c)} == {16 * local + 4 * T_XL}


# ---- compute, MFU, recompute ----

def test_mfu_is_efficiency_when_nothing_but_matmuls_takes_time():
    fast_hbm = replace(H100, hbm_gbps=1e15)  # AdamW's memory pass ~ 0
    (row,) = plan_at_scale("small", fast_hbm, 1, ["single"], efficiency=0.5)
    assert row["mfu_pct"] == pytest.approx(50.0, rel=1e-6)
    # with the real HBM bandwidth: MFU = efficiency x compute / (compute + optimizer)
    (row,) = plan_at_scale("small", H100, 1, ["single"], efficiency=0.5)
    size = get_size("small")
    compute = 8 * size.seq_len * size.flops_per_token() / (989.5e12 * 0.5)
    optimizer = 28 * size.params / 3350e9
    assert row["compute_s"] == pytest.approx(compute, rel=1e-12)
    assert row["optimizer_s"] == pytest.approx(optimizer, rel=1e-12)
    assert row["step_time_s"] == pytest.approx(compute + optimizer, rel=1e-12)
    assert row["mfu_pct"] == pytest.approx(50.0 * compute / (compute + optimizer), rel=1e-9)
    assert row["tokens_per_s_per_device"] == pytest.approx(8 * size.seq_len / (compute + optimizer), rel=1e-12)


def test_recompute_adds_forward_flops_and_saves_memory():
    """Under one --efficiency: recomputation's forward FLOPs at the same rate (op by op, the trace runs it:
    tests/unit/test_op_pricing.py)."""
    s_full = scenario("xl", "h100", 1, recompute="full", efficiency=0.4)
    c = shape_for(s_full, "single")
    matmul = XL.params_per_layer - 4 * XL.d_model
    # every block's forward again, but its MLP output projection (4d x d: torch's checkpoint stops before it)
    extra = XL.n_layers * (2 * matmul - 2 * 4 * XL.d_model ** 2 + 4 * XL.d_model * XL.seq_len)
    assert recompute_factor(c) == pytest.approx(1 + extra / XL.flops_per_token(), rel=1e-12)
    none, full = predict_row(scenario("xl", "h100", 1, efficiency=0.4), "single"), predict_row(s_full, "single")
    assert full["peak_mem_gib_per_rank"] < none["peak_mem_gib_per_rank"]
    assert full["compute_s"] == pytest.approx(none["compute_s"] * recompute_factor(c), rel=1e-12)
    assert full["mfu_pct"] < none["mfu_pct"]  # MFU counts model FLOPs only


# ---- ranking and validation ----

def test_rank_by_tokens_per_device_among_rows_that_fit():
    small_hbm = replace(H100, hbm_gib=20.0)
    rows = plan_at_scale("xl", small_hbm, 8, ["ddp", "fsdp", "tp", "pp", "fsdp+tp"])
    ranked = [r for r in rows if r["rank"] is not None]
    assert [r["rank"] for r in ranked] == list(range(1, len(ranked) + 1))
    tps = [r["tokens_per_s_per_device"] for r in ranked]
    assert tps == sorted(tps, reverse=True)
    assert all(r["fits"] for r in ranked)
    ddp = next(r for r in rows if r["strategy"] == "ddp")
    assert ddp["rank"] is None and ddp["fits"] is False and "> 20.0 GiB per GPU" in ddp["reason"]
    assert rows[: len(ranked)] == ranked  # unranked rows come last


def test_invalid_strategies_are_rows_with_the_reason():
    rows = plan_at_scale("xl", "h100", 64, ["tp", "pp"])
    assert [r["valid"] for r in rows] == [False, False]
    assert rows[0]["reason"] == "tp (64) must divide n_heads (16); choose tp in {1, 2, 4, 8, 16}"
    assert "pipeline stages (64 = pp 64 x 1 per rank) exceed layers (24)" in rows[1]["reason"]
    (row,) = plan_at_scale("xl", "h100", 16, ["tp"], degrees={"tp": 8, "dp_shard": 2})
    assert "does not synchronise gradients over dp_shard (2)" in row["reason"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(workload="huge"), "--sizes: unknown gpt2 size 'huge'"),
    (dict(gpus=0), "--gpus 0: must be an integer >= 1"),
    (dict(efficiency=1.5), "--efficiency 1.5: must be a fraction of the datasheet peak in (0, 1]"),
    (dict(recompute="some"), "--recompute: unknown activation checkpointing 'some'; choose from none, attn, op, layer2, full"),
    (dict(seq_len=4096), "--seq-len: seq_len (4096) exceeds xl's position table (1024)"),
])
def test_bad_inputs_are_usage_errors(kwargs, message):
    args = dict(workload="xl", device="h100", gpus=8) | kwargs
    with pytest.raises(UsageError) as e:
        scenario(**args)
    assert message in str(e.value)


# ---- measured error of the model ----

def _record(cell, pred, meas, status="ok"):
    return {"schema_version": 1, "kind": "cell", "cell_id": cell, "status": status, "config": {"device_kind": "cpu"},
            "predicted": {"step_time_s": pred}, "metrics": {"step_time_s": {"median": meas}}, "samples": {}}


def test_model_error_over_ok_records_with_both(tmp_path):
    recs = [_record("a", 1.1, 1.0), _record("b", 0.8, 1.0), _record("c", 5.0, 1.0, status="crashed"),
            _record("d", None, 1.0), {**_record("calibration", None, 1.0), "kind": "calibration"}]
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    err = model_error(tmp_path)
    assert err["n"] == 2 and err["mean_pct"] == pytest.approx(15.0) and err["max_pct"] == pytest.approx(20.0)
    assert err["worst_cell"] == "b" and err["device_kind"] == "cpu"
    assert "no measured sweep" in model_error(tmp_path / "missing")["reason"]


# ---- command line ----

def test_cli_whatif_prints_predictions_and_a_ranked_table(capsys, tmp_path):
    rc = main(["plan", "--gpus", "64", "--device", "h100", "--sizes", "xl", "--error-from", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.splitlines()[0].startswith("PREDICTIONS from the analytic model")
    assert re.search(r"^\|\s+1 \| (fsdp|zero2|hsdp) ", out, re.M), out  # sharded data parallel wins at 64
    assert "64 GPUs = 8 node(s) x 8" in out and "InfiniBand NDR" in out
    assert f"model error: n/a: no measured sweep with predictions at {tmp_path}" in out


@pytest.mark.parametrize("argv, message", [
    (["plan", "--gpus", "64", "--device", "h999"], "--device 'h999' is not in the hardware table"),
    (["plan", "--gpus", "x", "--device", "h100"], "--gpus 'x': each value must be an integer >= 1"),
    (["plan", "--gpus", "8", "--device", "a100", "--efficiency", "0"], "--efficiency '0': must be a fraction"),
    (["plan", "--device", "h100"], "give --gpus N"),
    (["bench", "--device", "h100", "--no-calibrate"], "--device 'h100' is a hardware preset: harness plan"),
    (["bench", "--device", "gpu", "--no-calibrate"], "--device 'gpu': runs need auto, cpu or cuda"),
])
def test_cli_bad_values_exit_2_with_one_line(argv, message, capsys, tmp_path):
    rc = main([*argv, *(["--out", str(tmp_path / "run")] if argv[0] == "bench" else [])])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "run").exists()


def test_rows_note_when_same_size_dims_are_placed_differently():
    (row,) = plan_at_scale("small", "h100", 16, ["fsdp"], degrees={"tp": 4, "dp_shard": 4})
    assert row["notes"] == ["dp_shard and tp have the same size: their collectives are priced at the slower placement"]
    (row,) = plan_at_scale("small", "h100", 4, ["fsdp"], degrees={"tp": 2, "dp_shard": 2})  # both on NVLink
    assert row["notes"] == []
