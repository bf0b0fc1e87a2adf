"""Prediction terms at every setting they branch on, each expected value worked by hand with its arithmetic beside it.

Issue 61's audit found terms held at one setting of an axis they branch on, and fakes weaker than the real call. The
tables here hold: the pipeline bubble of all six schedules by a hand-played timeline with unequal F, I and W times; the
step time's every branch against a comm fake whose collectives and sizes all cost differently; the checkpoint bytes
per rank at every data-parallel layout; a block's saved bytes per token at every dtype, tp/sp, cp and attention
policy; context parallel's K/V gathers and expert parallel's all-to-alls at every AC policy and dtype.
docs/testing.md ("Terms at every setting") counts the (term, setting) pairs held exactly before and after.

The tiny sizes (workloads/sizes.py): d 128, 4 heads of 32, 4 layers, seq 128, vocab 256. gpt2: learned positions,
LayerNorm, GELU of d_ff 512, biases; 875,264 parameters (tokens 32,768 + positions 16,384 + 4 blocks of 198,272 +
final norm 256 + head 32,768). llama3: 2 kv heads (kv_dim 64), RMSNorm, SwiGLU of d_ff 352 (8 d / 3 = 341, up to a
multiple of 32), RoPE. moe: llama3's attention, 8 experts of d_ff 128, top 2, in all 4 blocks.
"""

from __future__ import annotations

import pytest

from harness.model import comm
from harness.model.activations import block_token_bytes
from harness.model.checkpoint_cost import checkpoint_bytes_by_rank, cost_per_step, node_save_seconds, save_seconds
from harness.model.compute import NO_SHARING, ComputeRates, CoreSharing
from harness.model.inventory import coords
from harness.model.pipeline_sim import ActionTimes, simulate
from harness.model.shape import CellShape
from harness.model.step_time import predict_step
from harness.parallel.presets import degrees_for
from workloads.sizes import get_size

GPT2, LLAMA3, MOE = (get_size("tiny", a) for a in ("gpt2", "llama3", "moe"))


def shape(size, strategy: str, world: int, sp: bool = True, **kw) -> CellShape:
    base = dict(size=size, dims=degrees_for(strategy, world, sequence_parallel=sp), strategy=strategy,
                precision="fp32", global_batch=8)
    base.update(kw)
    return CellShape(**base)


# --- the bubble: every schedule's timeline played by hand, F = 1, I = 2, W = 3 (B = I + W = 5) --------------------
# Each row: per rank (busy, idle). Busy is the rank's work; idle = the step's end (the last action anywhere) - busy.
BUBBLE = [
    # gpipe pp 2 m 2: r0 F0.0 [0,1] F0.1 [1,2]; r1 F1.0 [1,2] F1.1 [2,3] B1.0 [3,8] B1.1 [8,13];
    # r0 B0.0 waits I1.0 (8) [8,13] B0.1 waits I1.1 (13) [13,18]. Busy 2 x 1 + 2 x 5 = 12, idle 18 - 12 = 6 (1/2 = (p-1)/m)
    ("gpipe", 2, 2, [(12, 6), (12, 6)]),
    # 1f1b pp 2 m 2: r1 F1.0 B1.0 F1.1 B1.1: [1,2] [2,7] [7,8] (F0.1 done at 2) [8,13]; r0 F F B0.0 [7,12] B0.1 [13,18]
    ("1f1b", 2, 2, [(12, 6), (12, 6)]),
    # interleaved1f1b pp 2 m 2 (r0 stages 0, 2; r1 1, 3): r0 F0.0 [0,1] F0.1 [1,2] F2.0 [2,3] F2.1 [3,4];
    # r1 F1.0 [1,2] F1.1 [2,3] F3.0 [3,4] B3.0 [4,9] F3.1 [9,10] B3.1 [10,15]; r0 B2.0 [9,14] B2.1 [15,20];
    # r1 B1.0 [15,20] B1.1 [20,25]; r0 B0.0 [20,25] B0.1 [25,30]. Busy 4 + 4 x 5 = 24, idle 6 (1/4 = (p-1)/(v m))
    ("interleaved1f1b", 2, 2, [(24, 6), (24, 6)]),
    # zb pp 2 m 2: r0 F0.0 [0,1] F0.1 [1,2] F2.0 [2,3] F2.1 [3,4]; r1 F1.0 [1,2] F1.1 [2,3] F3.0 [3,4] I3.0 [4,6]
    # F3.1 [6,7] I3.1 [7,9] W3.0 [9,12]; r0 I2.0 [6,8] W2.0 [8,11] I2.1 (I3.1 at 9) [11,13] W2.1 [13,16];
    # r1 I1.0 [12,14] W3.1 [14,17] I1.1 [17,19] W1.0 [19,22] W1.1 [22,25]; r0 I0.0 [16,18] W0.0 [18,21]
    # I0.1 (I1.1 at 19) [21,23] W0.1 [23,26]. Busy 4 x 1 + 4 x 2 + 4 x 3 = 24, idle 26 - 24 = 2
    ("zb", 2, 2, [(24, 2), (24, 2)]),
    # zbv pp 2 m 2 (r0 stages 0, 3; r1 1, 2): r0 F0.0 [0,1] F0.1 [1,2]; r1 F1.0 [1,2] F2.0 [2,3] F1.1 [3,4]
    # F2.1 [4,5]; r0 F3.0 [3,4] I3.0 [4,6] W3.0 [6,9] F3.1 [9,10] I3.1 [10,12] W3.1 [12,15]; r1 I2.0 [6,8]
    # W2.0 [8,11] I1.0 [11,13] W1.0 [13,16] I2.1 [16,18] W2.1 [18,21] I1.1 [21,23] W1.1 [23,26]; r0 I0.0 [15,17]
    # W0.0 [17,20] I0.1 (I1.1 at 23) [23,25] W0.1 [25,28]. Busy 24, idle 28 - 24 = 4
    ("zbv", 2, 2, [(24, 4), (24, 4)]),
    # dualpipev pp 2 m 4 (its fewest: m >= 2 pp): r0 F0.0-F0.2 [0,3] F3.0 [3,4] I3.0 [4,6] W3.0 [6,9] F3.1 [9,10]
    # F0.3 [10,11] B3.1 [11,16] F3.2 (F2.2 at 12) [16,17] B0.0 (I1.0 at 17) [17,22] B3.2 [22,27] F3.3 [27,28]
    # B0.1 (I1.1 at 29) [29,34] B3.3 [34,39] I0.2 (I1.2 at 39) [39,41] W0.2 [41,44] I0.3 [44,46] W0.3 [46,49];
    # r1 F1.0 [1,2] F2.0 [2,3] F1.1 [3,4] F2.1 [4,5] F1.2 [5,6] B2.0 [6,11] F2.2 [11,12] B1.0 [12,17] F1.3 [17,18]
    # B2.1 (I3.1 at 16) [18,23] F2.3 [23,24] B1.1 [24,29] B2.2 (I3.2 at 27) [29,34] B1.2 [34,39] I2.3 (I3.3 at 39)
    # [39,41] I1.3 [41,43] W2.3 [43,46] W1.3 [46,49]. Busy 8 x 1 + 5 x 5 + 3 x (2 + 3) = 48 (r1: 8 + 6 x 5 + 2 x 5),
    # idle 49 - 48 = 1
    ("dualpipev", 2, 4, [(48, 1), (48, 1)]),
]


