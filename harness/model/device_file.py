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
import math
import tomllib
from dataclasses import replace
from pathlib import Path

from harness.errors import UsageError
from harness.model.device_rates import RATE_KEYS
from harness.model.hardware import DEVICES, Device, Interconnect, get_device, with_overrides

FILE_KEYS = ("base", "name", "product", "hbm_gib", "hbm_gbps", "tdp_w", "power_cap_w", "gpus_per_node", "intra_gbps",
             "inter_gbps", "peak_tflops", "op_rates")
DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
"""The compute dtypes a peak or a GEMM rate is given for."""
NUMBERS = ("hbm_gib", "hbm_gbps", "tdp_w", "power_cap_w", "intra_gbps", "inter_gbps")


def _positive(path: Path, key: str, value: object, minimum: float = 0.0, strict: bool = True) -> float:
    """A finite number > ``minimum`` (>= when not ``strict``); NaN, the infinities and booleans refused."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or not (
            value > minimum if strict else value >= minimum):
        raise UsageError(f"{path}: {key} = {value!r} must be a finite number {'>' if strict else '>='} {minimum:g}")
    return float(value)


RATE_NUMBERS = {"hbm_measured_tbps": True, "launch_us": True, "kernel_floor_us": False}
"""``[op_rates]``'s plain numbers: > 0 (True) or >= 0 (False)."""
RATE_TEXTS = ("gemm_source", "attention", "hbm_source", "launch_source")


def _rates(path: Path, rates: object) -> dict:
    """A file's ``[op_rates]`` with each value's type checked (the figures finite, ``sms`` a whole count)."""
    if not isinstance(rates, dict):
        raise UsageError(f"{path}: op_rates must be a table, e.g. [op_rates] sms = 132")
    for key, value in rates.items():
        where = f"op_rates.{key}"
        if key not in RATE_KEYS:
            raise UsageError(f"{path}: unknown op_rates key {key!r}; valid keys: {', '.join(RATE_KEYS)}")
        if key == "sms" and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise UsageError(f"{path}: {where} = {value!r} must be an integer >= 1 (the part's SM count)")
        if key in RATE_NUMBERS:
            _positive(path, where, value, strict=RATE_NUMBERS[key])
        if key in RATE_TEXTS and not isinstance(value, str):
            raise UsageError(f"{path}: {where} = {value!r} must be a string")
        if key == "gemm_tflops":
            if not isinstance(value, dict) or not value:
                raise UsageError(f"{path}: {where} must be a table of dtype = TFLOP/s, e.g. gemm_tflops = {{ bf16 = 700 }}")
            for dtype, rate in value.items():
                if dtype not in DTYPES:
                    raise UsageError(f"{path}: {where}.{dtype}: not a compute dtype; give {', '.join(DTYPES)}")
                _positive(path, f"{where}.{dtype}", rate)
    return rates


def _within_the_part(path: Path, rates: dict, dev: Device) -> None:
    """A measured rate lies between a thousandth of the part's datasheet figure and the figure itself (a measurement
    above the datasheet, or a unit off by a thousand, is a typo); launch and floor times under a second."""
    bounds = {f"gemm_tflops.{dtype}": (rate, dev.peak_tflops.get(dtype)) for dtype, rate in
              rates.get("gemm_tflops", {}).items()}
    if "hbm_measured_tbps" in rates:
        bounds["hbm_measured_tbps"] = (rates["hbm_measured_tbps"], dev.hbm_gbps / 1000)
    for key, (value, top) in bounds.items():
        if top is None:
            raise UsageError(f"{path}: op_rates.{key}: the part has no {key.split('.')[-1]} peak; give it under "
                             f"[peak_tflops]")
        if not top / 1000 <= value <= top:
            raise UsageError(f"{path}: op_rates.{key} = {value:g} must lie in [{top / 1000:g}, {top:g}], up to the "
                             f"part's datasheet figure")
    for key in ("launch_us", "kernel_floor_us"):
        if key in rates and rates[key] > 1e6:
            raise UsageError(f"{path}: op_rates.{key} = {rates[key]:g} us is over a second; give microseconds")


def device_from_file(path: Path) -> Device:
    """A device from a TOML file (the module docstring)."""
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise UsageError(f"--device {path}: not UTF-8 text (byte {e.start}); a device file is TOML, fix the file") from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise UsageError(f"--device {path}: cannot read TOML ({e}); fix the file") from None
    for key in raw:
        if key not in FILE_KEYS:
            close = difflib.get_close_matches(key, FILE_KEYS, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(FILE_KEYS)}"
            raise UsageError(f"{path}: unknown key {key!r}; {hint}")
    if "base" in raw:
        if not isinstance(raw["base"], str) or raw["base"].lower() not in DEVICES:
            raise UsageError(f"{path}: base = {raw['base']!r} is not a preset; choose from {', '.join(DEVICES)}")
        base = get_device(raw["base"])
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
        for k in peaks:
            if k not in DTYPES:
                raise UsageError(f"{path}: peak_tflops.{k}: not a compute dtype; give {', '.join(DTYPES)}")
        peaks = tuple(sorted((str(k), _positive(path, f"peak_tflops.{k}", v)) for k, v in peaks.items()))
    gpn = raw.get("gpus_per_node", base.gpus_per_node if base else None)
    if not isinstance(gpn, int) or isinstance(gpn, bool) or gpn < 1:
        raise UsageError(f"{path}: gpus_per_node = {gpn!r} must be an integer >= 1")
    template = base or Device("", "", 0, 0, 1, Interconnect("", 0, 0, ""), Interconnect("", 0, 0, ""), "")
    intra, inter = template.intra, template.inter
    if "intra_gbps" in nums:  # a line rate: NCCL's share of it is the base's link's (the line rate without a base)
        intra = Interconnect(f"in-node link {nums['intra_gbps']:g} GB/s", nums["intra_gbps"], intra.latency_s or 5e-6,
                             str(path), intra.nccl_share, intra.nccl_source)
    if "inter_gbps" in nums:
        inter = Interconnect(f"NIC {nums['inter_gbps']:g} GB/s", nums["inter_gbps"], inter.latency_s or 10e-6, str(path),
                             inter.nccl_share, inter.nccl_source)
    rates = _rates(path, raw.get("op_rates", {}))
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
    _within_the_part(path, rates, dev)
    try:
        dev.op_rates  # noqa: B018  (every rate the pricing needs, from the base or the file)
    except ValueError as e:
        raise UsageError(f"{path}: {e}") from None
    cap = nums.get("power_cap_w")
    if cap is not None and not (dev.tdp_w and cap <= dev.tdp_w):
        raise UsageError(f"{path}: power_cap_w = {cap:g} W is above tdp_w = {dev.tdp_w:g} W, the board power (a "
                         f"higher limit changes nothing); give power_cap_w <= {dev.tdp_w:g}"
                         if dev.tdp_w else f"{path}: power_cap_w = {cap:g} needs tdp_w (the board power the peaks "
                         f"hold at) in the file or its base")
    return with_overrides(dev, power_cap_w=cap)


def device_arg(value: str, mem_gib: float | None = None, power_cap_w: float | None = None,
               attention: str | None = None) -> Device:
    """``--device NAME|FILE.toml`` with ``--device-mem``, ``--power-cap`` and ``--attention-kernel`` on top."""
    dev = device_from_file(Path(value)) if value.endswith(".toml") else get_device(value)
    return with_overrides(dev, hbm_gib=mem_gib, power_cap_w=power_cap_w, attention=attention)
