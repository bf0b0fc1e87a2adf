"""A device file at the door (harness/model/device_file.py), every refusal and every boundary by hand.

Each bad file gets one line naming the file, the key, the value and the fix; the boundaries (a figure at its
minimum, a rate at a thousandth of the part's datasheet figure or at the figure itself, a launch time of one
second, one GPU a node) are accepted. Issue 61's mutation run over this module killed 269 of 427 mutants with the
tests before this file; these rows hold what the survivors changed: each bound's side, each message's text.
"""

from __future__ import annotations

import pytest

from harness.errors import UsageError
from harness.model.device_file import device_arg, device_from_file
from harness.model.hardware import get_device

H100 = 'base = "h100"\n'
"""h100's figures (harness/model/hardware.py): bf16 peak 989.5 TFLOP/s, HBM 3,350 GB/s, 700 W, no fp16 gap."""
BASELESS = ('name = "x"\nproduct = "X"\nhbm_gib = 10\nhbm_gbps = 100\ngpus_per_node = 2\nintra_gbps = 10\n'
            'inter_gbps = 1\n[peak_tflops]\nbf16 = 100\n')
"""Every key a file without a base needs but its op rates."""
RATES = '[op_rates]\nsms = 10\nattention = "fa2_hopper"\nlaunch_us = 5\n'
DTYPES = "fp32, tf32, bf16, fp16, fp8"
KEYS = ("base, name, product, hbm_gib, hbm_gbps, tdp_w, power_cap_w, gpus_per_node, intra_gbps, inter_gbps, "
        "peak_tflops, op_rates")
RATE_KEYS = "sms, gemm_tflops, gemm_source, attention, hbm_measured_tbps, hbm_source, launch_us, launch_source, " \
            "kernel_floor_us"