@pytest.mark.parametrize("schedule, pp, m, expect", BUBBLE, ids=[r[0] for r in BUBBLE])
def test_every_schedule_s_timeline_by_hand(schedule, pp, m, expect):
    got = [(b.busy, b.idle) for b in simulate(schedule, pp, m, ActionTimes(f=1.0, i=2.0, w=3.0))]
    assert got == expect


# --- the step time: every branch of predict_step, with a comm fake that prices each collective and size apart -----
MS = 1e-3
BASE = {"all_reduce": 1 * MS, "all_gather": 2 * MS, "reduce_scatter": 3 * MS, "send_recv": 5 * MS, "all_to_all": 7 * MS}


def strict_comm(collective: str, nbytes: int, group: int, dim: str) -> float:
    """A call's seconds: its collective's own base and 1 ns a byte (no two kinds or sizes alike)."""
    return BASE[collective] + nbytes * 1e-9


# ddp tiny at 2 ranks: two buckets, 1,187,840 B and 2,313,216 B: 1 + 1.18784 = 2.18784 ms, 1 + 2.313216 = 3.313216
DDP_CALLS = 2.18784 * MS + 3.313216 * MS
# fsdp tiny at 2 ranks, in order: the root's all-gather (328,704 B: 2.328704 ms) and reduce-scatter (3.328704), then per
# block 2 all-gathers (forward, backward) and a reduce-scatter of 793,088 B (2.793088, 3.793088 ms), 4 blocks:
# 5.657408 + 8 x 2.793088 + 4 x 3.793088 = 43.174464 ms. The first (root gather) and last (a block's scatter) are the
# edge: 2.328704 + 3.793088 = 6.121792 ms
FSDP_TOTAL, FSDP_EDGE = 43.174464 * MS, 6.121792 * MS
# pp tiny at 2 ranks, 2 microbatches: each rank 2 sends and 2 recvs of 262,144 B (5.262144 ms each); sends are never
# waited for: 2 exposed
P2P = 5.262144 * MS
STEP_TIME = [
    # (name, cell, rates, sharing, hide, compute, optimizer, comm, exposed, bubble)
    # one pass of 4 sequences: 0.01 + 4 x 0.02 = 0.09; AdamW 1e-9 x 875,264 = 8.75264e-4 s; no hiding: both buckets
    ("ddp-no-hiding", shape(GPT2, "ddp", 2), ComputeRates(0.01, 0.02, 1e-9, "workload"), NO_SHARING, False,
     0.09, 8.75264e-4, DDP_CALLS, DDP_CALLS, 0.0),
    # two ranks on one core, calibrated alone: load(2) / load(1) = 2 on compute and optimizer alike
    ("ddp-shared-core", shape(GPT2, "ddp", 2), ComputeRates(0.01, 0.02, 1e-9, "workload"),
     CoreSharing(cores=1, threads=1, calibrated_busy=1, node_ranks=2), False, 0.18, 2 * 8.75264e-4, DDP_CALLS,
     DDP_CALLS, 0.0),
    # the wrappers' optimizer cost: 0.004 x the layers' share (1 without a pipeline) on top of the per-parameter one
    ("ddp-wrapper-optimizer", shape(GPT2, "ddp", 2), ComputeRates(0.01, 0.02, 1e-9, "workload",
                                                                  wrapper_optimizer_s=0.004), NO_SHARING, False,
     0.09, 8.75264e-4 + 0.004, DDP_CALLS, DDP_CALLS, 0.0),
    # hidden behind 0.09 s of compute: only the edge shows (max(edge, total - compute) = edge)
    ("fsdp-hidden", shape(GPT2, "fsdp", 2), ComputeRates(0.01, 0.02, 0.0, "workload"), NO_SHARING, True,
     0.09, 0.0, FSDP_TOTAL, FSDP_EDGE, 0.0),
    # behind 4 x 0.005 = 0.02 s only: 43.174464 - 20 = 23.174464 ms shows, more than the edge
    ("fsdp-past-compute", shape(GPT2, "fsdp", 2), ComputeRates(0.0, 0.005, 0.0, "workload"), NO_SHARING, True,
     0.02, 0.0, FSDP_TOTAL, 23.174464 * MS, 0.0),
    ("fsdp-no-hiding", shape(GPT2, "fsdp", 2), ComputeRates(0.0, 0.005, 0.0, "workload"), NO_SHARING, False,
     0.02, 0.0, FSDP_TOTAL, FSDP_TOTAL, 0.0),
    # stage passes priced apart (0.03 s on rank 0, 0.05 s on rank 1): the slower rank 1 is the step; 2 microbatches
    # x 0.05 = 0.1; bubble: 1f1b's (p - 1) / m = 1/2 of it, 0.05; exposed: its 2 recvs
    ("pp-stage-passes", shape(GPT2, "pp", 2, microbatches=2),
     ComputeRates(0.0, 0.0, 0.0, "op", stage_pass_s=(0.03, 0.05)), NO_SHARING, True,
     0.1, 0.0, 4 * P2P, 2 * P2P, 0.05),
    # zb at 2 ranks, 2 microbatches, 2 stages a rank: the slots' bubble, 0.05 / 2 x (v m + p - 1 = 5 slots) - 0.1 =
    # 0.025, scaled by the simulated bubble over the formula's (p - 1) / (v m) = 1/4. Simulated at F = I = W = 1:
    # r0 F0.0 [0,1] F0.1 [1,2] F2.0 [2,3] F2.1 [3,4]; r1 F1.0 [1,2] F1.1 [2,3] F3.0 [3,4] I3.0 [4,5] F3.1 [5,6] I3.1
    # [6,7] W3.0 [7,8]; r0 I2.0 [5,6] W2.0 [6,7] I2.1 [7,8] W2.1 [8,9]; r1 I1.0 [8,9] W3.1 [9,10] I1.1 [10,11] W1.0
    # [11,12] W1.1 [12,13]; r0 I0.0 [9,10] W0.0 [10,11] I0.1 [11,12] W0.1 [12,13]: 1 idle over 12 busy, so
    # 0.025 x (1/12) / (1/4) = 0.025 / 3. Each rank's two stages send and receive 12 times (stage 0: 2 sends
    # forward, 2 receives backward; stage 2: 2 of each both ways), 6 receives exposed
    ("zb-stage-passes", shape(GPT2, "pp", 2, microbatches=2, pp_schedule="zb"),
     ComputeRates(0.0, 0.0, 0.0, "op", stage_pass_s=(0.03, 0.05)), NO_SHARING, True,
     0.1, 0.0, 12 * P2P, 6 * P2P, 0.025 / 3),
    # expert parallel with the busiest expert 1.5x the mean: compute x (1 + 0.5 x the experts' FLOP share)
    # share = 4 layers x 6 x top 2 x 3 x 128 x 128 / (4 x 1,087,488 + 196,608) = 2,359,296 / 4,546,560 = 0.518919
    # (a block: 6 x 148,480 weights a token multiplies + 12 x 128 x 128 for attention; the head 6 x 128 x 256)
    ("ep-imbalance", shape(MOE, "fsdp+ep", 2, moe_imbalance=1.5), ComputeRates(0.0, 0.02, 0.0, "workload"),
     NO_SHARING, False, 0.08 * (1 + 0.5 * 2359296 / 4546560), 0.0, None, None, 0.0),
    # the first stage the slower (0.05 s a pass): rank 0 is the step, its sends first and its 2 recvs exposed
    ("pp-first-stage-slowest", shape(GPT2, "pp", 2, microbatches=2),
     ComputeRates(0.0, 0.0, 0.0, "op", stage_pass_s=(0.05, 0.03)), NO_SHARING, True,
     0.1, 0.0, 4 * P2P, 2 * P2P, 0.05),
    # 2 accumulation micro-steps of 2 sequences: 2 x (0.01 + 2 x 0.02) = 0.1
    ("ddp-accumulation", shape(GPT2, "ddp", 2, grad_accum=2), ComputeRates(0.01, 0.02, 0.0, "workload"), NO_SHARING,
     False, 0.1, 0.0, None, None, 0.0),
    # context parallel 2: the rank's 8 sequences (dp 1), each half its tokens: 8 x 0.02 / 2 = 0.08
    ("cp-split", shape(GPT2, "fsdp+cp", 2), ComputeRates(0.0, 0.02, 0.0, "workload"), NO_SHARING, False,
     0.08, 0.0, None, None, 0.0),
    # the same imbalance without expert parallel: each rank holds every expert, nothing waits on a busiest one
    ("imbalance-without-ep", shape(MOE, "fsdp", 2, moe_imbalance=1.5), ComputeRates(0.0, 0.02, 0.0, "workload"),
     NO_SHARING, False, 0.08, 0.0, None, None, 0.0),
]


