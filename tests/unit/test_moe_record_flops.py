"""An MoE record's throughput in FLOPs and its MFU, held to FLOPs counted outside the sizes table (issue 44, "ratios
where a value is needed"): torch's ``FlopCounterMode`` over one forward and backward of the model, and the
H200's datasheet peak. A ratio check (total over active FLOPs) passes when both are wrong by the same factor;
these are values."""

from __future__ import annotations

import pytest

from harness.run.measurement import CellRun, RankMeasurement
from harness.run.record_metrics import worker_metrics
from harness.spec import CellConfig
from tests.unit.test_workloads import counted_flops_per_token

H200_BF16_DENSE_TFLOPS = 989.5
"""NVIDIA H200 datasheet: 1,979 TFLOPS bf16 with sparsity, half of it dense."""


def test_an_moe_records_tflops_and_mfu_are_the_counted_flops_at_the_measured_rate():
    cfg = CellConfig(size="tiny", arch="moe", strategy="single", world_size=1, global_batch=8, seq_len=128, steps=3,
                     warmup=1, device_kind="cuda", precision="bf16")
    rank = RankMeasurement(rank=0, times=[9.0, 0.5, 0.5, 0.5], cpu_times=None, losses=None, g_small=None,
                           mem={"peak_mem_gib": 1.0, "peak_mem_kind": "allocated"},
                           state_bytes={"params": 1, "grads": 1, "optimizer": 1, "total": 3}, comm={}, comm_cp={},
                           moe_ep_rows=None, trace={}, profiled_times=[], probe={"w": [4.0, 1.0]}, dynamo=None,
                           fp8_linears=[])
    run = CellRun(g_big=[], skipped=0, final_scale=None, entropy_floor=0.0, threads=1, device_name="NVIDIA H200",
                  monitor=None, trace=None, worker_wall_s=1.0, phase_marks={}, nvtx=None, moe={})
    m, _ = worker_metrics(cfg, [rank], run)
    # 8 sequences of 128 tokens per 0.5 s step (the warmup's 9 s left out): 2,048 tokens/s
    assert m["tokens_per_s"] == 2048.0
    counted = counted_flops_per_token(cfg.model_size)  # fwd + bwd FLOPs per token, torch's count
    assert m["tflops_per_device"] == pytest.approx(2048.0 * counted / 1e12, rel=0.02)
    assert m["mfu_pct"] == pytest.approx(100 * 2048.0 * counted / 1e12 / H200_BF16_DENSE_TFLOPS, rel=0.02)
    # on total parameters: the 6 idle experts of each of the 4 layers add 6 x 4 x 6 x (3 x 128 x 128) FLOPs a token
    idle = 6 * 4 * 6 * 3 * 128 * 128
    assert m["moe"]["tflops_per_device_total_params"] == pytest.approx(2048.0 * (counted + idle) / 1e12, rel=0.02)
    assert m["moe"]["mfu_total_params_pct"] == pytest.approx(
        100 * 2048.0 * (counted + idle) / 1e12 / H200_BF16_DENSE_TFLOPS, rel=0.02)