REFUSED = [
    # the keys
    ("zzz = 1\n", f"unknown key 'zzz'; valid keys: {KEYS}"),
    ('base = "h900"\n', "base = 'h900' is not a preset; choose from h100, h100-pcie, h200, a100, a100-40gb, b200"),
    ("base = 3\n", "base = 3 is not a preset; choose from h100, h100-pcie, h200, a100, a100-40gb, b200"),
    ('name = "x"\n', 'without base = "<preset>" it needs product, hbm_gib, hbm_gbps, gpus_per_node, intra_gbps, '
                     "inter_gbps, peak_tflops; or name a base (h100, h100-pcie, h200, a100, a100-40gb, b200)"),
    # the figures: > 0, finite, not a boolean
    (H100 + "hbm_gib = 0\n", "hbm_gib = 0 must be a finite number > 0"),
    (H100 + "hbm_gbps = nan\n", "hbm_gbps = nan must be a finite number > 0"),
    (H100 + "intra_gbps = inf\n", "intra_gbps = inf must be a finite number > 0"),
    (H100 + "tdp_w = true\n", "tdp_w = True must be a finite number > 0"),
    (H100 + 'inter_gbps = "50"\n', "inter_gbps = '50' must be a finite number > 0"),
    # the peaks
    (H100 + "peak_tflops = 5\n", "peak_tflops must be a table of dtype = TFLOP/s, e.g. bf16 = 989.5"),
    (H100 + "[peak_tflops]\n", "peak_tflops must be a table of dtype = TFLOP/s, e.g. bf16 = 989.5"),
    (H100 + "[peak_tflops]\nint8 = 1\n", f"peak_tflops.int8: not a compute dtype; give {DTYPES}"),
    (H100 + "[peak_tflops]\nbf16 = 0\n", "peak_tflops.bf16 = 0 must be a finite number > 0"),
    # the node
    (H100 + "gpus_per_node = 0\n", "gpus_per_node = 0 must be an integer >= 1"),
    (H100 + "gpus_per_node = 1.5\n", "gpus_per_node = 1.5 must be an integer >= 1"),
    (H100 + "gpus_per_node = true\n", "gpus_per_node = True must be an integer >= 1"),
    # the op rates
    (H100 + "op_rates = 1\n", "op_rates must be a table, e.g. [op_rates] sms = 132"),
    (H100 + "[op_rates]\nfoo = 1\n", f"unknown op_rates key 'foo'; valid keys: {RATE_KEYS}"),
    (H100 + "[op_rates]\nsms = 0\n", "op_rates.sms = 0 must be an integer >= 1 (the part's SM count)"),
    (H100 + "[op_rates]\nsms = 1.0\n", "op_rates.sms = 1.0 must be an integer >= 1 (the part's SM count)"),
    (H100 + "[op_rates]\nsms = true\n", "op_rates.sms = True must be an integer >= 1 (the part's SM count)"),
    (H100 + "[op_rates]\nlaunch_us = 0\n", "op_rates.launch_us = 0 must be a finite number > 0"),
    (H100 + "[op_rates]\nhbm_measured_tbps = 0\n", "op_rates.hbm_measured_tbps = 0 must be a finite number > 0"),
    (H100 + "[op_rates]\nkernel_floor_us = -1\n", "op_rates.kernel_floor_us = -1 must be a finite number >= 0"),
    (H100 + "[op_rates]\nattention = 1\n", "op_rates.attention = 1 must be a string"),
    (H100 + "[op_rates]\ngemm_tflops = 700\n",
     "op_rates.gemm_tflops must be a table of dtype = TFLOP/s, e.g. gemm_tflops = { bf16 = 700 }"),
    (H100 + "[op_rates]\ngemm_tflops = {}\n",
     "op_rates.gemm_tflops must be a table of dtype = TFLOP/s, e.g. gemm_tflops = { bf16 = 700 }"),
    (H100 + "[op_rates]\ngemm_tflops = { int8 = 1 }\n", f"op_rates.gemm_tflops.int8: not a compute dtype; give {DTYPES}"),
    (H100 + "[op_rates]\ngemm_tflops = { bf16 = 0 }\n", "op_rates.gemm_tflops.bf16 = 0 must be a finite number > 0"),
    # a measured rate within [figure / 1000, figure]: h100's bf16 989.5, so [0.9895, 989.5]; its HBM 3.35 TB/s
    (H100 + "[op_rates]\ngemm_tflops = { bf16 = 989.6 }\n",
     "op_rates.gemm_tflops.bf16 = 989.6 must lie in [0.9895, 989.5], up to the part's datasheet figure"),
    (H100 + "[op_rates]\ngemm_tflops = { bf16 = 0.9894 }\n",
     "op_rates.gemm_tflops.bf16 = 0.9894 must lie in [0.9895, 989.5], up to the part's datasheet figure"),
    (H100 + "[op_rates]\nhbm_measured_tbps = 3.36\n",
     "op_rates.hbm_measured_tbps = 3.36 must lie in [0.00335, 3.35], up to the part's datasheet figure"),
    (H100 + "[peak_tflops]\nbf16 = 989.5\n[op_rates]\ngemm_tflops = { fp16 = 500 }\n",
     "op_rates.gemm_tflops.fp16: the part has no fp16 peak; give it under [peak_tflops]"),
    (H100 + "[op_rates]\nlaunch_us = 1000000.5\n", "op_rates.launch_us = 1e+06 us is over a second; give microseconds"),
    (H100 + "[op_rates]\nkernel_floor_us = 2e6\n",
     "op_rates.kernel_floor_us = 2e+06 us is over a second; give microseconds"),
    # what the model and the pricing need
    (H100 + 'product = "Mystery GPU"\n', "product 'Mystery GPU' is not in the datasheet table; give [peak_tflops]"),
    (BASELESS, "op rates: no sms, attention, launch_us; a device file without a base gives them in [op_rates]"),
    # the power cap
    (H100 + "power_cap_w = 700.5\n", "power_cap_w = 700.5 W is above tdp_w = 700 W, the board power (a higher limit "
                                     "changes nothing); give power_cap_w <= 700"),
    (BASELESS.replace("[peak", "power_cap_w = 300\n[peak") + RATES,
     "power_cap_w = 300 needs tdp_w (the board power the peaks hold at) in the file or its base"),
]


@pytest.mark.parametrize("body, message", REFUSED, ids=[f"{i:02d}" for i in range(len(REFUSED))])
def test_a_bad_device_file_is_refused_in_one_line(tmp_path, body, message):
    f = tmp_path / "d.toml"
    f.write_text(body)
    with pytest.raises(UsageError) as e:
        device_from_file(f)
    assert str(e.value) == f"{f}: {message}"


