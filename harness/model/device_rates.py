"""Each device preset's op rates (:class:`harness.model.op_cost.OpRates`) from harness/model/device_rates.toml, where
every figure is a published or measured one with its source.

What a preset's sources do not give is stood in for, and :attr:`OpRates.sources` says so for that preset:

* a dtype's achievable matmul rate: the H200 calibration's fraction of the H200's datasheet peak in that dtype,
  times this device's peak (the harness's own measurement is the one fraction measured in every dtype);
* the achievable HBM bandwidth: the H200's BabelStream triad over its datasheet bandwidth;
* the kernel floor: 0 (no public measurement of an empty kernel's GPU time was found; ``calibrate --ops``
  measures it).

A calibration of the device kind (``harness calibrate --ops`` on that GPU, :mod:`harness.calibration.ops`) replaces
the figures it measured, and says so.
"""

from __future__ import annotations

import functools
import tomllib
from dataclasses import replace
from pathlib import Path

from harness.measure.peaks import datasheet_peaks
from harness.model.op_cost import AttentionTable, OpRates

DATA = Path(__file__).with_name("device_rates.toml")
REFERENCE = "h200"
"""The preset whose measured fractions stand in for what another preset's sources do not give."""
REFERENCE_PRODUCT = "NVIDIA H200"
REFERENCE_HBM_GBPS = 4800.0


@functools.lru_cache(maxsize=1)
def _data() -> dict:
    return tomllib.loads(DATA.read_text())


def _table(name: str) -> AttentionTable:
    t = _data()["attention"][name]
    rows = {k: tuple(float(x) for x in v) for k, v in t.items() if k.startswith("fwd")}
    return AttentionTable(
        peak=float(t["peak"]), seq=tuple(int(s) for s in t["seq"]),
        fwd=tuple(sorted((int(k.removeprefix("fwd_d")), v) for k, v in rows.items() if k.startswith("fwd_d"))),
        fwd_bwd=tuple(sorted((int(k.removeprefix("fwd_bwd_d")), v) for k, v in rows.items()
                             if k.startswith("fwd_bwd_d"))),
        source=f"{name}: {t['source']}")


def attention_names() -> tuple[str, ...]:
    """The attention kernels the data file measures (a preset's ``attention``, or ``plan --attention-kernel``)."""
    return tuple(_data()["attention"])


def attention_source(name: str) -> str:
    """A measured attention table's source, as the data file gives it."""
    return str(_data()["attention"][name]["source"])


def preset_names() -> tuple[str, ...]:
    return tuple(_data()["devices"])


RATE_KEYS = ("sms", "gemm_tflops", "gemm_source", "attention", "hbm_measured_tbps", "hbm_source", "launch_us",
             "launch_source", "kernel_floor_us")
"""What a device file's ``[op_rates]`` may give, over its base preset's."""
REQUIRED = ("sms", "attention", "launch_us")


