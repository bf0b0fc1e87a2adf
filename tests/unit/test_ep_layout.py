"""Expert parallel as a degree: ``ep`` borrowed from the FSDP shards, refused at plan time where it cannot run,
expanded into every degree that divides, and placed by the model as the code places it
(:mod:`harness.parallel.ep`, :mod:`harness.parallel.presets`, :mod:`harness.model.comm`)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from harness.errors import UsageError
from harness.model.comm import comm_by_rank, ep_bytes
from harness.model.compute import expert_flop_share
from harness.model.inventory import coords, held_numel, param_specs
from harness.model.shape import CellShape
from harness.model.whatif import plan_at_scale
from harness.parallel.dims import ParallelDims
from harness.parallel.presets import degree_variants, resolve, resolve_cell
from harness.planner import expand
from harness.spec import SweepSpec
from workloads.sizes import get_size

MOE = get_size("tiny", "moe")


def _cell(strategy: str, world: int, degrees: dict | None = None, size=MOE, **kw):
    return resolve_cell(strategy, world, degrees, size, "fp32", pp_schedule="1f1b", microbatches=None,
                        grad_accum=kw.get("grad_accum", 1), global_batch=4 * world)


def test_ep_is_borrowed_from_the_shards():
    dims = resolve("fsdp+ep", 8, {"dp_shard": 8, "ep": 4}).dims
    assert (dims.ep, dims.efsdp, dims.dp, dims.world_size) == (4, 2, 8, 8)
    assert dims.degrees() == {"dp_replicate": 1, "dp_shard": 8, "tp": 1, "pp": 1, "ep": 4}
    assert "ep" not in resolve("fsdp", 8).dims.degrees()  # layouts without ep keep their records
    preset = resolve("fsdp+tp+ep", 8).dims
    assert (preset.dp_shard, preset.tp, preset.ep, preset.efsdp) == (4, 2, 4, 1)
    with pytest.raises(UsageError, match=r"ep \(3\) must divide dp_shard \(4\).*choose ep in \{1, 2, 4\}"):
        ParallelDims(dp_shard=4, ep=3, world_size=4)


@pytest.mark.parametrize("strategy,degrees,match", [
    ("ddp", {"dp_replicate": 2, "ep": 1}, None),
    ("hsdp", {"dp_replicate": 2, "dp_shard": 2, "ep": 2}, r"ep \(2\) needs an FSDP strategy.*use fsdp\+ep"),
    ("pp+fsdp+tp", {"pp": 2, "dp_shard": 2, "tp": 2, "ep": 2},
     r"ep \(2\) with pp \(2\) and tp \(2\) together is not supported: use pp\+fsdp\+ep \(tp=1\) or fsdp\+tp\+ep"),
    ("fsdp+cp", {"dp_shard": 2, "cp": 2, "ep": 2}, r"ep \(2\) with cp \(2\) is not supported.*set cp=1"),
])
def test_ep_where_it_cannot_run_is_refused_with_the_reason(strategy, degrees, match):
    if match is None:
        assert resolve(strategy, 2, degrees).dims.ep == 1
        return
    world = degrees.get("pp", 1) * degrees.get("tp", 1) * degrees.get("cp", 1) * degrees.get("dp_shard", 1) * \
        degrees.get("dp_replicate", 1)
    with pytest.raises(UsageError, match=match):
        resolve(strategy, world, degrees)


def test_pp_fsdp_ep_splits_each_stages_experts_over_its_shards():
    """DeepSeek-V3's layout as a preset: 2 stages, the rest sharded, every shard an expert-parallel rank; without
    --degrees, every ep that divides the shards and the experts."""
    dims = resolve("pp+fsdp+ep", 8).dims
    assert (dims.pp, dims.dp_shard, dims.ep, dims.efsdp, dims.tp) == (2, 4, 4, 1, 1)
    assert degree_variants("pp+fsdp+ep", 8, 8) == [{"dp_shard": 4, "ep": 2, "pp": 2}, {"dp_shard": 4, "ep": 4, "pp": 2}]


def test_a_degree_the_model_cannot_split_is_refused_at_plan_time():
    with pytest.raises(UsageError, match=r"ep \(16\) must divide the experts \(8\) of tiny.*\{1, 2, 4, 8\}"):
        _cell("fsdp+ep", 16)
    with pytest.raises(UsageError, match=r"ep \(2\) needs a mixture of experts: use --arch moe or an MoE --model"):
        _cell("fsdp+ep", 2, size=get_size("tiny", "llama3"))
    with pytest.raises(UsageError, match=r"tp \(2\) on a mixture of experts needs expert parallel.*fsdp\+tp\+ep"):
        _cell("fsdp+tp", 4)
    narrow = replace(MOE, moe=replace(MOE.moe, d_ff=127))
    with pytest.raises(UsageError, match=r"tp \(2\) must divide the MLP width \(127\)"):
        _cell("fsdp+tp+ep", 4, size=narrow)


def test_plan_fit_and_bench_expand_an_ep_preset_into_every_degree_that_divides():
    assert degree_variants("fsdp+ep", 8, 8) == [{"dp_shard": 8, "ep": e} for e in (2, 4, 8)]
    assert degree_variants("fsdp+ep", 8, 6) == [{"dp_shard": 8, "ep": 2}]
    assert degree_variants("fsdp+tp+ep", 8, 8) == [{"dp_shard": 4, "ep": e, "tp": 2} for e in (2, 4)]
    spec = SweepSpec(sizes=("tiny",), archs=("moe",), strategies=("fsdp+ep", "fsdp+tp+ep"), gpus=(4,),
                     precisions=("fp32",), device_kind="cpu", batch=8, steps=3, warmup=1)
    cells = [c for c in expand(spec) if c.raw["strategy"] != "single"]
    assert sorted(c.cell_id for c in cells) == [
        "moe-tiny-fsdp+ep-fp32-w4-gb8-strong-ep2", "moe-tiny-fsdp+ep-fp32-w4-gb8-strong-ep4",
        "moe-tiny-fsdp+tp+ep-fp32-w4-gb8-strong-ep2"]
    assert all(c.valid for c in cells)


@pytest.mark.parametrize("strategy,degrees", [("fsdp+ep", {"dp_shard": 8, "ep": 2}), ("fsdp+ep", {"dp_shard": 8, "ep": 8}),
                                              ("fsdp+tp+ep", {"dp_shard": 4, "tp": 2, "ep": 2})])
def test_every_expert_weight_is_held_once_over_the_ranks(strategy, degrees):
    """Experts split over ep (and their width over tp), FSDP-sharded over efsdp: the ranks hold each expert
    tensor exactly once; every other tensor is held as before (once per tp rank, FSDP over dp_shard)."""
    dims = resolve(strategy, 8, degrees).dims
    for spec in param_specs(MOE):
        held = sum(held_numel(spec, dims, True, k) for k in coords(dims))
        if spec.expert:
            assert held == math.prod(spec.shape), spec.name
        else:
            assert held in (math.prod(spec.shape), dims.tp * math.prod(spec.shape)), spec.name


def test_the_model_counts_the_all_to_alls_of_a_balanced_routing():
    layout, mb = _cell("fsdp+ep", 4, {"dp_shard": 4, "ep": 2}, grad_accum=2)
    shape = CellShape(size=MOE, dims=layout.dims, strategy="fsdp+ep", precision="fp32", global_batch=16, grad_accum=2)
    rank0 = comm_by_rank(shape)[0]
    # per layer and micro-step: the count exchange, dispatch and combine forward, both again backward
    assert rank0["all_to_all"]["calls_per_step"] == 5 * MOE.n_layers * 2
    rows = shape.local_batch * MOE.seq_len * MOE.moe.top_k * MOE.n_layers
    assert rank0["all_to_all"]["bytes_per_step"] == ep_bytes(shape, rows, rows)
    assert ep_bytes(shape, rows, rows) == 2 * 8 * MOE.moe.n_experts * MOE.n_layers + 4 * rows * MOE.d_model * 4
    # the experts' FSDP group runs over efsdp (2 here), beside the blocks' over all of dp_shard
    assert rank0["reduce_scatter"]["calls_per_step"] == 2 * MOE.n_layers + 1


def test_mixtral_whatif_ranks_ep8_above_ep4_tp2_for_the_reason_megatron_gives():
    """The README's what-if: EP8 x TP1 ahead of EP4 x TP2 on 8 H100 (Megatron Core's MoE guide found the same),
    because tensor parallel adds all-reduces of attention and of the experts' outputs that nothing hides."""
    rows = plan_at_scale("moe-mixtral-8x7b", "h100", 8, strategies=["fsdp+ep", "fsdp+tp+ep"], recompute="full")
    by = {(r["degrees"]["ep"], r["degrees"]["tp"]): r for r in rows}
    ep8, ep4tp2 = by[8, 1], by[4, 2]
    assert ep8["tokens_per_s_per_device"] > ep4tp2["tokens_per_s_per_device"]
    assert ep4tp2["exposed_comm_s"] > 2 * ep8["exposed_comm_s"]
    # the same FLOPs per device: one --efficiency prices them alike (op by op, each layout's kernels differ)
    one = plan_at_scale("moe-mixtral-8x7b", "h100", 8, strategies=["fsdp+ep", "fsdp+tp+ep"], recompute="full",
                        efficiency=0.4)
    by = {(r["degrees"]["ep"], r["degrees"]["tp"]): r for r in one}
    assert by[8, 1]["compute_s"] == pytest.approx(by[4, 2]["compute_s"], rel=1e-9)