BUBBLE_FRACTION = {"pp-stage-passes": 1 / 2, "pp-first-stage-slowest": 1 / 2, "zb-stage-passes": 1 / 12}
"""The schedule's simulated bubble a row's prediction carries: 1f1b's (p - 1) / m, zb's 1 over 12 (its row above)."""


@pytest.mark.parametrize("row", STEP_TIME, ids=[r[0] for r in STEP_TIME])
def test_every_branch_of_the_step_time_by_hand(row):
    name, c, rates, sharing, hide, compute, optimizer, comm_s, exposed, bubble = row
    fake = strict_comm if comm_s is not None else (lambda *call: 0.0)
    p = predict_step(c, rates, fake, sharing, hide_overlappable=hide)
    assert (p.bubble_fraction, p.basis) == (pytest.approx(BUBBLE_FRACTION.get(name, 0.0)), rates.basis)
    assert p.compute_s == pytest.approx(compute, rel=1e-12)
    assert p.optimizer_s == pytest.approx(optimizer, rel=1e-12)
    assert p.bubble_s == pytest.approx(bubble, rel=1e-12, abs=1e-15)
    if comm_s is not None:
        assert p.comm_s == pytest.approx(comm_s, rel=1e-12)
        assert p.exposed_comm_s == pytest.approx(exposed, rel=1e-12)
        assert p.step_time_s == pytest.approx(compute + optimizer + exposed + bubble, rel=1e-12)


