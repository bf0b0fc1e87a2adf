"""The analytic model's arithmetic, held against hand-computed cases (no process group needed)."""

from __future__ import annotations

import math
from dataclasses import replace

import pandas as pd
import pytest

from harness.measure.step_stats import fit_line
from harness.model import comm, memory
from harness.model.compute import ComputeRates, CoreSharing, pass_time_s, pipeline_time_s, stage_shares
from harness.model.inventory import coords, fsdp_local_numel, fsdp_padded_numel, param_specs
from harness.model.schedule import gathers, stage_actions
from harness.model.shape import CellShape
from harness.model.step_time import predict_step
from harness.parallel.presets import degrees_for
from harness.report.model_error import error_summary, model_frame
from workloads.sizes import get_size

TINY = get_size("tiny")


def shape(strategy: str, world: int, **kw) -> CellShape:
    base = dict(size=TINY, dims=degrees_for(strategy, world), strategy=strategy, precision="fp32", global_batch=8)
    base.update(kw)
    return CellShape(**base)


@pytest.mark.parametrize("name", ["tiny", "small", "xl"])
def test_inventory_counts_every_parameter(name):
    size = get_size(name)
    assert sum(math.prod(p.shape) for p in param_specs(size)) == size.params


def test_fsdp_chunks_follow_torch_chunk_and_pad():
    # 10 rows over 4 ranks: torch.chunk gives 3, 3, 3, 1; collectives move 4 x 3 rows
    assert [fsdp_local_numel((10, 2), 4, i) for i in range(4)] == [6, 6, 6, 2]
    assert fsdp_padded_numel((10, 2), 4) == 24
    # 3 rows over 4 ranks: the last rank holds nothing
    assert [fsdp_local_numel((3,), 4, i) for i in range(4)] == [1, 1, 1, 0]


def test_ddp_states_are_16_bytes_per_param_plus_adam_steps():
    s = memory.state_bytes_by_rank(shape("ddp", 2))
    n_tensors = len(param_specs(TINY))
    assert s[0].total == s[1].total == 16 * TINY.params + 4 * n_tensors


def test_zero3_states_at_64_ranks_are_16N_over_64():
    """ZeRO paper, bf16 model with fp32 Adam: 16 bytes x N / ranks for the model states."""
    xl = get_size("xl")
    c = CellShape(size=xl, dims=degrees_for("fsdp", 64), strategy="fsdp", precision="bf16", global_batch=64,
                  device_kind="cuda")
    per_rank = max(s.total for s in memory.state_bytes_by_rank(c))
    exact = 16 * xl.params / 64
    assert per_rank == pytest.approx(exact, rel=1e-3)  # padding of dim 0 to 64 chunks + 4-byte Adam steps
    assert per_rank >= exact


def test_tp_states_shard_columns_and_rows():
    c = shape("tp", 2)
    d, f, v = TINY.d_model, TINY.d_ff, TINY.vocab_size
    replicated = v * d + TINY.seq_len * d + TINY.n_layers * (4 * d + 2 * d) + 2 * d  # embeds, LNs, row biases, norm
    sharded = TINY.n_layers * (3 * (d * d + d) + d * f + f + d * d + f * d) + v * d
    numel = replicated + sharded // 2
    assert memory.state_bytes_by_rank(c)[0].params == 4 * numel


def test_ddp_all_reduces_every_gradient_in_1mib_then_25mib_buckets():
    calls = comm.rank_calls(shape("ddp", 4), coords(degrees_for("ddp", 4))[0])
    assert sum(c.nbytes for c in calls) == 4 * TINY.params
    assert calls[0].nbytes >= comm.DDP_FIRST_BUCKET_BYTES and len(calls) == 2
    assert all(c.collective == "all_reduce" and c.group == 4 for c in calls)


def test_fsdp_gathers_blocks_twice_root_once_zero2_once():
    blocks = TINY.n_layers * TINY.params_per_layer
    fsdp = comm.summarise(comm.rank_calls(shape("fsdp", 2), coords(degrees_for("fsdp", 2))[0]))
    zero2 = comm.summarise(comm.rank_calls(shape("zero2", 2), coords(degrees_for("zero2", 2))[0]))
    assert fsdp["all_gather"]["bytes_per_step"] == 4 * (TINY.params + blocks)
    assert fsdp["all_gather"]["calls_per_step"] == 2 * TINY.n_layers + 1
    assert zero2["all_gather"]["bytes_per_step"] == fsdp["reduce_scatter"]["bytes_per_step"] == 4 * TINY.params