def test_a_measured_imbalance_slows_expert_parallel_by_the_experts_share():
    base = plan_at_scale("moe-mixtral-8x7b", "h100", 8, strategies=["fsdp", "fsdp+ep"], recompute="full")
    skewed = plan_at_scale("moe-mixtral-8x7b", "h100", 8, strategies=["fsdp", "fsdp+ep"], recompute="full",
                           moe_imbalance=1.5)
    before = {(r["strategy"], r["degrees"].get("ep", 1)): r for r in base}
    after = {(r["strategy"], r["degrees"].get("ep", 1)): r for r in skewed}
    assert after["fsdp", 1]["compute_s"] == before["fsdp", 1]["compute_s"]  # each rank computes its own tokens
    shape = CellShape(size=get_size("mixtral-8x7b", "moe"), dims=resolve("fsdp+ep", 8).dims, strategy="fsdp+ep",
                      precision="bf16", global_batch=8)
    share = expert_flop_share(shape)
    assert 0.7 < share < 0.9  # Mixtral's FLOPs are mostly its experts'
    assert after["fsdp+ep", 8]["compute_s"] == pytest.approx(before["fsdp+ep", 8]["compute_s"] * (1 + 0.5 * share))
    with pytest.raises(UsageError, match=r"--moe-imbalance 0.5: .*>= 1"):
        plan_at_scale("moe-mixtral-8x7b", "h100", 8, strategies=["fsdp+ep"], moe_imbalance=0.5)


def test_plan_ranks_expert_parallel_only_where_there_are_experts():
    """Without --strategies a dense size gets no expert-parallel rows (they could only be refused); an MoE
    size gets every ep; named for a dense size, an EP preset is refused with the reason."""
    dense = {r["strategy"] for r in plan_at_scale("llama3-8b", "h100", 8)}
    assert "fsdp" in dense and not dense & {"fsdp+ep", "fsdp+tp+ep"}
    moe = [r for r in plan_at_scale("moe-mixtral-8x7b", "h100", 8, recompute="full") if r["strategy"] == "fsdp+ep"]
    assert len(moe) == 3 and all(r["valid"] for r in moe)  # ep 2, 4, 8
    (named,) = plan_at_scale("llama3-8b", "h100", 8, strategies=["fsdp+tp+ep"])[:1]
    assert not named["valid"] and "mixture of experts" in named["reason"]
