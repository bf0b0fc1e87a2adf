"""A device as data: a hardware preset with overrides (``--device-mem``, ``--power-cap``), or a TOML file.

A device file names the part a published run used when no preset does (torchtitan's 96 GB HBM2e H100s held to
500 W, say)::

    base = "h100"                 # the preset the rest overrides (optional: then every field below is needed)
    name = "h100-96gb-500w"
    product = "NVIDIA H100 96GB HBM2e"
    hbm_gib = 89.4                # what the driver reports as total memory
    hbm_gbps = 2400
    tdp_w = 700                   # board power the peaks hold at
    power_cap_w = 500             # optional: compute peaks x (cap / tdp) ** (1/3)
    gpus_per_node = 8
    intra_gbps = 450              # per GPU and direction, in a node
    inter_gbps = 50               # per GPU NIC, across nodes
    [peak_tflops]                 # dense peaks by dtype; default: the datasheet table's for product (or base's)
    bf16 = 989.5
    [op_rates]                    # what each kind of op runs at (harness/model/device_rates.toml's fields), over
    sms = 132                     #   the base preset's; without a base: sms, attention and launch_us at least
    gemm_tflops = { bf16 = 700.9 }
    hbm_measured_tbps = 2.1
    launch_us = 10

An unknown key, a missing one or a bad value is a UsageError naming the key and the file.
"""

from __future__ import annotations

import difflib
import tomllib
from dataclasses import replace
from pathlib import Path

from harness.errors import UsageError
from harness.model.device_rates import RATE_KEYS
from harness.model.hardware import DEVICES, Device, Interconnect, get_device, with_overrides

FILE_KEYS = ("base", "name", "product", "hbm_gib", "hbm_gbps", "tdp_w", "power_cap_w", "gpus_per_node", "intra_gbps",
             "inter_gbps", "peak_tflops", "op_rates")
NUMBERS = ("hbm_gib", "hbm_gbps", "tdp_w", "power_cap_w", "intra_gbps", "inter_gbps")


def _positive(path: Path, key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise UsageError(f"{path}: {key} = {value!r} must be a number > 0")
    return float(value)


def device_from_file(path: Path) -> Device:
    """A device from a TOML file (the module docstring)."""
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise UsageError(f"--device {path}: cannot read TOML ({e}); fix the file") from None
    for key in raw:
        if key not in FILE_KEYS:
            close = difflib.get_close_matches(key, FILE_KEYS, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(FILE_KEYS)}"
            raise UsageError(f"{path}: unknown key {key!r}; {hint}")
    if "base" in raw:
        base = get_device(str(raw["base"]))
    else:
        missing = [k for k in FILE_KEYS if k not in raw and k not in ("base", "power_cap_w", "tdp_w", "op_rates")]
        if missing:
            raise UsageError(f"{path}: without base = \"<preset>\" it needs {', '.join(missing)}; or name a base "
                             f"({', '.join(DEVICES)})")
        base = None
    nums = {k: _positive(path, k, raw[k]) for k in NUMBERS if k in raw}
    peaks = raw.get("peak_tflops")
    if peaks is not None:
        if not isinstance(peaks, dict) or not peaks:
            raise UsageError(f"{path}: peak_tflops must be a table of dtype = TFLOP/s, e.g. bf16 = 989.5")
        peaks = tuple(sorted((str(k), _positive(path, f"peak_tflops.{k}", v)) for k, v in peaks.items()))
    gpn = raw.get("gpus_per_node", base.gpus_per_node if base else None)
    if not isinstance(gpn, int) or isinstance(gpn, bool) or gpn < 1:
        raise UsageError(f"{path}: gpus_per_node = {gpn!r} must be an integer >= 1")
    template = base or Device("", "", 0, 0, 1, Interconnect("", 0, 0, ""), Interconnect("", 0, 0, ""), "")
    intra, inter = template.intra, template.inter
    if "intra_gbps" in nums:
        intra = Interconnect(f"in-node link {nums['intra_gbps']:g} GB/s", nums["intra_gbps"], intra.latency_s or 5e-6,
                             str(path))
    if "inter_gbps" in nums:
        inter = Interconnect(f"NIC {nums['inter_gbps']:g} GB/s", nums["inter_gbps"], inter.latency_s or 10e-6, str(path))
    rates = raw.get("op_rates", {})
    if not isinstance(rates, dict):
        raise UsageError(f"{path}: op_rates must be a table, e.g. [op_rates] sms = 132")
    for key in rates:
        if key not in RATE_KEYS:
            raise UsageError(f"{path}: unknown op_rates key {key!r}; valid keys: {', '.join(RATE_KEYS)}")
    overrides = tuple(sorted((k, tuple(sorted(v.items())) if isinstance(v, dict) else v) for k, v in rates.items()))
    dev = replace(template, name=str(raw.get("name", path.stem)), product=str(raw.get("product", template.product)),
                  hbm_gib=nums.get("hbm_gib", template.hbm_gib), hbm_gbps=nums.get("hbm_gbps", template.hbm_gbps),
                  gpus_per_node=gpn, intra=intra, inter=inter, source=str(path),
                  tdp_w=nums.get("tdp_w", template.tdp_w), peaks=peaks if peaks is not None else template.peaks,
                  overrides=(f"from {path}" + (f" (base {base.name})" if base else ""),),
                  rates_preset=base.rates_preset if base else None, rate_overrides=overrides)
    try:
        dev.peak_tflops  # noqa: B018  (the product must be in the table when no peaks are given)
    except ValueError:
        raise UsageError(f"{path}: product {dev.product!r} is not in the datasheet table; give [peak_tflops]") from None
    try:
        dev.op_rates  # noqa: B018  (every rate the pricing needs, from the base or the file)
    except ValueError as e:
        raise UsageError(f"{path}: {e}") from None
    return with_overrides(dev, power_cap_w=nums.get("power_cap_w"))


def device_arg(value: str, mem_gib: float | None = None, power_cap_w: float | None = None) -> Device:
    """``--device NAME|FILE.toml`` with ``--device-mem`` and ``--power-cap`` applied on top."""
    dev = device_from_file(Path(value)) if value.endswith(".toml") else get_device(value)
    return with_overrides(dev, hbm_gib=mem_gib, power_cap_w=power_cap_w)