def test_the_step_time_hides_overlappable_calls_unless_told_not_to():
    c, rates = shape(GPT2, "fsdp", 2), ComputeRates(0.01, 0.02, 0.0, "workload")
    assert predict_step(c, rates, strict_comm).exposed_comm_s == pytest.approx(FSDP_EDGE, rel=1e-12)


@pytest.mark.parametrize("compute_rates, hidden", [
    # fsdp-hidden: 0.09 s of compute hides all but the edge: 43.174464 - 6.121792 = 37.052672 ms beside compute
    (ComputeRates(0.01, 0.02, 0.0, "workload"), 37.052672 * MS),
    # fsdp-past-compute: 0.02 s of compute hides 20 ms of the 43.174464 (the rest, 23.174464 ms, shows)
    (ComputeRates(0.0, 0.005, 0.0, "workload"), 20.0 * MS),
], ids=["hidden-behind-compute", "compute-shorter-than-comm"])
def test_hidden_comm_slows_the_compute_beside_it_by_the_overlap_slowdown(compute_rates, hidden):
    # the step gains 0.189 x the comm hidden behind compute; the exposed comm, compute and parts are unchanged
    c = shape(GPT2, "fsdp", 2)
    plain = predict_step(c, compute_rates, strict_comm)
    slowed = predict_step(c, compute_rates, strict_comm, overlap_slowdown=0.189)
    assert plain.interference_s == 0.0
    assert slowed.interference_s == pytest.approx(0.189 * hidden, rel=1e-12)
    assert slowed.step_time_s == pytest.approx(plain.step_time_s + 0.189 * hidden, rel=1e-12)
    assert (slowed.exposed_comm_s, slowed.compute_s) == (plain.exposed_comm_s, plain.compute_s)
    # nothing hidden, nothing slowed: CPU ranks (hide_overlappable False) pay none
    assert predict_step(c, compute_rates, strict_comm, hide_overlappable=False,
                        overlap_slowdown=0.189).interference_s == 0.0


def test_each_call_is_priced_by_its_collective_size_group_and_mesh_dim():
    asked: list[tuple] = []

    def recording(*call):
        asked.append(call)
        return 0.0

    predict_step(shape(GPT2, "fsdp", 2), ComputeRates(0.0, 0.0, 0.0, "workload"), recording)
    predict_step(shape(GPT2, "pp", 2, microbatches=2), ComputeRates(0.0, 0.0, 0.0, "workload"), recording)
    assert asked[0] == ("all_gather", 328_704, 2, "dp")  # fsdp's root gather (rank 0, the one rank priced)
    assert asked[14:] == [("send_recv", 262_144, 2, "pp")] * 8  # both pp ranks: 2 sends and 2 recvs each


def test_a_pipeline_with_data_parallel_ranks_prices_every_stage_and_adds_its_hidden_comm_to_its_recvs():
    """pp+fsdp at 4 ranks (pp 2 x dp_shard 2): ranks 0, 1 hold stage 0, ranks 2, 3 stage 1; one rank of each stage is
    priced (rank 1 is rank 0's like), and the slower stage (rank 2's, 0.05 s a pass) is the step. Its exposed comm is
    its 2 recvs (never overlappable) plus what of its 10 FSDP calls the compute cannot hide: the first and last."""
    c = shape(GPT2, "pp+fsdp", 4, microbatches=2)
    assert (c.dims.pp, c.dims.dp_shard) == (2, 2)
    rates = ComputeRates(0.0, 0.0, 0.0, "op", stage_pass_s=(0.03, 0.05))
    calls = comm.rank_calls(c, coords(c.dims)[2])
    recvs = sum(strict_comm("send_recv", k.nbytes, 2, "pp") for k in calls if k.collective == "recv")
    hidden = [strict_comm(k.collective, k.nbytes, k.group, k.dim) for k in calls if k.overlappable and k.dim == "dp"]
    p = predict_step(c, rates, strict_comm)
    assert p.compute_s == pytest.approx(2 * 0.05)
    assert recvs == pytest.approx(2 * 5.131072 * MS) and len(hidden) == 10  # a microbatch of 2 rows: 131,072 B
    assert p.exposed_comm_s == pytest.approx(recvs + max(hidden[0] + hidden[-1], sum(hidden) - 0.1), rel=1e-12)


