"""What a precision plan records and builds, by value at every mode (issue 61: ``metrics.precision`` held at each
setting it branches on: mode x data parallel x fp8 options)."""

from __future__ import annotations

import pytest
import torch

from harness.precision import Fp8Options, PrecisionPlan


@pytest.mark.parametrize(("mode", "autocast", "scaling"), [
    ("fp32", None, None), ("tf32", None, None), ("bf16", "bfloat16", None), ("fp16", "float16", "dynamic GradScaler")])
def test_the_record_describes_each_mode(mode, autocast, scaling):
    assert PrecisionPlan(mode).describe("ddp") == {"mode": mode, "autocast_dtype": autocast,
                                                   "master_weights": "float32", "loss_scaling": scaling,
                                                   "tf32_matmul": mode == "tf32"}


@pytest.mark.parametrize(("mode", "param"), [("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16")])
@pytest.mark.parametrize("dp", ["fsdp", "hsdp"])
def test_fsdp_records_its_mixed_precision(mode, param, dp):
    assert PrecisionPlan(mode).describe(dp)["fsdp_mixed_precision"] == {"param_dtype": param, "reduce_dtype": "float32"}
    assert "fsdp_mixed_precision" not in PrecisionPlan(mode).describe("ddp")


def test_fp8_records_its_options():
    plan = PrecisionPlan("fp8", Fp8Options(recipe="rowwise", all_gather=False, emulate=True))
    d = plan.describe("fsdp")
    assert d["fp8"] == {"recipe": "rowwise", "emulated": True, "float8_all_gather": False}
    assert d["mode"] == "fp8" and d["autocast_dtype"] == "bfloat16" and d["fsdp_mixed_precision"]["param_dtype"] == \
        "bfloat16"
    assert "fp8" not in PrecisionPlan("bf16").describe("fsdp")


@pytest.mark.parametrize(("mode", "param", "reduce"), [("fp32", None, None), ("bf16", torch.bfloat16, torch.float32),
                                                       ("fp16", torch.float16, torch.float32)])
def test_fsdps_policy_gathers_low_and_reduces_in_fp32(mode, param, reduce):
    policy = PrecisionPlan(mode).fsdp_policy()
    assert (policy.param_dtype, policy.reduce_dtype) == (param, reduce)


def test_only_fp16_scales_its_loss_and_autocast_takes_the_low_dtype():
    assert isinstance(PrecisionPlan("fp16").grad_scaler("cpu"), torch.amp.GradScaler)
    assert PrecisionPlan("bf16").grad_scaler("cpu") is None
    with PrecisionPlan("bf16").autocast("cpu"):
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")
    with PrecisionPlan("fp32").autocast("cpu"):
        assert not torch.is_autocast_enabled("cpu")