def op_rates(preset: str | None, peaks: dict[str, float], hbm_gbps: float, overrides: dict | None = None) -> OpRates:
    """The op rates of ``preset`` (a key of the data file; None: ``overrides`` give them all) for a part whose dense
    peaks by dtype are ``peaks`` (its datasheet's, or a device file's) and whose datasheet bandwidth is ``hbm_gbps`` (the preset's: a measured bandwidth is a fraction of it)."""
    data = _data()
    if preset is not None and preset not in data["devices"]:
        raise ValueError(f"no op rates for device preset {preset!r} in {DATA.name}; have {', '.join(data['devices'])}")
    base = data["devices"][preset] if preset else {}
    given = {k: dict(v) if isinstance(v, tuple) else v for k, v in (overrides or {}).items()}
    d = {**base, **given}
    if "gemm_tflops" in given:  # a file's dtypes over the base's, each
        d["gemm_tflops"] = {**base.get("gemm_tflops", {}), **given["gemm_tflops"]}
        d["gemm_source"] = f"{base.get('gemm_source', '')}; the device file: {', '.join(given['gemm_tflops'])}"
    missing = [k for k in REQUIRED if k not in d]
    if missing:
        raise ValueError(f"op rates: no {', '.join(missing)}; a device file without a base gives them in [op_rates]")
    d.setdefault("gemm_source", "the device file" if overrides else "")
    d.setdefault("launch_source", "hta")
    ref = data["devices"][REFERENCE]
    ref_peaks = datasheet_peaks(REFERENCE_PRODUCT) or {}
    measured = {k: float(v) for k, v in d.get("gemm_tflops", {}).items()}
    gemm = {dtype: measured.get(dtype, float(ref["gemm_tflops"][dtype]) / ref_peaks[dtype] * peak)
            for dtype, peak in peaks.items() if dtype in measured or dtype in ref["gemm_tflops"]}
    sources = [("gemm_tflops", d["gemm_source"])]
    if d["attention"] not in data["attention"]:
        raise ValueError(f"op rates: attention = {d['attention']!r}: choose from {', '.join(data['attention'])}")
    table = _table(d["attention"])
    # the base's note on its table (a B200 runs Hopper's) holds only while that table is the one priced
    note = d.get("attention_note") if "attention" not in given else None
    sources.append(("attention", note or table.source))
    if "hbm_measured_tbps" in d:
        efficiency = float(d["hbm_measured_tbps"]) * 1000 / hbm_gbps
        sources.append(("bandwidth_efficiency", d.get("hbm_source", "the device file")))
    else:
        efficiency = float(ref["hbm_measured_tbps"]) * 1000 / REFERENCE_HBM_GBPS
        sources.append(("bandwidth_efficiency", f"no measurement found: the H200's ({ref['hbm_source']})"))
    sources.append(("launch_s", data["sources"].get(d["launch_source"].split(" ")[0], d["launch_source"])))
    floor = float(d.get("kernel_floor_us", 0.0)) * 1e-6
    sources.append(("kernel_floor_s", "the device file" if "kernel_floor_us" in d else
                    "not measured (0): harness calibrate --ops measures it"))
    return OpRates(gemm_tflops=tuple(sorted(gemm.items())), sms=int(d["sms"]), attention=table,
                   bandwidth_efficiency=efficiency, launch_s=float(d["launch_us"]) * 1e-6, kernel_floor_s=floor,
                   sources=tuple(sources))


def calibrated(rates: OpRates, entry: dict, peaks: dict[str, float], hbm_gbps: float) -> OpRates:
    """``rates`` with what a ``harness calibrate --ops`` entry measured on this device in their place: each dtype's
    best GEMM, the flash attention table (against the device's bf16 peak), the copy bandwidth over the datasheet's,
    the eager launch time and the kernel floor."""
    said = f"harness calibrate --ops on this device ({entry['fingerprint'].get('device_name')}, torch " \
           f"{entry['fingerprint'].get('torch')}, {entry.get('measured_at', '?')})"
    gemm = dict(rates.gemm_tflops)
    for dtype in {g["dtype"] for g in entry["gemms"]}:
        gemm[dtype] = max(g["tflops"] for g in entry["gemms"] if g["dtype"] == dtype)
    att = entry["attention"]
    seqs = tuple(sorted({a["seq"] for a in att}))
    dims = sorted({a["head_dim"] for a in att})

    def row(key: str, d: int) -> tuple[float, ...]:
        by_seq = {a["seq"]: a[key] for a in att if a["head_dim"] == d}
        return tuple(by_seq[q] for q in seqs)

    table = AttentionTable(peak=peaks["bf16"], seq=seqs, fwd=tuple((d, row("fwd_tflops", d)) for d in dims),
                           fwd_bwd=tuple((d, row("fwd_bwd_tflops", d)) for d in dims), source=said)
    return replace(rates, gemm_tflops=tuple(sorted(gemm.items())), attention=table,
                   bandwidth_efficiency=entry["bandwidth_gbps"] / hbm_gbps, launch_s=entry["launch_s"],
                   kernel_floor_s=entry["kernel_floor_s"],
                   sources=tuple((k, said) for k in ("gemm_tflops", "attention", "bandwidth_efficiency", "launch_s",
                                                      "kernel_floor_s")))


def source_text(name: str) -> str:
    """A source's full reference by its key in the data file's ``[sources]``."""
    return _data()["sources"][name]