def test_an_uncalibrated_pipeline_still_reports_its_slowest_stage():
    """No step time without comm, but the compute, bubble and optimizer known are the slowest rank's, whichever rank
    it is (before, the first rank priced was kept)."""
    for passes in ((0.03, 0.05), (0.05, 0.03)):
        p = predict_step(shape(GPT2, "pp", 2, microbatches=2), ComputeRates(0.0, 0.0, 0.0, "op", stage_pass_s=passes),
                         lambda *call: None)
        assert p.step_time_s is None and p.compute_s == pytest.approx(0.1) and p.bubble_s == pytest.approx(0.05)


def test_the_slowest_rank_is_chosen_by_all_it_pays():
    """Each rank's whole: compute, bubble, optimizer and exposed comm. gpt2 tiny pp 2, 2 microbatches, no comm
    calibration: the wrappers' optimizer cost 0.01 x the stage's share of the layers (rank 0: 2 of 5, 0.004; rank 1
    with the head 3 of 5, 0.006). Equal passes (0.05 s): rank 1, 0.1 + 0.05 + 0.006 = 0.156 over 0.154. Rank 0's
    pass 0.051: 0.102 + 0.051 + 0.004 = 0.157 over rank 1's 0.156, though its compute less its bubble (0.051) and
    its compute less its optimizer (0.149) would rank it otherwise."""
    pp = shape(GPT2, "pp", 2, microbatches=2)
    for passes, compute, optimizer in (((0.05, 0.05), 0.1, 0.006), ((0.051, 0.05), 0.102, 0.004)):
        rates = ComputeRates(0.0, 0.0, 0.0, "op", wrapper_optimizer_s=0.01, stage_pass_s=passes)
        p = predict_step(pp, rates, lambda *call: None)
        assert (p.compute_s, p.optimizer_s) == (pytest.approx(compute), pytest.approx(optimizer))
    # with comm: pp+fsdp at 4 ranks, stage 0's rank exposes 16.25184 ms (2 recvs of 5.131072 ms, its first and last
    # FSDP calls 2.196608 + 3.793088), stage 1's 16.187328 (5.131072 x 2 + 2.793088 + 3.132096). Stage 1's pass 20 us
    # longer: its compute and bubble 3 x 0.05002 = 0.15006 over 0.15, its step 0.166247328 under stage 0's 0.16625184
    rates = ComputeRates(0.0, 0.0, 0.0, "op", stage_pass_s=(0.05, 0.05002))
    p = predict_step(shape(GPT2, "pp+fsdp", 4, microbatches=2), rates, strict_comm)
    assert p.compute_s == pytest.approx(0.1) and p.step_time_s == pytest.approx(0.16625184, rel=1e-12)


def test_the_prediction_as_a_record_holds_it_whole():
    p = predict_step(shape(GPT2, "pp", 2, microbatches=2), ComputeRates(0.0, 0.0, 0.0, "op", stage_pass_s=(0.03, 0.05)),
                     strict_comm)
    assert p.as_dict() == {"step_time_s": p.step_time_s, "compute_s": p.compute_s, "optimizer_s": 0.0,
                           "comm_s": p.comm_s, "exposed_comm_s": p.exposed_comm_s, "bubble_s": p.bubble_s,
                           "bubble_fraction": 0.5, "basis": "op"}
    assert p.as_dict()["step_time_s"] == pytest.approx(0.1 + 0.05 + 2 * P2P, rel=1e-12)


def test_an_uncalibrated_collective_leaves_the_step_unknown_and_names_it():
    """One collective kind missing (the reduce-scatter): no step time, no comm, the compute still priced."""
    def no_scatter(collective, nbytes, group, dim):
        return None if collective == "reduce_scatter" else strict_comm(collective, nbytes, group, dim)

    p = predict_step(shape(GPT2, "fsdp", 2), ComputeRates(0.01, 0.02, 0.0, "workload"), no_scatter)
    assert (p.step_time_s, p.comm_s, p.exposed_comm_s) == (None, None, None)
    assert p.compute_s == pytest.approx(0.09)
    assert p.notes == ("no comm calibration for reduce_scatter over 2 ranks; run harness calibrate --gpus N",)
    p = predict_step(shape(GPT2, "fsdp", 2), ComputeRates(0.01, 0.02, 0.0, "workload"), lambda *call: None)
    assert p.notes == ("no comm calibration for all_gather over 2 ranks, reduce_scatter over 2 ranks; run harness "
                       "calibrate --gpus N",)


