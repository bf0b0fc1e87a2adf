"""The memory and communication model on `tiny`, every term worked out by hand (harness/model/memory.py, comm.py).

tiny: L 4 layers, d 128, V 256, S 128, 875,264 parameters in 69 tensors. Per layer and token the
saved activations are 4 d elements in the residual dtype (/ tp under sequence parallel) plus
12 d in the compute dtype / tp; selective recompute drops 4 d of those; full keeps d per layer
plus one layer's worth.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from harness.model import comm, memory, schedule
from harness.model.inventory import ParamSpec, coords
from harness.model.shape import CellShape
from harness.parallel.presets import degrees_for
from workloads.model import Decoder
from workloads.sizes import get_size

TINY = get_size("tiny")
PARAMS, TENSORS = 875_264, 69
BLOCK = 198_272  # 12 d^2 + 13 d
ROOT = PARAMS - 4 * BLOCK  # embeddings, final norm, head: 82,176


def shape(strategy: str, world: int, **kw) -> CellShape:
    base = dict(size=TINY, dims=degrees_for(strategy, world), strategy=strategy, precision="fp32", global_batch=8)
    base.update(kw)
    return CellShape(**base)


def test_tiny_inventory_is_what_the_model_builds() -> None:
    with torch.device("meta"):
        params = list(Decoder(TINY).parameters())
    assert (sum(p.numel() for p in params), len(params)) == (PARAMS, TENSORS)
    assert ROOT == 82_176


@pytest.mark.parametrize("strategy, world, kw, expected", [
    # rows x S tokens x layers x per-layer bytes per token
    ("single", 1, {}, 8 * 128 * 4 * (16 * 128 + 48 * 128)),  # fp32: 4d*4 + 12d*4 = 64 d bytes
    # attn (named selective before): q, k, v recomputed (3 d x 4); the output projection keeps its input
    ("single", 1, {"recompute": "selective"}, 8 * 128 * 4 * (64 - 12) * 128),
    ("single", 1, {"recompute": "full"}, 8 * 128 * 4 * 128 * 4),  # each block's input only
    ("single", 1, {"precision": "bf16"}, 8 * 128 * 4 * (4 * 128 * 4 + 12 * 128 * 2)),
    ("single", 1, {"precision": "bf16", "recompute": "attn"}, 8 * 128 * 4 * (4 * 128 * 4 + 9 * 128 * 2)),
    ("single", 1, {"grad_accum": 2}, 4 * 128 * 4 * 64 * 128),  # one micro-step of 4 rows
    ("ddp", 2, {}, 4 * 128 * 4 * 64 * 128),  # 4 local rows
    ("tp", 2, {}, 8 * 128 * 4 * (4 * 128 * 4 + 12 * 128 * 4 // 2)),
    # SP: the LayerNorm inputs sequence-sharded (2d / tp), their outputs saved all-gathered by the linears (2d)
    ("tp-sp", 2, {}, 8 * 128 * 4 * (2 * 128 * 4 // 2 + 2 * 128 * 4 + 12 * 128 * 4 // 2)),
    ("tp-sp", 2, {"recompute": "full"}, 8 * 128 * 4 * 128 * 4 // 2),  # block inputs, sequence-sharded
    ("fsdp", 2, {"precision": "bf16"}, 4 * 128 * 4 * (4 * 128 * 2 + 12 * 128 * 2)),  # MP casts the stream too
    # pp 2, 4 microbatches of 2 rows, 2 layers per stage; 1F1B holds pp = 2 microbatches, GPipe all 4;
    # each in-flight microbatch also keeps the first stage's output (d fp32 per token) for its backward
    ("pp", 2, {"microbatches": 4}, 2 * 128 * 2 * (2 * 64 * 128 + 4 * 128)),
    ("pp", 2, {"microbatches": 4, "pp_schedule": "gpipe"}, 2 * 128 * 4 * (2 * 64 * 128 + 4 * 128)),
    ("pp", 2, {"microbatches": 8, "global_batch": 16}, 2 * 128 * 2 * (2 * 64 * 128 + 4 * 128)),
])
def test_activation_bytes_exact(strategy: str, world: int, kw: dict, expected: int) -> None:
    assert memory.activation_bytes(shape(strategy, world, **kw)) == expected


@pytest.mark.parametrize("strategy, world, kw, expected", [
    # Context parallel 2 (issue 61: the gathered K/V held at cp > 1 by value): each rank holds S / cp = 64 of a
    # sequence's tokens, but attention saves the whole sequence's k and v, gathered: 2 d x cp elements per local
    # token in place of 2 d, so the 12 d compute elements become 12 d + 2 d (cp - 1) = 14 d.
    ("fsdp+cp", 2, {}, 8 * 64 * 4 * (16 * 128 + 14 * 128 * 4)),  # fp32: 16 d + 56 d = 72 d bytes
    ("fsdp+cp", 4, {}, 4 * 64 * 4 * (16 * 128 + 14 * 128 * 4)),  # dp_shard 2: 4 local rows
    # selective recompute drops q (d) and the gathered k, v (2 d x cp = 4 d): 72 d - 5 d x 4 = 52 d bytes
    ("fsdp+cp", 2, {"recompute": "selective"}, 8 * 64 * 4 * 52 * 128),
    # bf16 under FSDP's mixed precision (the stream cast too): 4 d x 2 + 14 d x 2 = 36 d bytes
    ("fsdp+cp", 2, {"precision": "bf16"}, 8 * 64 * 4 * (4 * 128 * 2 + 14 * 128 * 2)),
    # tp 2 with sequence parallel (the tp-sp row's 36 d) and cp 2: the gathered k, v add 2 d (cp - 1) / tp
    # elements = d, 4 d bytes: 40 d
    ("fsdp+tp+cp", 4, {}, 8 * 64 * 4 * (2 * 128 * 4 // 2 + 2 * 128 * 4 + 12 * 128 * 4 // 2 + 128 * 4)),
])
def test_context_parallel_activation_bytes_exact(strategy: str, world: int, kw: dict, expected: int) -> None:
    assert memory.activation_bytes(shape(strategy, world, **kw)) == expected


def test_inflight_microbatches() -> None:
    assert memory.inflight_microbatches(shape("ddp", 2)) == 1
    assert memory.inflight_microbatches(shape("pp", 2, microbatches=4, pp_schedule="gpipe")) == 4
    assert memory.inflight_microbatches(shape("pp", 2, microbatches=4)) == 2
    assert memory.inflight_microbatches(shape("pp", 4, microbatches=4)) == 4
    assert memory.inflight_microbatches(shape("pp", 4, microbatches=8, global_batch=16)) == 4


def test_logits_bytes_exact() -> None:
    # the loss's backward, rows x S x V x 3 fp32 tensors (log-softmax's output, nll's gradient, log-softmax's)
    assert memory.logits_bytes(shape("single", 1)) == 8 * 128 * 256 * (4 + 8)
    # in every precision: the bf16 logits and their fp32 copy are freed by then (tests/unit/test_autocast_copies.py)
    assert memory.logits_bytes(shape("single", 1, precision="bf16")) == 8 * 128 * 256 * (4 + 8)
    # the forward's: the bf16 logits, their fp32 copy and log-softmax's output; fp32's copy is the logits themselves
    assert memory.forward_logits_bytes(shape("single", 1, precision="bf16")) == 8 * 128 * 256 * (2 + 4 + 4)
    assert memory.forward_logits_bytes(shape("single", 1)) == 8 * 128 * 256 * (4 + 4)
    # a pipeline's last stage also keeps its output, the logits, for its backward (harness fit measured 4 copies)
    assert memory.logits_bytes(shape("pp", 2, microbatches=4)) == 2 * 128 * 256 * 16


def test_transient_buffers_exact() -> None:
    assert memory.transient_param_bytes(shape("single", 1)) == 0
    assert memory.transient_param_bytes(shape("tp", 2)) == 0
    assert memory.transient_param_bytes(shape("ddp", 2)) == 4 * PARAMS  # bucket copies of every gradient
    # FSDP: the root group and two blocks gathered (current + prefetched); tiny's dims all split evenly.
    assert memory.transient_param_bytes(shape("fsdp", 2)) == 4 * (ROOT + 2 * BLOCK)
    assert memory.transient_param_bytes(shape("fsdp", 2, precision="bf16")) == 2 * (ROOT + 2 * BLOCK)
    assert memory.transient_param_bytes(shape("zero2", 2)) == 4 * PARAMS  # nothing resharded after forward


def test_state_bytes_exact() -> None:
    single = memory.state_bytes_by_rank(shape("single", 1))
    assert single == [memory.StateBytes(params=4 * PARAMS, grads=4 * PARAMS, optimizer=8 * PARAMS + 4 * TENSORS)]
    assert single[0].total == 16 * PARAMS + 4 * TENSORS
    assert single[0].as_dict() == {"params": 4 * PARAMS, "grads": 4 * PARAMS, "optimizer": 8 * PARAMS + 4 * TENSORS,
                                   "total": 16 * PARAMS + 4 * TENSORS}
    fsdp = memory.state_bytes_by_rank(shape("fsdp", 2))
    assert [s.params for s in fsdp] == [2 * PARAMS, 2 * PARAMS]
    assert fsdp[0].optimizer == 8 * PARAMS // 2 + 4 * TENSORS
    assert memory.local_params(shape("fsdp", 2)) == PARAMS // 2
    assert memory.local_params(shape("ddp", 2)) == PARAMS
    hsdp = memory.state_bytes_by_rank(shape("hsdp", 4))
    assert [s.params for s in hsdp] == [2 * PARAMS] * 4


def test_uneven_fsdp_shards_follow_torch_chunk_per_rank() -> None:
    with torch.device("meta"):
        params = list(Decoder(TINY).parameters())
    # dim 0 of every tensor chunked over 3 ranks the way torch.chunk does: 43, 43, 42 of 128 rows.
    expected = [sum(torch.chunk(torch.empty(p.shape[0], device="meta"), 3)[k].numel() * p[0].numel() for p in params)
                for k in range(3)]
    assert expected[0] == expected[1] > expected[2]
    got = memory.state_bytes_by_rank(shape("fsdp", 3, global_batch=9))
    assert [s.params for s in got] == [4 * n for n in expected]
    assert memory.local_params(shape("fsdp", 3, global_batch=9)) == expected[0]


def test_pipeline_stages_hold_their_own_layers() -> None:
    ranks = memory.state_bytes_by_rank(shape("pp", 2, microbatches=4))
    # stage 0: embeddings (256 + 128) x 128 and 2 blocks; stage 1: 2 blocks, final norm, head.
    stage0 = (256 + 128) * 128 + 2 * BLOCK
    stage1 = 2 * BLOCK + 2 * 128 + 128 * 256
    assert [s.params for s in ranks] == [4 * stage0, 4 * stage1]
    assert [s.optimizer for s in ranks] == [8 * stage0 + 4 * (2 + 32), 8 * stage1 + 4 * (32 + 3)]


def test_peak_is_the_largest_moment_of_the_step() -> None:
    """Parameters and AdamW state, buffers, and the largest of: the turn from forward to backward
    (saved activations and logits), the top block's backward (saved activations and the GELU
    gradient) and the last block backward (every gradient and one block's activations)."""
    tokens = 8 * 128
    gelu = tokens * 4 * 128 * 4
    states = 12 * PARAMS + 4 * TENSORS  # fp32 params, two fp32 moments, a step per tensor; no gradients yet
    c = shape("single", 1)
    acts, logits = tokens * 4 * 64 * 128, tokens * 256 * 12
    assert memory.peak_bytes(c, 1000) == states + acts + logits + 1000
    full = replace(c, recompute="full")  # block inputs only: the last block backward, with every gradient, wins
    bottom = 4 * PARAMS + tokens * 64 * 128 + gelu
    assert bottom > tokens * 4 * 128 * 4 + max(logits, tokens * 64 * 128 + gelu)
    assert memory.peak_bytes(full, 0.0) == states + bottom
    ddp = shape("ddp", 2)  # DDP's buckets (4 bytes per parameter) beside the states; 4 local rows
    # at 512 local tokens the top block's backward wins: its GELU gradient (4 d x 4 = 2,048 B/token) and its own
    # fp32 gradients (4 x BLOCK = 793,088 B) outweigh the logits (256 x 12 = 3,072 B/token): 268,800 B more
    top = tokens // 2 * (4 * 64 * 128 + 4 * 128 * 4) + 4 * BLOCK
    assert top - tokens // 2 * (4 * 64 * 128 + 256 * 12) == 268_800
    assert memory.peak_bytes(ddp, 0.0) == states + 4 * PARAMS + top
    tp = shape("tp", 2)  # the column-parallel head's shard and the gathered logits on every rank
    s = max(memory.state_bytes_by_rank(tp), key=lambda x: x.total)
    assert memory.peak_bytes(tp, 0.0) == s.params + s.optimizer + memory.activation_bytes(tp) \
        + tokens * 256 * (4 + 8 + 4 // 2)
    pp = shape("pp", 2, microbatches=4)  # gradients live from the first microbatch's backward on
    first, last = memory.state_bytes_by_rank(pp)
    rows = 2 * 128
    # torch's PipelineStage holds one receive buffer per microbatch for the whole step (stage.py's
    # _create_grad_recv_info / _setup_forward_recv_info): rank 0 its output's gradient, rank 1 its input
    recv = 4 * rows * 128 * 4
    # 2 in flight + GELU grad + the new gradient of the top block's largest tensor (fc, 4 d x d fp32) before it is added
    # into the earlier microbatches'
    peak_first = first.total + rows * 2 * (2 * 64 * 128 + 4 * 128) + rows * 4 * 128 * 4 + recv + 4 * 512 * 128
    peak_last = last.total + rows * 2 * 64 * 128 + rows * 256 * 16 + recv  # one in flight and its logits, kept
    assert [memory.stage_peak_bytes(pp, r) for r in (0, 1)] == [peak_first, peak_last]
    assert memory.peak_bytes(pp, 0.0) == max(peak_first, peak_last)


@pytest.mark.parametrize("schedule, ends", [
    # receive buffers per microbatch by placement, counted by hand: a stage that is not the first receives its
    # input, one that is not the last its output's gradient (torch.distributed.pipelining.stage)
    ("1f1b", [1, 1]),  # rank 0: stage 0 (a gradient); rank 1: stage 1, the last (an input)
    ("gpipe", [1, 1]),
    ("interleaved1f1b", [3, 3]),  # looped: rank 0 stages 0 (1) and 2 (2); rank 1 stages 1 (2) and 3 (1)
    ("zb", [3, 3]),
    ("zbv", [2, 4]),  # a V: rank 0 stages 0 (1) and 3 (1); rank 1 stages 1 and 2 (2 each)
    ("dualpipev", [2, 4]),
])
def test_pipeline_receive_buffers_per_stage_and_microbatch(schedule, ends) -> None:
    c = shape("pp", 2, microbatches=4, pp_schedule=schedule)  # 8 rows / 4 microbatches: 2 rows of 128 tokens
    hidden = 2 * 128 * 128 * 4  # rows x seq x d_model, fp32 stream
    assert [memory.pipeline_recv_bytes(c, r) for r in (0, 1)] == [4 * e * hidden for e in ends]


def test_pipeline_receive_buffers_follow_the_stream_dtype_and_sequence_shards() -> None:
    """bf16 under FSDP's param dtype halves each buffer; sequence parallel at tp 2 hands half the sequence on;
    without a pipeline there is none."""
    fsdp = shape("pp+fsdp", 4, microbatches=2, precision="bf16")  # 8 rows / dp 2 / 2: 2 rows each
    assert memory.pipeline_recv_bytes(fsdp, 0) == 2 * (2 * 128 * 128 * 2)
    sp = shape("pp+fsdp+tp", 8, microbatches=2)
    assert sp.dims.sequence_parallel and sp.dims.tp == 2
    assert memory.pipeline_recv_bytes(sp, 1) == 2 * (2 * 128 * 128 * 4 // 2)
    assert memory.pipeline_recv_bytes(shape("fsdp", 2), 0) == 0


def test_pipeline_fsdp_holds_its_stage_unsharded_from_the_first_backward() -> None:
    """pp 2 x dp_shard 2: torch's schedule turns FSDP's gradient sync and reshard-after-backward off for every
    microbatch's backward and reduces after the last, so a stage's gradients (fp32) and gathered parameters
    are whole from its first backward to the step's end. Stage 0 runs 4 microbatches and holds 2 in flight:
    its turn comes again after a backward, with them."""
    c = shape("pp+fsdp", 4, microbatches=4)  # 8 rows / dp 2 / 4 microbatches: 1 row each
    stage0 = (256 + 128) * 128 + 2 * BLOCK
    stage1 = 2 * BLOCK + 2 * 128 + 128 * 256
    assert [memory.pipeline_unsharded_grad_bytes(c, r) for r in (0, 1)] == [4 * stage0, 4 * stage1]
    first = memory.state_bytes_by_rank(c)[0]
    assert first.params == 4 * stage0 // 2  # sharded over 2
    tokens = 128
    saved = 2 * tokens * (2 * 64 * 128 + 4 * 128)  # 2 in flight: 2 layers and the stage output each
    gelu = tokens * 4 * 128 * 4
    window = 4 * ((256 + 128) * 128 + 2 * BLOCK)  # the root (embeddings) and two blocks gathered: all of stage 0
    turn = saved + 4 * stage0 + window + gelu  # the top block's backward, gradients whole
    recv = 4 * tokens * 128 * 4  # stage 0's gradient receive buffers, one per microbatch (fp32 stream)
    assert memory.stage_peak_bytes(c, 0) == first.params + first.optimizer + recv + turn
    # one microbatch each: no turn after a backward, so the bottom block's backward with everything whole wins
    one = shape("pp+fsdp", 4, microbatches=2, global_batch=4)
    assert memory.inflight_microbatches(one, 0) == 2
    s = memory.state_bytes_by_rank(one)[0]
    bottom = tokens * (2 * 64 * 128 + 4 * 128) + tokens * 64 * 128 + gelu + 4 * stage0 + window  # 1 other in flight
    assert memory.stage_peak_bytes(one, 0) == s.params + s.optimizer + 2 * tokens * 128 * 4 + bottom


# ---- communication per rank: exact calls, bytes, mesh dimension and overlap (harness/model/comm.py)


def _calls(c: CellShape, index: int = 0) -> list[comm.Call]:
    return comm.rank_calls(c, coords(c.dims)[index])


def _summary(c: CellShape, index: int = 0) -> dict:
    return comm.summarise(_calls(c, index))


def test_gpipe_runs_all_forwards_then_all_backwards_on_every_stage() -> None:
    assert schedule.stage_actions("gpipe", 2, 1, 3, 1) == {1: list("FFFBBB")}  # the last stage too
    assert schedule.stage_actions("1f1b", 2, 1, 3, 1) == {1: list("FBFBFB")}


def test_calls_carry_their_dimension_group_and_overlap() -> None:
    kinds = lambda calls: {(c.collective, c.dim, c.overlappable, c.group) for c in calls}  # noqa: E731
    assert kinds(_calls(shape("ddp", 2))) == {("all_reduce", "dp", True, 2)}
    assert kinds(_calls(shape("fsdp", 2))) == {("all_gather", "dp", True, 2), ("reduce_scatter", "dp", True, 2)}
    assert kinds(_calls(shape("hsdp", 4))) == {("all_gather", "dp", True, 2), ("reduce_scatter", "dp", True, 2),
                                               ("all_reduce", "dp", True, 2)}
    assert kinds(_calls(shape("tp", 2))) == {("all_reduce", "tp", False, 2), ("all_gather", "tp", False, 2)}
    assert kinds(_calls(shape("tp-sp", 2))) == {("all_gather", "tp", False, 2), ("reduce_scatter", "tp", False, 2),
                                                ("all_reduce", "tp", False, 2)}
    for rank in (0, 1):  # activations go out asynchronously; a receive waits
        assert kinds(_calls(shape("pp", 2, microbatches=4), rank)) == {("send", "pp", True, 2), ("recv", "pp", False, 2)}
    assert kinds(_calls(shape("single", 1))) == set()


def test_tp_sp_swaps_each_all_reduce_for_a_gather_scatter_pair() -> None:
    act = 8 * 128 * 128 * 4  # rows x S x d, fp32
    # per layer 2 x (gather, scatter, gather, scatter); the head gathers its input and scatters its input
    # gradient; its logits stay sharded (loss parallel goes with sequence parallel: no logits gather); the
    # embedding output is gathered once. The LayerNorms' partial gradients (4 blocks x 2 norms + the final
    # one, weight and bias) are summed in one all-reduce.
    norm_grads = {"calls_per_step": 1, "bytes_per_step": (4 * 2 + 1) * 2 * 128 * 4}
    assert _summary(shape("tp-sp", 2)) == {
        "all_reduce": norm_grads,
        "all_gather": {"calls_per_step": 8 * 2 + 2, "bytes_per_step": (8 * 2 + 2) * act},
        "reduce_scatter": {"calls_per_step": 8 * 2 + 1, "bytes_per_step": (8 * 2 + 1) * act},
    }
    # bf16: the scattered/gathered matmul outputs halve, the fp32 residual stream does not.
    lo, hi = act // 2, act
    assert _summary(shape("tp-sp", 2, precision="bf16")) == {
        "all_reduce": norm_grads,  # fp32 parameters: fp32 gradients under autocast
        "all_gather": {"calls_per_step": 18, "bytes_per_step": 8 * hi + 8 * lo + 2 * hi},
        "reduce_scatter": {"calls_per_step": 17, "bytes_per_step": 8 * lo + 8 * hi + hi},
    }


def test_hsdp_adds_an_all_reduce_of_each_gradient_shard_over_replicas() -> None:
    s = _summary(shape("hsdp", 4))
    assert s["all_reduce"] == {"calls_per_step": 5, "bytes_per_step": 4 * PARAMS // 2}  # 4 blocks + root, shards of 2
    assert s["reduce_scatter"] == {"calls_per_step": 5, "bytes_per_step": 4 * PARAMS}
    assert s["all_gather"] == {"calls_per_step": 2 * 4 + 1, "bytes_per_step": 4 * (PARAMS + 4 * BLOCK)}
    assert "all_reduce" not in _summary(shape("fsdp", 2))


def test_hybrids_issue_every_component_s_collectives() -> None:
    act = 4 * 128 * 128 * 4  # fsdp+tp over 4 ranks: dp 2, 4 local rows
    s = _summary(shape("fsdp+tp", 4, dims=degrees_for("fsdp+tp", 4, sequence_parallel=False)))
    assert s["all_reduce"] == {"calls_per_step": 6 * 4 + 1, "bytes_per_step": (6 * 4 + 1) * act}  # tp
    assert s["all_gather"]["calls_per_step"] == 2 * 4 + 1 + 1  # fsdp groups + tp logits
    assert s["reduce_scatter"]["calls_per_step"] == 5
    # with sequence parallel (the default): per block and sub-layer an all-gather of the norm's output and a
    # reduce-scatter of the row-parallel output forward, the same two backward (4 blocks x 2 sub-layers: 16 and
    # 16 act); the head's input gathered (its logits stay sharded: loss parallel), its input gradient
    # reduce-scattered; the embedding's output gradient gathered; FSDP as above; the norms' weights and biases
    # (2 x 4 + 1 LayerNorms) all-reduced one by one (FSDP2 redistributes each partial gradient), 128 fp32 each.
    sp = _summary(shape("fsdp+tp", 4))
    assert sp["all_reduce"] == {"calls_per_step": 18, "bytes_per_step": 18 * 128 * 4}
    logits = 4 * 128 * TINY.vocab_size * 4
    fsdp = s["all_gather"]["bytes_per_step"] - logits  # the same FSDP gathers as without
    assert sp["all_gather"] == {"calls_per_step": 16 + 2 + 9, "bytes_per_step": fsdp + 18 * act}
    assert sp["reduce_scatter"] == {"calls_per_step": 16 + 1 + 5,
                                    "bytes_per_step": s["reduce_scatter"]["bytes_per_step"] + 17 * act}
    pf = _summary(shape("pp+fsdp", 4, microbatches=4))
    assert pf["send"] == {"calls_per_step": 4, "bytes_per_step": 4 * 1 * 128 * 128 * 4}  # 4 local rows / 4 microbatches
    assert pf["recv"]["calls_per_step"] == 4 and pf["reduce_scatter"]["calls_per_step"] == 3  # 2 blocks + root
    # 1F1B on stage 0 runs F F B F B F B B: each block gathers 5 times (after a forward it is resharded,
    # after a backward it stays gathered), the root group once.
    assert pf["all_gather"]["calls_per_step"] == 2 * 5 + 1
    grad_accum = _summary(shape("tp", 2, grad_accum=2))
    assert grad_accum["all_reduce"] == {"calls_per_step": 2 * 25, "bytes_per_step": 2 * 25 * 4 * 128 * 128 * 4}


def test_ddp_buckets_close_at_the_cap_exactly() -> None:
    def spec(n: int) -> ParamSpec:
        return ParamSpec(name=f"p{n}", shape=(n,), layer=None, tp="replicate")

    # reverse registration order: 1 MiB exactly closes the first bucket, then 25 MiB ones
    mib = 1024 * 1024 // 4
    specs = [spec(3), spec(25 * mib), spec(mib)]
    assert comm._ddp_buckets(specs, 1) == [4 * mib, 4 * 25 * mib, 12]


def test_ddp_over_one_replica_all_reduces_its_buckets_and_holds_them() -> None:
    """DDP wraps the model at dp_replicate 1 too (``--degrees dp_replicate=1`` on one GPU): its
    buckets are all-reduced over a 1-rank group (the H200 record small-ddp-bf16-w1 counted every
    gradient byte) and held beside the gradients."""
    from harness.parallel.dims import ParallelDims

    c = CellShape(size=TINY, dims=ParallelDims(dp_replicate=1, world_size=1), strategy="ddp", precision="fp32",
                  global_batch=8)
    (rank0,) = comm.comm_by_rank(c)
    assert rank0["all_reduce"]["bytes_per_step"] == 4 * PARAMS
    assert memory.transient_param_bytes(c) == 4 * PARAMS
    single = shape("single", 1)
    assert comm.comm_by_rank(single) == [{}] and memory.transient_param_bytes(single) == 0


# ---- memory.py survivors: exact values the surviving mutants change (docs/mutation.md)


def test_fsdp_two_uneven_shards_price_each_rank_alone() -> None:
    # seq 127: the position table's 127 rows chunk 64 / 63 over 2 ranks; every other dim 0 of tiny
    # (256, 128, 512) splits evenly. At seq 128 each rank holds PARAMS / 2 = 437,632 elements,
    # so rank 0 keeps that and rank 1 one row (d = 128 elements) fewer.
    c = shape("fsdp", 2, size=replace(TINY, seq_len=127))
    assert [s.params for s in memory.state_bytes_by_rank(c)] == [4 * 437_632, 4 * (437_632 - 128)]


def test_local_params_is_an_int_count() -> None:
    n = memory.local_params(shape("fsdp", 2))
    assert type(n) is int and n == PARAMS // 2


def test_inflight_microbatches_per_pipeline_rank() -> None:
    # 1F1B: stage r holds pp - r microbatches (the last one); interleaved: pp on every rank.
    assert memory.inflight_microbatches(shape("pp", 2, microbatches=4), 1) == 1
    inter = shape("pp", 2, microbatches=4, pp_schedule="interleaved1f1b")
    assert [memory.inflight_microbatches(inter, r) for r in (0, 1)] == [2, 2]


def test_activation_bytes_last_stage_and_tp_variants() -> None:
    # pp 2, 4 microbatches of 2 rows: the last stage holds 1 microbatch, 2 layers of 64 d bytes, no stage output
    assert memory.activation_bytes(shape("pp", 2, microbatches=4), 1) == 2 * 128 * 1 * (2 * 64 * 128)
    # tp 2 without SP, full: each block's fp32 input whole (d x 4 bytes), 8 rows x 128 tokens x 4 layers
    assert memory.activation_bytes(shape("tp", 2, recompute="full")) == 8 * 128 * 4 * 128 * 4
    # tp 2 attn, fp32: 4 d x 4 (LayerNorms) + 12 d x 4 / 2 - 3 d x 4 / 2 (q, k, v) = 16 d + 24 d - 6 d = 34 d
    assert memory.activation_bytes(shape("tp", 2, recompute="attn")) == 8 * 128 * 4 * 34 * 128


def test_grads_live_in_forward_from_two_micro_steps() -> None:
    assert memory.grads_live_in_forward(shape("single", 1, grad_accum=2)) is True
    assert memory.grads_live_in_forward(shape("single", 1)) is False


def test_peak_with_accumulated_gradients_exact() -> None:
    """grad_accum 2 (4 rows a micro-step): the gradients are live at every moment."""
    tokens = 4 * 128
    states = 16 * PARAMS + 4 * TENSORS  # fp32 params, grads, two moments; a step per tensor
    # none: the turn from forward to backward wins (logits 256 x 12 = 3,072 B/token > GELU grad 4 d x 4 = 2,048)
    c = shape("single", 1, grad_accum=2)
    assert memory.peak_bytes(c, 0) == states + tokens * (4 * 64 * 128 + 256 * 12)
    # full: the top block's backward wins: 4 block inputs (d x 4) + one block (64 d) + its GELU grad (4 d x 4), and
    # the new gradient of its largest tensor (fc, 4 d x d fp32: 262,144 B) before it is added into the accumulated one
    full = shape("single", 1, grad_accum=2, recompute="full")
    assert memory.peak_bytes(full, 0) == states + tokens * (4 * 128 * 4 + 64 * 128 + 4 * 128 * 4) + 4 * 512 * 128