def test_tp_all_reduces_six_activations_per_layer_plus_head():
    c = shape("tp", 2)
    act = 8 * TINY.seq_len * TINY.d_model * 4
    s = comm.summarise(comm.rank_calls(c, coords(c.dims)[0]))
    assert s["all_reduce"] == {"calls_per_step": 6 * TINY.n_layers + 1, "bytes_per_step": (6 * TINY.n_layers + 1) * act}
    assert s["all_gather"]["bytes_per_step"] == 8 * TINY.seq_len * TINY.vocab_size * 4  # the logits


@pytest.mark.parametrize("schedule,m,rank,expected", [
    ("gpipe", 3, 0, "FFFBBB"),
    ("1f1b", 4, 0, "FFBFBFBB"),  # pp 2: stage 0 warms up with 2 forwards
    ("1f1b", 4, 1, "FBFBFBFB"),  # last stage: 1 forward, then alternate
])
def test_stage_actions_follow_torch_schedules(schedule, m, rank, expected):
    actions = stage_actions(schedule, 2, 1, m, rank)
    assert "".join(actions[rank]) == expected


def test_interleaved_schedule_runs_every_forward_and_backward_once_per_stage():
    actions = stage_actions("interleaved1f1b", 2, 2, 4, 0)
    assert sorted(actions) == [0, 2]
    assert all(seq.count("F") == 4 and seq.count("B") == 4 for seq in actions.values())


def test_fsdp_gathers_under_pipelining_follow_the_order():
    # after a forward the block is resharded; after a backward it stays gathered (pipelining)
    assert gathers(list("FFFBBB"), True) == 4  # gpipe: m + 1
    assert gathers(list("FFBFBFBB"), True) == 5
    assert gathers(list("FFBFBFBB"), False) == 1  # root group: gathered once


def test_pipeline_sends_each_microbatch_activation():
    c = shape("pp", 4, microbatches=8, global_batch=16)
    act = 2 * TINY.seq_len * TINY.d_model * 4
    ends = comm.summarise(comm.rank_calls(c, coords(c.dims)[0]))
    middle = comm.summarise(comm.rank_calls(c, coords(c.dims)[1]))
    assert ends["send"] == {"calls_per_step": 8, "bytes_per_step": 8 * act}
    assert middle["recv"] == {"calls_per_step": 16, "bytes_per_step": 16 * act}


def test_bf16_fsdp_gathers_half_the_bytes_and_reduces_in_fp32():
    k = coords(degrees_for("fsdp", 2))[0]
    fp32 = comm.summarise(comm.rank_calls(shape("fsdp", 2), k))
    bf16 = comm.summarise(comm.rank_calls(shape("fsdp", 2, precision="bf16"), k))
    assert bf16["all_gather"]["bytes_per_step"] * 2 == fp32["all_gather"]["bytes_per_step"]
    assert bf16["reduce_scatter"] == fp32["reduce_scatter"]


def test_step_time_adds_compute_optimizer_comm_and_bubble():
    rates = ComputeRates(alpha_s=0.01, beta_s_per_row=0.02, optimizer_s_per_param=1e-9, basis="workload")
    c = shape("ddp", 2)
    per_call = 0.003
    p = predict_step(c, rates, lambda *call: per_call, hide_overlappable=False)
    compute = 0.01 + 4 * 0.02  # one pass of 4 local sequences over the whole model
    assert p.compute_s == pytest.approx(compute)
    assert p.optimizer_s == pytest.approx(1e-9 * TINY.params)
    assert p.exposed_comm_s == pytest.approx(2 * per_call)  # two DDP buckets
    assert p.step_time_s == pytest.approx(compute + 1e-9 * TINY.params + 2 * per_call)
    hidden = predict_step(c, rates, lambda *call: per_call, hide_overlappable=True)
    assert hidden.exposed_comm_s == pytest.approx(2 * per_call)  # first and last bucket: nothing to hide behind
    fsdp = predict_step(shape("fsdp", 2), rates, lambda *call: per_call, hide_overlappable=True)
    assert fsdp.exposed_comm_s == pytest.approx(2 * per_call)  # 13 other gathers / scatters hide behind 0.09 s


