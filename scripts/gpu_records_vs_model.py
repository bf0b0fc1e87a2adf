"""The GPU records in results/gpu predicted by the op-by-op what-if on their device, against what they measured.

    .venv/bin/python scripts/gpu_records_vs_model.py [--runs results/gpu/runs] [--device h200]

One row per measured single-device cell (each run folder's records.jsonl or records.jsonl.gz): the cell's size,
precision, policy and batch, its measured step time (from its tokens/s) against the what-if's prediction for the same
cell on the preset, and the CUDA allocator's peak against the memory model's (where the record has the allocator's). fp8 cells are predicted as torchao's tensorwise recipe (the run's recipe is
in the table). Nothing here is tuned to these rows: docs/op-pricing.md says which figures came from which source.
"""

from __future__ import annotations

import argparse
import gzip
import json
from dataclasses import replace
from pathlib import Path

from tabulate import tabulate

from harness.calibration.ops import with_measured
from harness.model.hardware import Device, get_device
from harness.model.whatif import plan_at_scale
from workloads.sizes import get_size


def _records(runs: Path) -> list[tuple[str, dict]]:
    out = []
    for path in sorted(runs.glob("*/records.jsonl*")):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            out += [(path.parent.name, json.loads(line)) for line in f if line.strip()]
    return out


def rows(runs: Path, device: Device, efficiency: float | None = None) -> list[list]:
    out = []
    for run, r in _records(runs):
        c, m = r.get("config") or {}, r.get("metrics") or {}
        if r.get("status") != "ok" or not c.get("size") or c.get("strategy") != "single":
            continue
        arch = c.get("arch") or "gpt2"  # the first GPU runs predate the arch field: gpt2 was the only family
        size = get_size(c["size"], arch)
        seq = c.get("seq_len") or size.seq_len
        batch = c.get("global_batch") or 8
        tokens = m.get("tokens_per_s_per_device")
        if not tokens:
            continue
        measured_ms = 1e3 * batch * seq / tokens
        ac = c.get("ac") or "none"
        recipe = c.get("fp8_recipe") or "tensorwise"
        (pred,) = plan_at_scale(replace(size, seq_len=seq), device, 1, ["single"], precision=c["precision"],
                                global_batch=batch, seq_len=seq, recompute=ac, fp8_recipe=recipe,
                                efficiency=efficiency)
        recipe = f" {recipe}" if c["precision"] == "fp8" else ""
        peak = m.get("peak_mem_gib") if m.get("peak_mem_kind") == "cuda_allocated" else None
        model_peak = pred["peak_mem_gib_per_rank"]
        out.append([run, f"{arch} {c['size']}", f"{c['precision']}{recipe}", ac, f"{batch} x {seq}",
                    f"{measured_ms:,.1f}", f"{1e3 * pred['step_time_s']:,.1f}",
                    f"{100 * (pred['step_time_s'] * 1e3 / measured_ms - 1):+.1f}",
                    f"{peak:.2f}" if peak else "-", f"{model_peak:.2f}",
                    f"{100 * (model_peak / peak - 1):+.1f}" if peak else "-"])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=Path, default=Path("results/gpu/runs"))
    p.add_argument("--device", default="h200")
    p.add_argument("--calibration", type=Path, default=None,
                   help="a calibration file holding `harness calibrate --ops` of the device: price with what it "
                        "measured in place of harness/model/device_rates.toml's figures")
    p.add_argument("--efficiency", type=float, default=None,
                   help="price with one fraction of the datasheet peak (plan's --efficiency) instead of op by op")
    args = p.parse_args()
    device = get_device(args.device)
    if args.calibration is not None:
        device = with_measured(device, args.calibration)
        if device.measured_ops is None:
            raise SystemExit(f"{args.calibration}: no ops calibration of a {device.product}")
    table = rows(args.runs, device, args.efficiency)
    print(tabulate(table, headers=["run", "model", "precision", "ac", "batch", "measured step ms",
                                   "predicted step ms", "error %", "allocator peak GiB", "model peak GiB",
                                   "peak error %"], tablefmt="github", disable_numparse=True))
    errors = [abs(float(r[7])) for r in table]
    peaks = [abs(float(r[10])) for r in table if r[10] != "-"]
    print(f"\n{len(errors)} cells; step time mean |error| {sum(errors) / len(errors):.1f}%, max {max(errors):.1f}%; "
          f"peak memory over {len(peaks)} cells with the allocator's peak: mean |error| {sum(peaks) / len(peaks):.1f}%, "
          f"max {max(peaks):.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
