"""The device as data: a preset with overrides, a device file, a power cap's rule, and compile: priced as fusion op
by op, or under one ``--efficiency`` only from a measurement on the device."""

from __future__ import annotations

import json

import pytest

from harness.cli import main
from harness.errors import UsageError
from harness.model.device_file import device_arg, device_from_file
from harness.model.hardware import get_device, with_overrides
from harness.model.whatif import CompileGain, plan_at_scale, scenario
from harness.report.lever_gains import compile_speedup


def test_a_power_cap_scales_compute_by_the_cube_root_of_the_power_ratio():
    """500 W of the H100 SXM's 700 W: (5/7) ** (1/3) = 0.89390 (by hand: 0.714286 ** 0.333333); MFU still divides
    by the datasheet's 989.5."""
    capped = with_overrides(get_device("h100"), power_cap_w=500)
    assert capped.compute_scale == pytest.approx(0.893904, abs=1e-6)
    assert capped.peak_tflops["bf16"] == 989.5
    assert any("power cap 500 W of 700 W" in o for o in capped.overrides)
    eager = plan_at_scale("llama3-8b", "h100", 8, ["fsdp"], global_batch=16, recompute="op")[0]
    slower = plan_at_scale("llama3-8b", capped, 8, ["fsdp"], global_batch=16, recompute="op")[0]
    # GEMMs and attention run at the capped clock; the memory-bound kernels at the unscaled bandwidth
    for part in ("gemm", "attention"):
        assert slower["explain"][part] == pytest.approx(eager["explain"][part] / 0.893904, rel=1e-5)
    assert slower["explain"]["memory-bound"] == pytest.approx(eager["explain"]["memory-bound"], rel=1e-9)
    one = dict(global_batch=16, recompute="op", efficiency=0.4)  # one fraction: all the compute scales
    eager, slower = (plan_at_scale("llama3-8b", d, 8, ["fsdp"], **one)[0] for d in ("h100", capped))
    assert slower["compute_s"] == pytest.approx(eager["compute_s"] / 0.893904, rel=1e-5)


def test_memory_override_decides_fits():
    """Llama-3-8B fsdp at local batch 3, op: between 80 and 96 GiB, so the override turns the verdict."""
    kw = dict(global_batch=24, recompute="op")
    (row80,) = plan_at_scale("llama3-8b", "h100", 8, ["fsdp"], **kw)
    (row96,) = plan_at_scale("llama3-8b", with_overrides(get_device("h100"), hbm_gib=96), 8, ["fsdp"], **kw)
    assert 79.6 < row80["peak_mem_gib_per_rank"] <= 96
    assert row80["fits"] is False and row96["fits"] is True


@pytest.mark.parametrize("cap, message", [
    (800, r"--power-cap 800 W: must be in \(0, 700\] W, h100's board power"),
    (0, r"--power-cap 0 W: must be in \(0, 700\]"),
])
def test_bad_power_caps_are_refused_with_the_range(cap, message):
    with pytest.raises(UsageError, match=message):
        with_overrides(get_device("h100"), power_cap_w=cap)


def test_a_device_file_names_the_part(tmp_path):
    f = tmp_path / "h100-96.toml"
    f.write_text('base = "h100"\nname = "h100-96gb"\nproduct = "NVIDIA H100 96GB HBM2e"\nhbm_gib = 95.6\n'
                 'hbm_gbps = 2400\npower_cap_w = 500\n[peak_tflops]\nbf16 = 989.5\n')
    dev = device_from_file(f)
    assert (dev.name, dev.hbm_gib, dev.hbm_gbps, dev.tdp_w, dev.power_cap_w) == ("h100-96gb", 95.6, 2400, 700, 500)
    assert dev.peak_tflops == {"bf16": 989.5} and dev.intra == get_device("h100").intra
    assert device_arg(str(f), mem_gib=80).hbm_gib == 80  # the flag over the file
    s = scenario("llama3-8b", dev, 8)
    assert s.peak_tflops == 989.5


def test_a_device_file_sets_the_node_and_its_links(tmp_path):
    """Issue 61: the keys no test set (gpus_per_node, intra_gbps, inter_gbps), each held by value: the links take the
    file's bandwidth and name it as their source; their latency stays the base's (a typical figure, not the file's)."""
    f = tmp_path / "h100-pcie-node.toml"
    f.write_text('base = "h100"\ngpus_per_node = 4\nintra_gbps = 64\ninter_gbps = 12.5\n')
    dev, base = device_from_file(f), get_device("h100")
    assert dev.gpus_per_node == 4 and base.gpus_per_node != 4
    assert (dev.intra.gbps, dev.intra.latency_s, dev.intra.source) == (64.0, base.intra.latency_s, str(f))
    assert (dev.inter.gbps, dev.inter.latency_s, dev.inter.source) == (12.5, base.inter.latency_s, str(f))
    assert dev.intra.name == "in-node link 64 GB/s" and dev.inter.name == "NIC 12.5 GB/s"
    assert dev.hbm_gbps == base.hbm_gbps and dev.peak_tflops == base.peak_tflops  # what the file left is the base's


