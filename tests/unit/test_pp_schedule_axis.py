"""The pipeline-schedule axis (``--pp-schedule 1f1b,zb``): crossed with the strategies that pipeline, each
schedule its own cell (id and table label), the others planned once; refusals name the value and the fix."""

from __future__ import annotations

import pytest

from harness.cli import build_parser
from harness.cli.args import spec_from_args
from harness.errors import UsageError
from harness.model.whatif import plan_at_scale
from harness.planner import expand
from harness.report.frame import strategy_label
from harness.spec import SweepSpec


def _spec(**kw) -> SweepSpec:
    base = dict(sizes=("tiny",), strategies=("pp", "ddp"), precisions=("fp32",), gpus=(2,), device_kind="cpu",
                batch=8, steps=3, warmup=1, reference=False, microbatches=4)
    return SweepSpec(**{**base, **kw})


def test_schedules_cross_the_pipelined_strategies_only():
    cells = expand(_spec(pp_schedules=("1f1b", "interleaved1f1b", "zb")))
    ids = [c.cell_id for c in cells]
    assert ids == ["tiny-ddp-fp32-w2-gb8-strong", "tiny-pp-fp32-w2-gb8-strong-1f1b-m4",
                   "tiny-pp-fp32-w2-gb8-strong-interleaved1f1b-m4", "tiny-pp-fp32-w2-gb8-strong-zb-m4"], ids
    assert all(c.valid for c in cells), [c.reason for c in cells]
    assert [c.config.pp_schedule for c in cells[1:]] == ["1f1b", "interleaved1f1b", "zb"]
    assert [strategy_label({"strategy": "pp", "degrees": c.raw["degrees"] or {"pp": 2}, "pp_schedule":
                            c.config.pp_schedule}) for c in cells[1:]] == ["pp", "pp (interleaved1f1b)", "pp (zb)"]


def test_zb_under_fsdp_and_zb_past_the_layers_are_invalid_cells_with_their_reasons():
    cells = {c.cell_id: c for c in expand(_spec(strategies=("pp", "pp+fsdp"), gpus=(4,), pp_schedules=("zb",),
                                                sizes=("mini",), batch=8, microbatches=4))}
    bad = cells["mini-pp+fsdp-fp32-w4-gb8-strong-zb-m4"]
    assert not bad.valid and "use --strategies pp, or --pp-schedule 1f1b or interleaved1f1b" in bad.reason
    deep = cells["mini-pp-fp32-w4-gb8-strong-zb-m4"]  # two stages per rank: 8 stages, mini has 6 layers
    assert not deep.valid and deep.reason.startswith("pipeline stages (8 = pp 4 x 2 per rank) exceed layers (6)")


def test_the_flag_takes_a_list():
    args = build_parser().parse_args(["bench", "--device", "cpu", "--gpus", "2", "--strategies", "pp", "--pp-schedule", "gpipe,zb"])
    assert spec_from_args(args).pp_schedules == ("gpipe", "zb")


def test_the_whatif_ranks_each_schedule_with_its_simulated_bubble():
    """llama3 8b on 8 H100 as pp 8 at 16 microbatches: 1F1B's bubble (p - 1) / m = 7/16 (Narayanan et al. 2021),
    interleaved's half of it, zero-bubble's less again."""
    rows = plan_at_scale("llama3-8b", "h100", 8, ["pp"], pp_schedules=("1f1b", "interleaved1f1b", "zb", "zbv"),
                         microbatches=16, global_batch=16)
    by = {r["strategy"]: r for r in rows}
    assert set(by) == {"pp", "pp (interleaved1f1b)", "pp (zb)", "pp (zbv)"}
    assert by["pp"]["bubble_fraction"] == pytest.approx(7 / 16)
    assert by["pp (interleaved1f1b)"]["bubble_fraction"] == pytest.approx(7 / 32)
    assert 0 < by["pp (zb)"]["bubble_fraction"] == by["pp (zbv)"]["bubble_fraction"] < 7 / 64
    assert by["pp (zb)"]["tokens_per_s_per_device"] > by["pp (interleaved1f1b)"]["tokens_per_s_per_device"]


def test_a_zero_bubble_row_with_recompute_says_how_its_recompute_is_priced():
    """torch's split backward re-runs a checkpointed block in each autograd pass that unpacks it: the what-if prices
    that count and the zero-bubble rows say so; 1F1B's rows and rows without recompute carry no such note; op is refused outright."""
    kw = dict(pp_schedules=("1f1b", "zb"), microbatches=16, global_batch=16)
    rows = {r["strategy"]: r for r in plan_at_scale("llama3-8b", "h100", 8, ["pp"], recompute="full", **kw)}
    said = "zb with recompute full: torch's split backward runs a checkpointed block's forward again"
    assert any(said in n and "priced so (harness/model/split_backward.py)" in n for n in rows["pp (zb)"]["notes"])
    assert not any("split backward" in n for n in rows["pp"]["notes"])
    plain = {r["strategy"]: r for r in plan_at_scale("llama3-8b", "h100", 8, ["pp"], **kw)}
    assert not any("split backward" in n for n in plain["pp (zb)"]["notes"])
    with pytest.raises(UsageError, match=r"--pp-schedule zb with --recompute op"):
        plan_at_scale("llama3-8b", "h100", 8, ["pp"], recompute="op", **kw)