def test_wrapped_optimizer_pays_the_dtensor_cost_whatever_the_shard():
    """FSDP over 2 ranks halves the per-parameter AdamW time but not the per-tensor DTensor
    dispatch cost calibrated on a one-rank group; a pipeline stage pays its layers' share of it."""
    plain = ComputeRates(alpha_s=0.0, beta_s_per_row=0.0, optimizer_s_per_param=1e-9, basis="workload")
    wrapped = ComputeRates(alpha_s=0.0, beta_s_per_row=0.0, optimizer_s_per_param=1e-9, basis="workload",
                           wrapper_optimizer_s=0.004)
    fsdp = shape("fsdp", 2)
    base = predict_step(fsdp, plain, lambda *call: 0.0).optimizer_s
    assert predict_step(fsdp, wrapped, lambda *call: 0.0).optimizer_s == pytest.approx(base + 0.004)
    pp = shape("pp", 2, microbatches=4)
    dispatch_only = ComputeRates(alpha_s=0.0, beta_s_per_row=0.0, optimizer_s_per_param=0.0, basis="workload",
                                 wrapper_optimizer_s=0.004)
    # the slowest stage is priced: 2 of tiny's 4 layers, and the last also the head (3 of 5 shares)
    assert predict_step(pp, dispatch_only, lambda *call: 0.0).optimizer_s == pytest.approx(0.004 * 3 / 5)
    assert sorted(share for _, share in stage_shares(pp)) == pytest.approx([2 / 5, 3 / 5])


def test_pipeline_bubble_is_p_minus_1_over_vm_of_the_slowest_stage():
    rates = ComputeRates(alpha_s=0.0, beta_s_per_row=0.08, optimizer_s_per_param=0.0, basis="workload")
    c = shape("pp", 2, microbatches=4)
    p = predict_step(c, rates, lambda *call: 0.0)
    slowest = max(f for f, _ in stage_shares(c))
    assert p.compute_s == pytest.approx(4 * pass_time_s(rates, 2, slowest, 0, 1))  # 8 sequences in 4 microbatches
    assert p.bubble_s == pytest.approx(p.compute_s * (2 - 1) / 4)


def test_cpu_sharing_is_relative_to_the_calibrated_load():
    """Processor sharing: 4 one-thread ranks on 2 cores run at half speed; rates calibrated with
    the 4 in lockstep already hold that, rates of one rank alone (the roofline) do not."""
    lockstep = CoreSharing(cores=2, threads=1, calibrated_busy=4, node_ranks=4)
    assert lockstep.factor(4) == pytest.approx(1.0)
    assert lockstep.factor(2) == lockstep.factor(1) == pytest.approx(0.5)
    alone = CoreSharing(cores=2, threads=1, calibrated_busy=1, node_ranks=4)
    assert alone.factor(4) == pytest.approx(2.0) and alone.factor(2) == pytest.approx(1.0)
    rates = ComputeRates(alpha_s=0.0, beta_s_per_row=0.02, optimizer_s_per_param=0.0, basis="matmul peak")
    ddp4 = shape("ddp", 4)
    assert predict_step(ddp4, rates, lambda *call: 0.0, alone).compute_s == pytest.approx(2 * 2 * 0.02)


def test_pipeline_slots_price_the_bubble_and_fill_it_when_cores_are_oversubscribed():
    s, m = 0.1, 8
    gpu = pipeline_time_s(s, 4, 1, m, 1, CoreSharing(cores=float("inf"), threads=1, calibrated_busy=1))
    assert gpu == pytest.approx(m * s * (1 + 3 / m))  # compute plus the textbook (p - 1) / m bubble
    assert pipeline_time_s(s, 4, 2, m, 1, CoreSharing(cores=float("inf"), threads=1, calibrated_busy=1)) == \
        pytest.approx(m * s * (1 + 3 / (2 * m)))  # interleaved: (p - 1) / (v m)
    # 4 one-thread stages on 2 cores, rates calibrated with all 4 busy (each pass at half speed):
    # busy stages per slot 1, 2, 3, 4 x 5, 3, 2, 1 -> factors 0.5, 0.5, 0.75, 1 x 5, 0.75, 0.5, 0.5
    cpu = pipeline_time_s(s, 4, 1, m, 1, CoreSharing(cores=2, threads=1, calibrated_busy=4, node_ranks=4))
    assert cpu == pytest.approx(s * (0.5 + 0.5 + 0.75 + 5 + 0.75 + 0.5 + 0.5))
    assert m * s < cpu < gpu  # more than the work alone, less than the bubble at full contention
    c = shape("pp", 4, microbatches=8)
    rates = ComputeRates(alpha_s=0.0, beta_s_per_row=0.08, optimizer_s_per_param=0.0, basis="workload")
    p = predict_step(c, rates, lambda *call: 0.0, CoreSharing(cores=2, threads=1, calibrated_busy=4, node_ranks=4))
    assert p.bubble_s == pytest.approx(p.compute_s * (8.5 - 8) / 8)


