"""Head-tail context parallel: the layout gives every rank equal causal work, covers the sequence once,
and bad shapes are refused at plan time (:mod:`harness.parallel.cp`, :mod:`harness.parallel.presets`)."""

from __future__ import annotations

import pytest
import torch

from harness.errors import UsageError
from harness.fit.cell import plan_fit_cell
from harness.measure.step_stats import Stats
from harness.model.whatif import plan_at_scale
from harness.parallel.cp import causal_work, head_tail_chunks, natural_order, shard_indices, shard_sequence
from harness.parallel.presets import check_seq_split, degree_variants, resolve
from harness.run.formulas import throughput
from harness.spec import CellConfig


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_every_rank_gets_equal_causal_work(cp):
    chunk = 16
    work = [causal_work(r, cp, chunk) for r in range(cp)]
    assert len(set(work)) == 1, work
    total = sum(range(1, 2 * cp * chunk + 1))  # query p attends p + 1 keys
    assert sum(work) == total
    # the naive split (rank r holds chunks 2r, 2r+1) would not be balanced
    naive = [sum(range(2 * r * chunk + 1, 2 * (r + 1) * chunk + 1)) for r in range(cp)]
    assert len(set(naive)) == cp


@pytest.mark.parametrize("cp", [2, 4])
def test_the_shards_cover_the_sequence_once_and_reassemble(cp):
    seq = 8 * cp
    idx = [shard_indices(seq, r, cp) for r in range(cp)]
    assert sorted(torch.cat(idx).tolist()) == list(range(seq))
    assert [head_tail_chunks(r, cp) for r in range(cp)][0] == (0, 2 * cp - 1)
    x = torch.arange(seq).view(1, seq)
    gathered = torch.cat([shard_sequence(x, r, cp) for r in range(cp)], dim=1)  # rank-major, as all_gather
    chunks = gathered.view(2 * cp, seq // (2 * cp))
    assert natural_order(chunks, 0).flatten().tolist() == list(range(seq))


def test_a_sequence_that_does_not_split_is_refused_with_the_fix():
    dims = resolve("fsdp+cp", 4, {"dp_shard": 1, "cp": 4}).dims
    check_seq_split(dims, 64)
    with pytest.raises(UsageError, match=r"seq_len \(60\) must be divisible by 2 x cp \(4\) = 8.*multiple of 8"):
        check_seq_split(dims, 60)


@pytest.mark.parametrize("strategy,degrees,match", [
    ("ddp", {"dp_replicate": 2, "cp": 2}, r"cp \(2\) needs an FSDP strategy.*strategy ddp"),
    ("pp+fsdp", {"pp": 2, "cp": 2}, r"cp \(2\) with pp \(2\) is not supported"),
    ("fsdp", {"dp_shard": 2, "cp": 3}, r"x cp \(3\) = 6 must equal the world size \(4\)"),
])
def test_cp_where_it_cannot_run_is_refused_with_the_reason(strategy, degrees, match):
    with pytest.raises(UsageError, match=match):
        resolve(strategy, 4, degrees)


def test_tokens_per_s_count_each_token_once_under_cp():
    """4 sequences of 1,024 tokens per step, split over 4 CP ranks, at a known 0.5 s step: 8,192 tokens/s, not 4x."""
    cfg = CellConfig(size="mini", arch="llama3", strategy="fsdp+cp", precision="fp32", world_size=4, global_batch=4,
                     seq_len=1024, steps=3, warmup=1, device_kind="cpu", degrees={"dp_shard": 1, "cp": 4})
    assert cfg.layout.dims.cp == 4 and cfg.layout.dims.dp == 1
    assert cfg.tokens_per_step == 4 * 1024
    tput = throughput(Stats.of([0.5, 0.5, 0.5]), cfg.tokens_per_step, cfg.world_size, cfg.model_size.flops_per_token())
    assert tput["tokens_per_s"] == 8192 and tput["tokens_per_s_per_device"] == 2048


def test_plan_and_fit_expand_a_cp_preset_into_every_cp_degree():
    assert degree_variants("fsdp+cp", 8) == [{"dp_shard": 4, "cp": 2, "tp": 1}, {"dp_shard": 2, "cp": 4, "tp": 1},
                                         {"dp_shard": 1, "cp": 8, "tp": 1}]
    assert degree_variants("fsdp+tp+cp", 8) == [{"dp_shard": 2, "cp": 2, "tp": 2}, {"dp_shard": 1, "cp": 4, "tp": 2}]
    assert degree_variants("fsdp", 8) == [] and degree_variants("fsdp+tp+cp", 3) == []


def test_the_long_sequence_whatif_ranks_cp_where_fsdp_alone_does_not_fit():
    rows = plan_at_scale("llama3-8b", "h100", 8, strategies=["fsdp", "fsdp+cp"], seq_len=131072, recompute="full")
    by_cp = {r["degrees"].get("cp", 1): r for r in rows}
    assert set(by_cp) == {1, 2, 4, 8}
    assert not by_cp[1]["fits"] and not by_cp[2]["fits"] and by_cp[4]["fits"] and by_cp[8]["fits"]
    assert rows[0]["rank"] == 1 and rows[0]["degrees"]["cp"] in (4, 8)
    for cp, row in by_cp.items():  # one sequence per data-parallel rank: each CP group splits one
        assert row["global_batch"] == 8 // cp
    # a rank holds 32k tokens of its sequence at cp 4, 16k at cp 8
    assert by_cp[4]["peak_mem_gib_per_rank"] > by_cp[8]["peak_mem_gib_per_rank"]


def test_fit_cells_of_a_cp_preset_carry_their_cp_degree_in_the_id():
    cells = [plan_fit_cell("llama3-8b", "fsdp+cp", "bf16", 8, 1, "cpu", seq_len=131072, degrees=d)
             for d in degree_variants("fsdp+cp", 8)]
    assert [c.cell_id for c in cells] == [f"llama3-8b-fsdp+cp-bf16-w8-mb1-cp{cp}-s131072" for cp in (2, 4, 8)]


@pytest.mark.parametrize("strategy, world, tp", [("fsdp+cp", 2, 1), ("fsdp+tp+cp", 4, 2)])
@pytest.mark.parametrize("recompute, gathers", [("none", 1), ("full", 2), ("attn", 2), ("layer2", None)])
def test_cp_kv_bytes_by_hand_across_recompute_and_tp(strategy, world, tp, recompute, gathers):
    """Context parallel's K/V collectives per step, the branches crossed (recompute policy x tp), by hand: each of
    llama3 tiny's 4 layers all-gathers the whole sequence's k and v, 2 x rows x 128 tokens x kv_dim 64 / tp x 4 bytes
    (fp32), once per forward it runs (twice where the attention is recomputed: every layer under full and attn, every
    2nd under layer2), and reduce-scatters their gradients once; rows = the local batch, 4 / dp."""
    from dataclasses import replace

    from harness.model.comm import rank_calls
    from harness.model.inventory import coords
    from harness.model.shape import CellShape
    from harness.parallel.presets import resolve
    from workloads.sizes import get_size

    size = replace(get_size("tiny", "llama3"), seq_len=128)
    dims = resolve(strategy, world).dims
    assert (dims.cp, dims.tp) == (2, tp)
    c = CellShape(size=size, dims=dims, strategy=strategy, precision="fp32", global_batch=4, recompute=recompute)
    rows = 4 // dims.dp
    per_layer = 2 * rows * 128 * 64 // tp * 4
    layer_gathers = [gathers] * 4 if gathers else [1, 2, 1, 2]  # layer2: every 2nd block (2 of the 4) reruns
    cp = [k for k in rank_calls(c, coords(dims)[0]) if k.dim == "cp"]
    assert sorted((k.collective, k.nbytes, k.group) for k in cp) == sorted(
        [("all_gather", per_layer, 2)] * sum(layer_gathers) + [("reduce_scatter", per_layer, 2)] * 4)
