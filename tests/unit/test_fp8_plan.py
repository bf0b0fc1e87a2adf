"""The fp8 axes as the planner expands them: recipes and FSDP's float8 all-gather vary fp8 cells only, appear in
the id only when pulled, and every fp8 group gets its bf16 single-device reference (fp8 parity is against bf16)."""

from __future__ import annotations

import pytest

from harness.cli import build_parser, spec_from_args
from harness.errors import UsageError
from harness.model.block_ops import fp8_linears
from harness.planner import expand
from harness.run.parity import parity_key
from harness.spec import CellConfig
from workloads.sizes import get_size


def _plan(*args: str):
    return expand(spec_from_args(build_parser().parse_args(["plan", "--device", "cpu", "--sizes", "tiny", *args])))


def test_the_fp8_axes_cross_fp8_cells_only_and_show_in_the_id_when_pulled(monkeypatch):
    monkeypatch.setenv("HARNESS_FORCE_CPU", "1")
    cells = {c.cell_id: c for c in _plan("--gpus", "2", "--strategies", "fsdp", "--precision", "bf16,fp8",
                                         "--fp8-recipe", "tensorwise,rowwise", "--fp8-all-gather", "off,on")}
    assert sorted(cells) == sorted([
        "tiny-single-bf16-w1-gb8-strong", "tiny-fsdp-bf16-w2-gb8-strong",
        "tiny-single-fp8-w1-gb8-strong", "tiny-single-fp8-w1-gb8-strong-rowwise",
        "tiny-single-fp8-w1-gb8-strong-fp8ag", "tiny-single-fp8-w1-gb8-strong-rowwise-fp8ag",
        "tiny-fsdp-fp8-w2-gb8-strong", "tiny-fsdp-fp8-w2-gb8-strong-rowwise",
        "tiny-fsdp-fp8-w2-gb8-strong-fp8ag", "tiny-fsdp-fp8-w2-gb8-strong-rowwise-fp8ag"])
    valid = sorted(cid for cid, c in cells.items() if c.valid)
    assert valid == sorted(["tiny-single-bf16-w1-gb8-strong", "tiny-fsdp-bf16-w2-gb8-strong",
                            "tiny-single-fp8-w1-gb8-strong", "tiny-single-fp8-w1-gb8-strong-rowwise",
                            "tiny-fsdp-fp8-w2-gb8-strong", "tiny-fsdp-fp8-w2-gb8-strong-rowwise",
                            "tiny-fsdp-fp8-w2-gb8-strong-fp8ag"])
    assert "has no FSDP" in cells["tiny-single-fp8-w1-gb8-strong-fp8ag"].reason
    assert "tensorwise recipe only" in cells["tiny-fsdp-fp8-w2-gb8-strong-rowwise-fp8ag"].reason
    assert all(c.config.fp8_emulate for c in cells.values() if c.valid and c.raw["precision"] == "fp8")


def test_an_fp8_sweep_plans_its_bf16_reference_first(monkeypatch):
    monkeypatch.setenv("HARNESS_FORCE_CPU", "1")
    cells = _plan("--gpus", "2", "--strategies", "ddp", "--precision", "fp8")
    assert [(c.cell_id, c.reference_only) for c in cells] == [
        ("tiny-single-bf16-w1-gb8-strong", True), ("tiny-single-fp8-w1-gb8-strong", True),
        ("tiny-ddp-fp8-w2-gb8-strong", False)]
    # every fp8 cell is held to the bf16 single device's curve; that cell is its group's key
    bf16, single, ddp = (c.config.to_dict() for c in cells)
    assert parity_key(single) == parity_key(bf16) != parity_key({**bf16, "precision": "fp32"})
    assert parity_key(ddp) == parity_key({**bf16, "global_batch": ddp["global_batch"]})


def test_fp8_options_on_another_precision_are_refused():
    base = dict(size="tiny", strategy="single", world_size=1, global_batch=8, seq_len=64, steps=2, warmup=0,
                device_kind="cpu")
    with pytest.raises(UsageError, match="need precision fp8, and this cell is bf16"):
        CellConfig(precision="bf16", fp8_recipe="rowwise", **base)
    with pytest.raises(UsageError, match="unknown fp8 recipe 'columnwise'"):
        CellConfig(precision="fp8", fp8_recipe="columnwise", **base)


@pytest.mark.parametrize("arch, count", [
    ("gpt2", 4 * 6),    # q, k, v, out, fc, proj: widths 128 and 512, all multiples of 16
    ("llama3", 4 * 7),  # q, k, v, out (kv 64) and SwiGLU's gate, up, proj (d_ff 352 = 22 x 16)
    ("moe", 4 * 4),     # the attention only: the experts are stacked weights, the router's 4 outputs not a multiple of 16
])
def test_the_models_fp8_linears_by_hand(arch, count):
    names = fp8_linears(get_size("tiny", arch))
    assert len(names) == count and len(set(names)) == count
    assert not any(n.endswith("head") or "router" in n or "expert" in n for n in names)


def test_fp8_prices_its_float8_linears_at_the_fp8_peak_and_the_rest_at_bf16s():
    from harness.model.block_ops import fp8_flops_fraction
    from harness.model.whatif import predict_row, scenario
    from harness.report.whatif_text import assumptions_lines

    size = get_size("70b", "llama3")
    # by hand, per block: q and out 8192 x 8192, k and v 8192 x 1024 (8 kv heads of 128), gate, up, proj 8192 x 28672
    per_block = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672
    f = 6 * per_block * 80 / size.flops_per_token()
    assert fp8_flops_fraction(size) == pytest.approx(f, rel=1e-12) and 0.8 < f < 0.9
    s = scenario("llama3-70b", "h100", 256, "fp8", efficiency=0.4)  # one fraction: fp8's FLOPs split by peak
    fp8_peak, bf16_peak = s.device.peak_tflops["fp8"], s.device.peak_tflops["bf16"]
    assert s.compute_peak_tflops == pytest.approx(1 / (f / fp8_peak + (1 - f) / bf16_peak))
    assert bf16_peak < s.compute_peak_tflops < fp8_peak
    header = "\n".join(assumptions_lines(s))
    assert f"float8 linears {100 * f:.1f}% of the model FLOPs at the fp8 datasheet peak {fp8_peak:g}" in header
    row = predict_row(s, "fsdp+tp")  # fp8 with tensor parallel: a row, no longer refused (torchao's float8 TP styles)
    assert row["valid"] and row["tokens_per_s_per_device"] > 0, row
    ops = scenario("llama3-70b", "h100", 256, "fp8")  # op by op: torchao's float8 GEMMs and their casts
    assert "fp8: torchao's float8 GEMMs, each operand's amax and scaled cast" in "\n".join(assumptions_lines(ops))


def test_the_table_says_emulated():
    from harness.report.frame import precision_label

    assert precision_label({"precision": "fp8", "fp8_emulate": True}) == "fp8 (emulated)"
    assert precision_label({"precision": "fp8"}) == "fp8" and precision_label({"precision": "bf16"}) == "bf16"