def test_a_file_that_is_not_toml_or_not_text_is_refused(tmp_path):
    f = tmp_path / "d.toml"
    f.write_bytes(b'base = "h100"\n\xff\n')
    with pytest.raises(UsageError) as e:
        device_from_file(f)
    assert str(e.value) == f"--device {f}: not UTF-8 text (byte 14); a device file is TOML, fix the file"
    f.write_text("base = \n")
    with pytest.raises(UsageError) as e:
        device_from_file(f)
    assert str(e.value).startswith(f"--device {f}: cannot read TOML (") and str(e.value).endswith("); fix the file")
    with pytest.raises(UsageError) as e:
        device_from_file(tmp_path / "none.toml")
    assert str(e.value).startswith(f"--device {tmp_path / 'none.toml'}: cannot read TOML (")


ACCEPTED = [
    # each figure at its bound: a rate at the datasheet figure and at a thousandth of it, a floor of 0, one second of
    # launch, one GPU a node, one SM, a power cap at the board power, a base named in capitals
    H100 + "[op_rates]\ngemm_tflops = { bf16 = 989.5 }\n",
    H100 + "[op_rates]\ngemm_tflops = { bf16 = 0.9895 }\n",
    H100 + "[op_rates]\nhbm_measured_tbps = 3.35\nkernel_floor_us = 0\nlaunch_us = 1e6\n",
    H100 + "gpus_per_node = 1\n[op_rates]\nsms = 1\n",
    H100 + "power_cap_w = 700\n",
    'base = "H100"\n',
]


@pytest.mark.parametrize("body", ACCEPTED, ids=[f"{i:02d}" for i in range(len(ACCEPTED))])
def test_a_figure_at_its_bound_is_accepted(tmp_path, body):
    f = tmp_path / "d.toml"
    f.write_text(body)
    assert device_from_file(f).name == "d"  # the file's stem without a name


def test_a_file_without_a_base_is_its_own_figures_whole(tmp_path):
    """Every field of a device from a file that names no preset: the links' typical latencies (5 us in a node, 10 us
    across), no board power, no rate preset, the op rates the file's."""
    f = tmp_path / "x.toml"
    f.write_text(BASELESS + RATES)
    dev = device_from_file(f)
    assert (dev.name, dev.product, dev.hbm_gib, dev.hbm_gbps, dev.gpus_per_node, dev.tdp_w) == ("x", "X", 10.0, 100.0,
                                                                                               2, 0)
    assert (dev.intra.name, dev.intra.gbps, dev.intra.latency_s, dev.intra.source) == ("in-node link 10 GB/s", 10.0,
                                                                                       5e-6, str(f))
    assert (dev.inter.name, dev.inter.gbps, dev.inter.latency_s, dev.inter.source) == ("NIC 1 GB/s", 1.0, 10e-6, str(f))
    assert dev.peaks == (("bf16", 100.0),) and dev.source == str(f) and dev.rates_preset is None
    assert dev.overrides == (f"from {f}",)
    assert dev.rate_overrides == (("attention", "fa2_hopper"), ("launch_us", 5), ("sms", 10))
    assert dev.power_cap_w is None
    f.write_text(BASELESS.replace("[peak", "tdp_w = 400\npower_cap_w = 300\n[peak") + RATES)
    assert (device_from_file(f).tdp_w, device_from_file(f).power_cap_w) == (400, 300)  # the file's board power


def test_a_file_over_a_base_says_so_and_keeps_the_rest_of_the_base(tmp_path):
    f = tmp_path / "h100-capped.toml"
    f.write_text(H100 + 'power_cap_w = 500\n[op_rates]\ngemm_tflops = { bf16 = 700.5, fp8 = 1500 }\n')
    dev, base = device_from_file(f), get_device("h100")
    assert dev.overrides[0] == f"from {f} (base h100)" and dev.rates_preset == base.rates_preset
    assert (dev.product, dev.hbm_gib, dev.tdp_w, dev.peaks, dev.power_cap_w) == (base.product, base.hbm_gib, 700, base.peaks,
                                                                              500)
    assert dev.rate_overrides == (("gemm_tflops", (("bf16", 700.5), ("fp8", 1500))),)
    assert device_arg(str(f), power_cap_w=400).power_cap_w == 400  # the flag over the file
    f.write_text(H100 + "tdp_w = 650\n")
    assert device_from_file(f).tdp_w == 650 and device_from_file(f).peaks == base.peaks
    assert device_arg("h200", mem_gib=100).hbm_gib == 100 and device_arg("h200").hbm_gib == get_device("h200").hbm_gib
