"""``harness calibrate --ops`` on this CPU (the path a GPU runs, at a small grid), a device priced with what it
measured, a device file's ``[op_rates]``, and the published-runs error line ``plan`` prints."""

from __future__ import annotations

from dataclasses import replace

import pytest

from harness.calibration import ops, store
from harness.errors import UsageError
from harness.model.device_file import device_from_file
from harness.model.hardware import get_device
from harness.report.published import published_error_line


@pytest.fixture(scope="module")
def entry(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cal") / "calibration.json"
    e = ops.calibrate("cpu", cache=cache, min_time_s=0.01)
    return e, cache


def test_calibrate_ops_measures_every_rate_and_stores_it(entry):
    e, cache = entry
    assert {(g["dtype"], g["m"], g["n"], g["k"]) for g in e["gemms"]} == {("fp32", *s) for s in ops.CPU_GEMMS}
    assert all(g["tflops"] > 0 for g in e["gemms"])
    assert {(a["head_dim"], a["seq"]) for a in e["attention"]} == {(64, 128), (64, 256)}
    assert all(a["fwd_tflops"] > 0 and a["fwd_bwd_tflops"] > 0 for a in e["attention"])
    assert e["bandwidth_gbps"] > 0 and e["launch_s"] > 0 and e["kernel_floor_s"] == 0.0  # no CUDA graph on a CPU
    assert store.get("ops", ops.fingerprint("cpu"), cache) == e
    assert ops.stored_for(e["fingerprint"]["device_name"], cache) == e


def test_a_device_priced_with_its_measured_ops_names_them_as_the_source(entry):
    e, cache = entry
    h200 = get_device("h200")
    measured = {**e, "fingerprint": {**e["fingerprint"], "device_name": h200.product}}
    dev = replace(h200, measured_ops=measured)
    rates = dev.op_rates
    assert dict(rates.gemm_tflops)["fp32"] == max(g["tflops"] for g in e["gemms"])
    assert dict(rates.gemm_tflops)["bf16"] == dict(h200.op_rates.gemm_tflops)["bf16"]  # not measured: the data file's
    assert rates.launch_s == e["launch_s"]
    assert rates.bandwidth_efficiency == pytest.approx(e["bandwidth_gbps"] / h200.hbm_gbps)
    # the attention table against the device's bf16 peak: the measured forward at seq 256 over 989.5
    a256 = next(a for a in e["attention"] if a["seq"] == 256)
    assert rates.attention.fraction(False, 64, 256) == pytest.approx(a256["fwd_tflops"] / 989.5)
    assert all("harness calibrate --ops" in src for _, src in rates.sources)


def test_a_device_file_gives_op_rates_over_its_base_and_refuses_an_unknown_one(tmp_path):
    f = tmp_path / "d.toml"
    f.write_text('base = "h100"\nname = "h100-slow"\n[op_rates]\nlaunch_us = 25\ngemm_tflops = { bf16 = 500.0 }\n')
    rates = device_from_file(f).op_rates
    # 25 us host time per op and 500 TFLOP/s bf16 from the file; the rest the h100 preset's
    assert rates.launch_s == pytest.approx(25e-6) and dict(rates.gemm_tflops)["bf16"] == 500.0
    assert rates.sms == 132 and dict(rates.gemm_tflops)["fp8"] == dict(get_device("h100").op_rates.gemm_tflops)["fp8"]
    f.write_text('base = "h100"\n[op_rates]\nlanch_us = 25\n')
    with pytest.raises(UsageError, match="unknown op_rates key 'lanch_us'"):
        device_from_file(f)


def test_the_published_error_line_reads_the_committed_table(tmp_path):
    t = tmp_path / "table.md"
    t.write_text("| row | x | error % |\n|---|---|---|\n| a | 1 | +10.0 |\n| b | 2 | -20.0 |\n| c | 3 | - |\n")
    # two priced rows: mean |error| (10 + 20) / 2 = 15.0, signed (10 - 20) / 2 = -5.0
    assert "against 2 published runs" in published_error_line(t)
    assert "mean |error| 15.0%, signed -5.0%" in published_error_line(t)
    assert published_error_line(tmp_path / "absent.md") is None