@pytest.mark.parametrize("body, message", [
    ('base = "h100"\nhbm_gb = 96\n', "unknown key 'hbm_gb'; did you mean 'hbm_gib'?"),
    ('base = "h100"\nhbm_gib = -1\n', "hbm_gib = -1 must be a finite number > 0"),
    ('name = "x"\n', "without base = \"<preset>\" it needs product, hbm_gib"),
    ('base = "h100"\nproduct = "Mystery GPU"\n', "product 'Mystery GPU' is not in the datasheet table; give [peak_tflops]"),
])
def test_a_bad_device_file_is_one_line_naming_the_key(tmp_path, body, message):
    f = tmp_path / "d.toml"
    f.write_text(body)
    with pytest.raises(UsageError) as e:
        device_from_file(f)
    assert message in str(e.value) and str(f) in str(e.value)


def test_plan_header_says_what_was_overridden(capsys):
    rc = main(["plan", "--arch", "llama3", "--sizes", "8b", "--gpus", "8", "--device", "h100", "--device-mem", "96",
               "--power-cap", "500", "--strategies", "fsdp"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "overridden: memory 96 GiB (preset 79.6); power cap 500 W of 700 W: compute peaks x 0.894" in out
    assert "GEMMs at 700.9 TFLOP/s bf16 achievable x power cap 0.894 x each shape's wave efficiency" in out


def _record(cell: str, compile_on: bool, median: float, device: str) -> dict:
    config = dict(size="tiny", strategy="fsdp", precision="bf16", world_size=8, compile=compile_on, ac="none",
                  optimizer="adamw")
    return {"schema_version": 1, "samples": {}, "kind": "cell", "status": "ok", "cell_id": cell, "run_id": "r", "config": config,
            "env": {"device_name": device}, "metrics": {"step_time_s": {"median": median}}, "predicted": {}}


def test_compile_is_priced_from_the_measured_gain_on_the_device_and_said_unpriced_otherwise(tmp_path):
    """Under one ``--efficiency``: an eager cell at 1.2 s beside its compiled twin at 1.0 s on the device's product:
    a gain of 1.2, the compute priced 1.2x faster; the same pair on another product leaves compile unpriced."""
    h100 = get_device("h100").product
    records = [_record("a", False, 1.2, h100), _record("a-compile", True, 1.0, h100)]
    assert compile_speedup(records, h100) == (pytest.approx(1.2), 1)
    assert compile_speedup(records, "NVIDIA H200") == (None, 0)
    kw = dict(global_batch=16, recompute="op", efficiency=0.4)
    eager = plan_at_scale("llama3-8b", "h100", 8, ["fsdp"], **kw)[0]
    fast = plan_at_scale("llama3-8b", "h100", 8, ["fsdp"], compile=CompileGain(1.2, "test"), **kw)[0]
    assert fast["compute_s"] == pytest.approx(eager["compute_s"] / 1.2, rel=1e-9)
    unpriced = plan_at_scale("llama3-8b", "h100", 8, ["fsdp"], compile=CompileGain(None, "no measurement"), **kw)[0]
    assert unpriced["compute_s"] == eager["compute_s"]
    assert "compile: not priced (no measurement)" in unpriced["notes"]
    run = tmp_path / "gpu" / "run"
    run.mkdir(parents=True)
    (run / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rc = main(["plan", "--arch", "llama3", "--sizes", "8b", "--gpus", "8", "--device", "h100", "--strategies",
               "fsdp", "--compile", "on", "--compile-from", str(tmp_path / "gpu"), "--efficiency", "0.4"])
    assert rc == 0


def test_plan_without_compile_measurements_says_so(capsys):
    rc = main(["plan", "--arch", "llama3", "--sizes", "8b", "--gpus", "8", "--device", "h100", "--strategies",
               "fsdp", "--compile", "on", "--efficiency", "0.4"])
    out = capsys.readouterr().out
    assert rc == 0 and "compile: not priced (no measurement on this device" in out
    assert out.count("compile: not priced") >= 2  # the header and the row's note


def test_compile_priced_op_by_op_is_fusion_and_never_unpriced(capsys):
    """Without --efficiency, compile fuses the memory-bound kernels: the same GEMMs and attention, fewer bytes and
    kernels, so a faster step; no row says compile is unpriced."""
    kw = dict(global_batch=16, recompute="op")
    eager = plan_at_scale("llama3-8b", "h100", 8, ["fsdp"], **kw)[0]
    fused = plan_at_scale("llama3-8b", "h100", 8, ["fsdp"], compile=CompileGain(None, "no measurement"), **kw)[0]
    assert fused["explain"]["gemm"] == pytest.approx(eager["explain"]["gemm"])
    assert fused["explain"]["memory-bound"] < 0.6 * eager["explain"]["memory-bound"]
    assert fused["compute_s"] < eager["compute_s"] and not any("compile" in n for n in fused["notes"])
    assert main(["plan", "--arch", "llama3", "--sizes", "8b", "--gpus", "8", "--device", "h100", "--strategies",
                 "fsdp", "--compile", "on"]) == 0
    out = capsys.readouterr().out
    assert "compile: priced as fusion" in out and "not priced" not in out


def test_the_inductor_of_2024_slows_a_compiled_row_and_leaves_an_eager_one(capsys):
    """``--inductor-reductions 0.5`` prices compile's norm, softmax and loss kernels at half the bandwidth: a compiled
    row's step grows, an eager row's does not; a share outside (0, 1] is refused before anything is priced."""
    kw = dict(global_batch=16, recompute="op", compile=CompileGain(None, "op by op"))
    now, then = (plan_at_scale("llama3-8b", "h100", 8, ["fsdp"], inductor_reductions=r, **kw)[0] for r in (1.0, 0.5))
    assert then["compute_s"] > now["compute_s"]
    eager = [plan_at_scale("llama3-8b", "h100", 8, ["fsdp"], global_batch=16, recompute="op",
                           inductor_reductions=r)[0]["compute_s"] for r in (1.0, 0.5)]
    assert eager[0] == eager[1]
    args = ["plan", "--arch", "llama3", "--sizes", "8b", "--gpus", "8", "--device", "h100", "--strategies", "fsdp",
            "--compile", "on"]
    assert main([*args, "--inductor-reductions", "0.5"]) == 0
    assert "those with a norm, softmax or loss at 0.5 of the bandwidth (--inductor-reductions), the ends eager" in \
        capsys.readouterr().out
    assert main([*args, "--inductor-reductions", "0"]) == 2
    assert ("--inductor-reductions '0': must be a fraction of the achievable bandwidth in (0, 1], e.g. 0.5"
            in capsys.readouterr().err)
    assert main(["plan", "--arch", "llama3", "--sizes", "tiny", "--inductor-reductions", "0.5"]) == 2
    assert "--inductor-reductions applies to a what-if only" in capsys.readouterr().err


def test_the_attention_kernel_can_be_named_and_its_rates_are_the_table_s(capsys):
    """``--attention-kernel cudnn_hopper`` prices attention at the FlashAttention-3 paper's cuDNN bars (forward, causal,
    head width 128: 529 TFLOP/s at 8k against FlashAttention-2's 333), the backward at the forward's rate; the header
    names it; a kernel the data file does not measure is refused."""
    from harness.model.device_file import device_arg  # noqa: PLC0415

    fa2, cudnn = device_arg("h100").op_rates.attention, device_arg("h100", attention="cudnn_hopper").op_rates.attention
    assert cudnn.fraction(False, 128, 8192) == pytest.approx(529 / 989)
    assert cudnn.fraction(True, 128, 8192) == pytest.approx(529 / 989)  # no backward bars: the forward's rate
    assert fa2.fraction(False, 128, 8192) == pytest.approx(333 / 989)
    kw = dict(global_batch=16, recompute="op")
    fast = plan_at_scale("llama3-8b", device_arg("h100", attention="cudnn_hopper"), 8, ["fsdp"], **kw)[0]
    assert fast["compute_s"] < plan_at_scale("llama3-8b", "h100", 8, ["fsdp"], **kw)[0]["compute_s"]
    args = ["plan", "--arch", "llama3", "--sizes", "8b", "--gpus", "8", "--device", "h100", "--strategies", "fsdp"]
    assert main([*args, "--attention-kernel", "cudnn_hopper"]) == 0
    assert "overridden: attention kernel cudnn_hopper (fwd: fa3_paper, the cuDNN bars" in capsys.readouterr().out
    assert main([*args, "--attention-kernel", "fa3"]) == 2
    assert "--attention-kernel 'fa3': choose from fa2_hopper, cudnn_hopper, fa2_ampere" in capsys.readouterr().err


def test_a_preset_s_note_on_its_attention_table_goes_when_another_table_is_named():
    """The B200 runs Hopper's FlashAttention-2 table and its preset says so; with another kernel named, the compute
    line names that kernel's source, not the B200's note on a table no longer priced."""
    from harness.model.device_file import device_arg  # noqa: PLC0415

    assert dict(device_arg("b200").op_rates.sources)["attention"].startswith("no flash attention measurement on a B200")
    named = dict(device_arg("b200", attention="cudnn_hopper").op_rates.sources)["attention"]
    assert named.startswith("cudnn_hopper: fwd: fa3_paper, the cuDNN bars")