# --- checkpoint bytes: 12 bytes a parameter (fp32 weights, AdamW's two moments) and AdamW's 4-byte step count per
# tensor (a 0-d fp32 tensor on every rank, never sharded: 69 tensors in gpt2 tiny, 16 a block), over the data-parallel
# replicas ------------------------------------------------------------------------------------------------------
# gpt2 tiny under tp 2, per rank: the replicated tokens and positions 49,152, norms 4 x 512 + 256, row biases 4 x 256;
# halved: qkv (49,152 + 384), MLP up (65,536 + 512), the row weights 16,384 and 65,536, the head 32,768:
# 49,152 + 4 x (256 + 24,768 + 8,192 + 128 + 256 + 33,024 + 32,768 + 128) + 256 + 16,384 = 463,872
# pp 2: rank 0 the embeddings and blocks 0-1 (49,152 + 2 x 198,272 = 445,696), rank 1 blocks 2-3, the final norm and
# the head (396,544 + 256 + 32,768 = 429,568); its steps: 2 + 2 x 16 = 34 tensors on rank 0, 2 x 16 + 3 = 35 on rank 1
ALL, STEPS = 12 * 875_264, 4 * 69  # 10,503,168 and 276
CHECKPOINT = [
    ("single", 1, [ALL + STEPS]),
    ("ddp", 2, [(ALL + STEPS) / 2] * 2),  # each replica writes half of what it holds (DCP writes a replica once)
    ("fsdp", 2, [ALL / 2 + STEPS] * 2),  # every dim 0 even: exact halves; the steps whole on each rank
    ("hsdp", 4, [(ALL / 2 + STEPS) / 2] * 4),  # half held (2 shards), over 2 replicas
    ("tp", 2, [12 * 463_872 + STEPS] * 2),
    ("pp", 2, [12 * 445_696 + 4 * 34, 12 * 429_568 + 4 * 35]),
]


@pytest.mark.parametrize("strategy, world, expect", CHECKPOINT, ids=[r[0] for r in CHECKPOINT])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])  # the master weights and moments stay fp32 under autocast
def test_checkpoint_bytes_per_rank_at_every_layout(strategy, world, expect, precision):
    c = shape(GPT2, strategy, world, precision=precision, **({"microbatches": 2} if strategy == "pp" else {}))
    assert checkpoint_bytes_by_rank(c) == expect


def test_a_save_s_seconds_and_its_cost_per_step():
    pp = shape(GPT2, "pp", 2, microbatches=2)
    rank0, rank1 = 12 * 445_696 + 4 * 34, 12 * 429_568 + 4 * 35
    assert save_seconds(pp, 2.0) == pytest.approx(rank0 / 2e9, rel=1e-12)  # the busier rank 0
    # one node's filesystem: both ranks' bytes over it; two nodes: the busier node's (rank 0's)
    assert node_save_seconds(pp, 2.0, 1) == pytest.approx((rank0 + rank1) / 2e9, rel=1e-12)
    assert node_save_seconds(pp, 2.0, 2) == pytest.approx(rank0 / 2e9, rel=1e-12)
    assert cost_per_step(0.5, 10, 0.2) == pytest.approx(0.5 / (10 * 0.2))


# --- a block's saved bytes per token: dtype x fsdp x tp/sp x cp x attention policy x device ------------------------
BLOCK = [
    # gpt2 fp32: norms 2 inputs x 128 x 4 + 2 outputs x 128 x 4 = 2,048; attention q, k, v (128 + 128 + 128 x 2 - the
    # output 128 = 384 elements) x 4 = 1,536 (learned positions: no out-projection copy); the output 128 x 4 = 512;
    # GELU in and out 2 x 512 x 4 = 4,096: 8,192
    ("gpt2-fp32", GPT2, "single", 1, {}, 8192),
    # bf16 under autocast, no FSDP: the residual stream stays fp32 (norms 2,048), the rest at 2 bytes:
    # 2,048 + 768 + 256 + 2,048 = 5,120
    ("gpt2-bf16", GPT2, "single", 1, {"precision": "bf16"}, 5120),
    # bf16 under FSDP (param_dtype bf16): the residual stream too: 1,024 + 768 + 256 + 2,048 = 4,096
    ("gpt2-bf16-fsdp", GPT2, "fsdp", 2, {"precision": "bf16"}, 4096),
    # tp 2 without sp: the norms whole (2,048); attention 512 / 2 - 64 = 192 x 4 = 768; output 256; MLP 2,048: 5,120
    ("gpt2-tp", GPT2, "tp", 2, {"sp": False}, 5120),
    # tp 2 with sp: the norms' inputs sequence-sharded (1,024 / 2), their outputs gathered whole (1,024): 4,608
    ("gpt2-tp-sp", GPT2, "tp-sp", 2, {}, 4608),
    # cp 2: k and v gathered whole, 2 x the local tokens': (128 + 128 + 256 x 2 - 128) x 4 = 2,560: 2,048 + 2,560 +
    # 512 + 4,096 = 9,216
    ("gpt2-cp", GPT2, "fsdp+cp", 2, {}, 9216),
    # ac attn: the attention core's saved tensors dropped, its output kept: 2,048 + 512 + 4,096 = 6,656
    ("gpt2-attn", GPT2, "single", 1, {"recompute": "attn"}, 6656),
    # llama3 fp32 on CPU: composite RMSNorms save their fp32 inputs and normalised copies (2 x 128 x 4 each) and
    # their outputs (1,024): 3,072; attention (128 + 128 + 128 - 128) x 4 = 1,024 and, RoPE making q contiguous per
    # head, the out projection's copy of the output (512); the output 512; SwiGLU 4 x 352 x 4 = 5,632: 10,752
    ("llama3-fp32-cpu", LLAMA3, "single", 1, {}, 10752),
    # cp 2: (128 + 128 + 128 x 2 - 128) x 4 = 1,536 + the copy 512: 3,072 + 2,048 + 512 + 5,632 = 11,264
    ("llama3-cp-cpu", LLAMA3, "fsdp+cp", 2, {}, 11264),
    # bf16 under FSDP on CUDA: fused norms (2 x 128 x 2 + 2 x 128 x 2 = 1,024), no output copy (the kernel lays it
    # out per token): 256 x 2 = 512; the output 256; SwiGLU 4 x 352 x 2 = 2,816: 4,608
    ("llama3-bf16-fsdp-cuda", LLAMA3, "fsdp", 2, {"precision": "bf16", "device_kind": "cuda"}, 4608),
]