def test_uncalibrated_comm_gives_no_step_time_and_says_why():
    rates = ComputeRates(alpha_s=0.0, beta_s_per_row=0.01, optimizer_s_per_param=0.0, basis="workload")
    p = predict_step(shape("tp", 2), rates, lambda *call: None)
    assert p.step_time_s is None and "harness calibrate" in p.notes[0]


def test_workload_fit_recovers_a_line():
    a, b = fit_line([1, 2, 4], [0.5 + 0.25 * r for r in (1, 2, 4)])
    assert (a, b) == pytest.approx((0.5, 0.25))


def test_error_summary_is_mean_and_max_of_absolute_errors():
    recs = [{"kind": "cell", "status": "ok", "cell_id": f"c{i}", "config": {"world_size": 2},
             "predicted": {"step_time_s": p, "comm_bytes_per_step": 10, "model_state_bytes_per_rank": 100,
                           "peak_mem_gib": 1.0, "breakdown": {"basis": "workload"}},
             "metrics": {"step_time_s": {"median": 1.0}, "comm_bytes_per_step": 10, "model_state_bytes_per_rank": 100,
                         "peak_mem_gib": 1.0}} for i, p in enumerate((1.1, 0.7))]
    df = model_frame(recs)
    s = error_summary(df)
    assert (s.n, s.mean_abs_pct, s.max_abs_pct, s.worst_cell) == (2, pytest.approx(20.0), pytest.approx(30.0), "c1")
    assert list(df["comm_exact"]) == ["yes", "yes"]  # records without comm_by_rank: the per-step totals
    assert error_summary(pd.DataFrame()).n == 0


def test_step_error_is_also_held_against_the_machine_s_speed_at_the_cell():
    """The normaliser timed around a cell (metrics.machine_probe_s) over its time when the run was
    calibrated is the machine's slowdown; the adjusted error scales the prediction by it."""
    from harness.report.model_error import model_section

    def cell(cid: str, probe: dict | None) -> dict:
        metrics = {"step_time_s": {"median": 0.13}, "comm_bytes_per_step": 0, "model_state_bytes_per_rank": 1,
                   "peak_mem_gib": 1.0}
        if probe is not None:
            metrics["machine_probe_s"] = probe
        return {"kind": "cell", "status": "ok", "cell_id": cid, "run_id": "r", "config": {"world_size": 2},
                "predicted": {"step_time_s": 0.1, "comm_bytes_per_step": 0, "model_state_bytes_per_rank": 1,
                              "peak_mem_gib": 1.0}, "metrics": metrics}

    normaliser = {"kind": "calibration", "cell_id": "calibration", "status": "ok", "run_id": "r",
                  "samples": {"step_time_s": [0.011, 0.010, 0.009]}}
    recs = [normaliser, cell("slowed", {"before": 0.012, "after": 0.014}), cell("unprobed", None)]
    df = model_frame(recs).set_index("cell_id")
    assert df.loc["slowed", "machine_factor"] == pytest.approx(1.3)
    assert df.loc["slowed", "step_time_error_pct"] == pytest.approx(100 * (0.1 - 0.13) / 0.13)
    assert df.loc["slowed", "step_time_adjusted_error_pct"] == pytest.approx(0.0, abs=1e-9)
    assert math.isnan(df.loc["unprobed", "machine_factor"])
    text = model_section(model_frame(recs))
    assert "machine x" in text and "mean |error| 0.0%, max 0.0% (`slowed`) over 1 cells" in text
    other_run = [{**normaliser, "run_id": "other"}, cell("slowed", {"before": 0.012, "after": 0.014})]
    assert math.isnan(model_frame(other_run)["machine_factor"].iloc[0]), "only the cell's own run calibrates it"


def test_sequence_parallel_shards_layernorm_activations():
    base = shape("tp", 2)
    sp = replace(base, dims=degrees_for("tp-sp", 2), strategy="tp-sp")
    assert memory.activation_bytes(sp) < memory.activation_bytes(base)


def test_full_recompute_keeps_less_than_none():
    c = shape("ddp", 2)
    assert memory.activation_bytes(replace(c, recompute="full")) < memory.activation_bytes(replace(c, recompute="selective")) \
        < memory.activation_bytes(c)
