"""Pure pieces: statistics, scaling rules, presets and their errors, config, metrics."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from harness.errors import UsageError
from harness.measure.peaks import datasheet_peak_tflops
from harness.measure.step_stats import Stats, percentile
from harness.parallel.dims import ParallelDims
from harness.parallel.presets import check_model_fit, degrees_for, resolve_cell
from harness.parallel.schedules import (
    check_schedule_ac,
    check_schedule_compile,
    expected_bubble,
    layer_ranges,
    stage_ids,
)
from harness.precision import PrecisionPlan, check_strategy
from harness.run.formulas import global_loss, max_rel_diff, slowest_per_step, steps_to_target, throughput
from harness.scaling import global_batch, lr_at, scaled_lr
from harness.spec import CellConfig
from workloads.sizes import get_size


def test_stats_exact():
    s = Stats.of([1.0, 2.0, 3.0, 4.0, 10.0])
    assert s.median == 3.0 and s.mean == 4.0 and s.n == 5
    assert s.std == pytest.approx(math.sqrt(12.5))
    assert s.cv == pytest.approx(math.sqrt(12.5) / 4)
    assert s.p10 == pytest.approx(1.4) and s.p90 == pytest.approx(7.6)  # numpy 'linear'
    assert percentile([5.0], 50) == 5.0
    assert s.unstable_reason() == "unstable: CV 88% > 10%, rerun with more steps"
    assert Stats.of([1.0, 1.01, 0.99]).unstable_reason() is None
    with pytest.raises(ValueError):
        Stats.of([])


def test_lr_rules_exact():
    assert scaled_lr("none", 1e-3, 8, 32) == 1e-3
    assert scaled_lr("linear", 1e-3, 8, 32) == pytest.approx(4e-3)
    assert scaled_lr("sqrt", 1e-3, 8, 32) == pytest.approx(2e-3)
    assert scaled_lr("sqrt", 3e-4, 16, 4) == pytest.approx(1.5e-4)
    with pytest.raises(UsageError, match="unknown LR rule 'cubic'"):
        scaled_lr("cubic", 1e-3, 8, 8)


def test_warmup_schedule_exact():
    assert [lr_at(s, 1.0, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_at(0, 2.0, 0) == 2.0


def test_global_batch_strong_vs_weak():
    assert global_batch("strong", 8, 4) == 8
    assert global_batch("weak", 8, 4) == 32


def test_degrees_multiply_to_world():
    with pytest.raises(UsageError, match=r"= 2 must equal the world size \(4\)"):
        ParallelDims(dp_shard=2, world_size=4)
    d = degrees_for("fsdp+tp", 4)
    assert (d.dp_shard, d.tp, d.dp) == (2, 2, 2)
    assert degrees_for("hsdp", 4).degrees() == {"dp_replicate": 2, "dp_shard": 2, "tp": 1, "pp": 1}
    with pytest.raises(UsageError, match="needs a device count >= 8"):
        degrees_for("pp+fsdp+tp", 4)


def test_model_fit_errors_name_values_and_fix():
    with pytest.raises(UsageError, match=r"tp \(3\) must divide n_heads \(4\); choose tp in \{1, 2, 4\}"):
        check_model_fit(ParallelDims(tp=3, world_size=3), 4, 512, 4, "1f1b", 8)
    with pytest.raises(UsageError, match=r"pipeline stages \(8 = pp 4 x 2 per rank\) exceed layers \(4\)"):
        check_model_fit(ParallelDims(pp=4, world_size=4), 4, 512, 4, "interleaved1f1b", 8)
    with pytest.raises(UsageError, match=r"needs >= 4 microbatches, got 2"):
        check_model_fit(ParallelDims(pp=4, world_size=4), 4, 512, 4, "1f1b", 2)


def test_zero_bubble_refusals_name_the_value_and_the_fix():
    """zb holds two looped stages per rank as interleaved 1F1B does: the same stage and microbatch rules; compile
    (torch refuses compiled stages for a split backward) and FSDP (measured off after one step) refused."""
    with pytest.raises(UsageError, match=r"pipeline stages \(8 = pp 4 x 2 per rank\) exceed layers \(4\)"):
        check_model_fit(ParallelDims(pp=4, world_size=4), 4, 512, 4, "zb", 8)
    with pytest.raises(UsageError, match=r"schedule zb needs microbatches \(6\) divisible by pp \(4\)"):
        check_model_fit(ParallelDims(pp=4, world_size=4), 4, 512, 8, "zb", 6)
    with pytest.raises(UsageError, match=r"--pp-schedule zb with --compile on: .*use --compile off"):
        check_schedule_compile(("zb",), (False, True))
    check_schedule_compile(("interleaved1f1b",), (True,))
    # the split backward runs a selectively checkpointed region's backward twice: torch refuses the second
    with pytest.raises(UsageError, match=r"--pp-schedule zbv,dualpipev with --recompute op: .*use --recompute full"):
        check_schedule_ac(("1f1b", "zbv", "dualpipev"), ("none", "op"), flag="--recompute")
    check_schedule_ac(("zb", "zbv"), ("full", "layer2", "attn", "none"))
    check_schedule_ac(("1f1b", "interleaved1f1b"), ("op",))
    with pytest.raises(UsageError, match=r"--pp-schedule zbv,dualpipev with --compile on"):
        check_schedule_compile(("1f1b", "zbv", "dualpipev"), (True,))
    with pytest.raises(UsageError, match=r"schedule dualpipev with pp 2 needs >= 4 microbatches, got 2"):
        check_model_fit(ParallelDims(pp=2, world_size=2), 4, 512, 4, "dualpipev", 2)
    with pytest.raises(UsageError, match=r"pipeline stages \(4 = pp 2 x 2 per rank\) exceed layers \(3\)"):
        check_model_fit(ParallelDims(pp=2, world_size=2), 4, 512, 3, "zbv", 4)
    check_model_fit(ParallelDims(pp=2, world_size=2), 4, 512, 4, "zbv", 6)  # no rounds of pp: 6 is fine
    size = replace(get_size("mini"), seq_len=64)
    with pytest.raises(UsageError, match=r"pp\+fsdp with --pp-schedule zb: .*use --strategies pp"):
        resolve_cell("pp+fsdp", 4, None, size, "fp32", pp_schedule="zb", microbatches=4, grad_accum=1, global_batch=8)
    layout, mb = resolve_cell("pp", 2, None, size, "fp32", pp_schedule="zb", microbatches=None, grad_accum=1,
                              global_batch=8)
    assert (layout.virtual_stages("zb"), mb) == (2, 4)


def test_pipeline_split():
    assert [list(r) for r in layer_ranges(5, 2)] == [[0, 1, 2], [3, 4]]
    assert stage_ids(1, 2, "interleaved1f1b") == stage_ids(1, 2, "zb") == [1, 3]
    # the V: rank r holds stages r and 2 pp - 1 - r (rank 0 the first and the last)
    assert [stage_ids(r, 4, "zbv") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert stage_ids(0, 2, "dualpipev") == [0, 3]
    assert expected_bubble(4, 2, 8) == pytest.approx(3 / 16)


def test_precision_rules():
    with pytest.raises(UsageError, match="tf32 needs a CUDA GPU"):
        PrecisionPlan("tf32").check_device("cpu")
    with pytest.raises(UsageError, match="fp16 with strategy fsdp"):
        check_strategy("fp16", "fsdp")
    d = PrecisionPlan("bf16").describe("fsdp")
    assert d["fsdp_mixed_precision"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    assert PrecisionPlan("fp16").loss_scaling and not PrecisionPlan("bf16").loss_scaling


def test_config_roundtrip_and_errors():
    c = CellConfig(size="tiny", strategy="pp", precision="fp32", world_size=2, global_batch=8, seq_len=64, steps=3,
                   warmup=1, device_kind="cpu", microbatches=4)
    assert CellConfig.from_dict(c.to_dict()) == c
    assert c.cell_id == "tiny-pp-fp32-w2-gb8-strong-1f1b-m4-s64"  # 64 is not tiny's own 128
    with pytest.raises(UsageError, match="steps must be an integer >= 1, got 0"):
        CellConfig(**{**c.to_dict(), "steps": 0, "profile_ranks": (0,)})
    with pytest.raises(UsageError, match="unknown cell config keys"):
        CellConfig.from_dict({**c.to_dict(), "bogus": 1})


def test_metrics_formulas():
    assert slowest_per_step([[1.0, 2.0], [1.5, 1.0]]) == [1.5, 2.0]
    assert global_loss([[2.0, 1.0], None, [4.0, 3.0]]) == [3.0, 2.0]
    assert steps_to_target([3.0, 2.0, 1.0], [0.5, 0.5, 0.5], 2.0) == (2, 1.0)
    assert steps_to_target([3.0, 2.5], [1.0, 1.0], 2.0) == (None, None)
    assert max_rel_diff([1.0, 2.2], [1.0, 2.0]) == pytest.approx(0.1)
    t = throughput(Stats.of([0.5, 0.5]), tokens_per_step=1000, world=2, flops_per_token=6_000_000)
    assert t == {"tokens_per_s": 2000.0, "tokens_per_s_per_device": 1000.0, "tflops_per_device": pytest.approx(0.006)}


def test_mfu_peak_is_never_borrowed():
    assert datasheet_peak_tflops("NVIDIA H200", "bf16", "cuda") == (989.5, None)
    peak, reason = datasheet_peak_tflops("NVIDIA L4", "bf16", "cuda")
    assert peak is None and "not in the datasheet table" in reason
    peak, reason = datasheet_peak_tflops("AMD EPYC", "fp32", "cpu")
    assert peak is None and reason.startswith("n/a: no datasheet peak for CPU")