@pytest.mark.parametrize("name, size, strategy, world, kw, expect", BLOCK, ids=[r[0] for r in BLOCK])
def test_a_block_s_saved_bytes_per_token_by_hand(name, size, strategy, world, kw, expect):
    kw = dict(kw)
    sp = kw.pop("sp", True)
    c = shape(size, strategy, world, sp=sp, device_kind=kw.pop("device_kind", "cpu"), **kw)
    assert block_token_bytes(c) == expect


# --- context parallel's K/V gathers and expert parallel's all-to-alls at every AC policy and dtype -----------------
def _kinds(c: CellShape, dim: str) -> tuple[int, int]:
    calls = [x for x in comm.rank_calls(c, coords(c.dims)[0]) if x.dim == dim]
    return len(calls), sum(x.nbytes for x in calls)


# fsdp+cp tiny gpt2 at 2 ranks (cp 2, dp 1): 8 sequences a rank, one pass. A layer's K/V gather: 8 x 128 x (128 + 4 x
# 32) x 4 B = 1,048,576 (fp32), its gradients' reduce-scatter the same; the attention recomputed gathers once more:
# every layer under attn, full and op; under layer2 blocks 1 and 3 ((i + 1) % 2 == 0)
KV = 1_048_576
CP_AC = [
    ("none", "fp32", 8, 8 * KV), ("attn", "fp32", 12, 12 * KV), ("full", "fp32", 12, 12 * KV),
    ("op", "fp32", 12, 12 * KV), ("layer2", "fp32", 10, 10 * KV),
    ("none", "bf16", 8, 8 * KV // 2), ("full", "bf16", 12, 12 * KV // 2),  # k and v in the compute dtype
]


@pytest.mark.parametrize("ac, precision, calls, nbytes", CP_AC)
def test_context_parallel_gathers_at_every_policy(ac, precision, calls, nbytes):
    assert _kinds(shape(GPT2, "fsdp+cp", 2, recompute=ac, precision=precision), "cp") == (calls, nbytes)


# fsdp+ep tiny moe at 2 ranks: 4 sequences a rank, one pass; per MoE block the forward's 3 all-to-alls (the counts,
# 8 experts x 8 B = 64, then the routed rows out and back: 4 x 128 x top 2 x 128 x 4 B = 524,288 each) and the
# backward's 2; a block whose forward runs again (every block under full and op, blocks 1 and 3 under layer2, none
# under attn) 3 more. none: 4 x 5 calls, 4 x (64 + 4 x 524,288) = 8,388,864 B; full: 4 x 8, 4 x (2 x 1,048,640 +
# 1,048,576) = 12,583,424; layer2: 2 x 5 + 2 x 8 = 26, 2 x 2,097,216 + 2 x 3,145,856 = 10,486,144. bf16 under FSDP:
# rows in the residual stream's bf16, 262,144 B each
EP_AC = [
    ("none", "fp32", 20, 8_388_864), ("attn", "fp32", 20, 8_388_864), ("full", "fp32", 32, 12_583_424),
    ("op", "fp32", 32, 12_583_424), ("layer2", "fp32", 26, 10_486_144),
    ("none", "bf16", 20, 4 * (64 + 4 * 262_144)), ("full", "bf16", 32, 4 * (2 * (64 + 2 * 262_144) + 2 * 262_144)),
]


@pytest.mark.parametrize("ac, precision, calls, nbytes", EP_AC)
def test_expert_all_to_alls_at_every_policy(ac, precision, calls, nbytes):
    assert _kinds(shape(MOE, "fsdp+ep", 2, recompute=ac, precision=precision), "ep") == (calls, nbytes)


def test_the_tables_cover_every_schedule_policy_and_layout():
    """The axes each table is held at, against the harness's own lists: a schedule or policy added later fails here
    until a row holds it."""
    from harness.parallel.activation_checkpoint import AC_POLICIES  # noqa: PLC0415
    from harness.parallel.schedules import PP_SCHEDULES  # noqa: PLC0415

    assert {r[0] for r in BUBBLE} == set(PP_SCHEDULES)
    fixed = {p for p in AC_POLICIES if not p.startswith("layer")} | {"layer2"}
    assert {r[0] for r in CP_AC} == {r[0] for r in EP_AC} == fixed


# --- compute: the pipeline stages' shares, the roofline, core sharing with threads ---------------------------------
# gpt2 tiny, per token: a block 6 x 197,760 weights and biases its linears multiply and add (q, k, v, o 4 x (128 x 128
# + 128); the MLP 128 x 512 + 512 and 512 x 128 + 128) + 12 x 128 x 128 for attention = 1,383,168; the head 6 x 128 x
# 256 = 196,608; the model 4 x 1,383,168 + 196,608 = 5,729,280. Layers' shares count the head as a layer: 5 in all.
BLOCK_FLOPS, HEAD_FLOPS, MODEL_FLOPS = 1_383_168, 196_608, 5_729_280
STAGES = [
    # 1f1b pp 2: rank 0 blocks 0-1, rank 1 blocks 2-3 and the head
    ("1f1b", [(2 * BLOCK_FLOPS / MODEL_FLOPS, 2 / 5), ((2 * BLOCK_FLOPS + HEAD_FLOPS) / MODEL_FLOPS, 3 / 5)]),
    # interleaved pp 2 x 2 stages of one block: rank 0 stages 0 and 2 (blocks 0, 2), rank 1 stages 1 and 3 (blocks
    # 1, 3 and the head)
    ("interleaved1f1b", [(2 * BLOCK_FLOPS / MODEL_FLOPS, 2 / 5), ((2 * BLOCK_FLOPS + HEAD_FLOPS) / MODEL_FLOPS, 3 / 5)]),
    # zbv: the V, rank 0 stages 0 and 3 (blocks 0, 3 and the head), rank 1 stages 1 and 2
    ("zbv", [((2 * BLOCK_FLOPS + HEAD_FLOPS) / MODEL_FLOPS, 3 / 5), (2 * BLOCK_FLOPS / MODEL_FLOPS, 2 / 5)]),
]


def test_stage_shares_of_a_dense_then_moe_model_count_each_block_as_it_is():
    """moe tiny with its first block dense (d_ff 256): per token the dense block 6 x (attention 4 x 128 x 128 with 2 kv
    heads: 49,152; SwiGLU 3 x 128 x 256) + 12 x 128 x 128 = 1,081,344, an MoE block 6 x 148,480 + 196,608 =
    1,087,488, the head 196,608: 4,540,416 in all. zbv: rank 0 blocks 0 and 3 and the head (2,365,440), rank 1
    blocks 1 and 2 (2,174,976); the mean block (1,085,952) would give rank 0 2,368,512."""
    from dataclasses import replace  # noqa: PLC0415

    from harness.model.compute import stage_shares  # noqa: PLC0415

    size = replace(MOE, dense_layers=1, dense_d_ff=256)
    got = stage_shares(shape(size, "pp", 2, microbatches=4, pp_schedule="zbv"))
    assert got == [(pytest.approx(2_365_440 / 4_540_416, rel=1e-12), pytest.approx(3 / 5)),
                   (pytest.approx(2_174_976 / 4_540_416, rel=1e-12), pytest.approx(2 / 5))]


@pytest.mark.parametrize("schedule, shares", STAGES, ids=[r[0] for r in STAGES])
def test_each_pipeline_rank_s_share_of_the_flops_and_layers(schedule, shares):
    from harness.model.compute import stage_shares  # noqa: PLC0415

    got = stage_shares(shape(GPT2, "pp", 2, microbatches=4, pp_schedule=schedule))
    assert got == [(pytest.approx(f, rel=1e-12), pytest.approx(layers, rel=1e-12)) for f, layers in shares]


def test_the_roofline_a_pass_core_sharing_and_the_experts_share_by_hand():
    from harness.model.compute import expert_flop_share, pass_time_s, pipeline_time_s, roofline_rates  # noqa: PLC0415

    c = shape(GPT2, "single", 1)
    r = roofline_rates(c, 0.5, mem_gbps=20.0)
    assert (r.alpha_s, r.basis) == (0.0, "matmul peak")
    assert r.beta_s_per_row == GPT2.flops_per_token() * 128 / (0.5 * 1e12)  # the FLOPs of a row at the peak
    assert r.optimizer_s_per_param == pytest.approx(28 / 20e9, rel=1e-12)  # 7 fp32 reads and writes a parameter
    assert roofline_rates(c, 0.5).optimizer_s_per_param == 0.0  # no bandwidth known: no optimizer time
    # a pass: (alpha + the wrappers' per-pass cost) x the layers' share + rows x beta x the FLOPs' share / split
    wrapped = ComputeRates(0.01, 0.02, 0.0, "workload", wrapper_overhead_s=0.004)
    assert pass_time_s(wrapped, 2, 0.5, 0.4, 2) == pytest.approx((0.01 + 0.004) * 0.4 + 2 * 0.02 * 0.5 / 2)
    # 2 threads a rank on 4 cores: 4 ranks busy load 2, one alone 1 (max(1, 2 / 4)): twice as slow
    assert CoreSharing(cores=4, threads=2, calibrated_busy=1).factor(4) == pytest.approx(2.0)
    # 2 ranks a stage (dp 2 under pp 2) on 2 cores, calibrated with all 4 busy: the slots' stages 1, 2, 1 busy make
    # 2, 4, 2 ranks busy: load 1, 2, 1 over 2: 0.5 + 1 + 0.5 passes of 0.1 s
    sharing = CoreSharing(cores=2, threads=1, calibrated_busy=4, node_ranks=4)
    assert pipeline_time_s(0.1, 2, 1, 2, 2, sharing) == pytest.approx(0.2)
    assert expert_flop_share(c) == 0.0  # a dense model has no experts


# --- power: a cap's share of the compute peaks, (cap / board power) ** (1/3) --------------------------------------
POWER = [
    (None, 1.0),  # no cap: the datasheet's clocks
    (700, 1.0),  # capped at the board power: nothing changes
    (500, 0.893904),  # (5/7) ** (1/3): 0.714286 ** 0.333333
    (350, 0.793701),  # (1/2) ** (1/3)
]


@pytest.mark.parametrize("cap, scale", POWER)
def test_a_power_cap_s_share_of_the_compute_peaks(cap, scale):
    from harness.model.hardware import get_device, with_overrides  # noqa: PLC0415

    dev = with_overrides(get_device("h100"), power_cap_w=cap)  # h100 SXM: 700 W
    assert dev.compute_scale == pytest.approx(scale, abs=1e-6)
    assert dev.hbm_gbps == get_device("h100").hbm_gbps  # memory bandwidth is not scaled
