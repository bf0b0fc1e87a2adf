"""Context parallel against FSDP alone, per sequence length: a markdown table from run directories.

    .venv/bin/python scripts/cp_table.py RUN_DIR [RUN_DIR ...]

One row per ok multi-rank cell of the runs' ``records.jsonl``: its degrees, the tokens one rank holds per
step, the measured peak tensor bytes per rank against the model's prediction, the K/V bytes the comm
counter filed under context parallel against the formula recomputed here from the cell's config
(``2 x rows x seq x kv_dim / tp x 4`` bytes per fp32 all-gather, the same for the gradients'
reduce-scatter, per layer; a recomputed attention gathers again), and parity with one device.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.records.reader import latest_per_cell, load_records  # noqa: E402
from harness.text import degrees_label  # noqa: E402
from harness.units import MIB  # noqa: E402
from workloads.sizes import get_size  # noqa: E402

FP32 = 4


def kv_bytes_formula(config: dict, degrees: dict) -> int:
    """K/V bytes per step on one rank, from the cell's config alone (0 without context parallel)."""
    cp, tp = degrees.get("cp", 1), degrees.get("tp", 1)
    if cp == 1:
        return 0
    size = get_size(config["size"], config.get("arch"))
    dp = degrees.get("dp_replicate", 1) * degrees.get("dp_shard", 1)
    rows = config["global_batch"] // dp
    calls = (2 if config.get("ac", "none") != "none" else 1) + 1  # gathers (again when recomputed) + reduce-scatter
    return calls * 2 * rows * config["seq_len"] * size.kv_dim // tp * FP32 * size.n_layers


def rows(run_dirs: list[Path]) -> list[dict]:
    out = []
    for run in run_dirs:
        for r in latest_per_cell(load_records(run))[0]:
            c, m = r["config"], r.get("metrics") or {}
            if r.get("kind", "cell") != "cell" or r["status"] != "ok" or c["world_size"] == 1:
                continue
            degrees = c["degrees"] or {}
            cp = degrees.get("cp", 1)
            dp = degrees.get("dp_replicate", 1) * degrees.get("dp_shard", 1)
            predicted = (r.get("predicted") or {}).get("peak_tensor_gib")
            out.append({"seq": c["seq_len"], "degrees": degrees_label(degrees), "cp": cp,
                        "tokens_per_rank": c["global_batch"] // dp * c["seq_len"] // cp,
                        "peak": m["peak_tensor_gib"], "predicted": predicted,
                        "error_pct": None if predicted is None else 100 * (predicted - m["peak_tensor_gib"]) / m["peak_tensor_gib"],
                        "kv_measured": m.get("cp_comm_bytes_per_step", 0), "kv_formula": kv_bytes_formula(c, degrees),
                        "parity": (m.get("parity") or {}).get("ok")})
    return sorted(out, key=lambda x: (x["seq"], x["cp"]))


def table(found: list[dict]) -> str:
    lines = ["| seq | degrees | tokens/rank | peak GiB/rank | predicted GiB | error % | K/V MiB/step | formula MiB | "
             "parity |", "|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for x in found:
        err = "-" if x["error_pct"] is None else f"{x['error_pct']:+.1f}"
        pred = "-" if x["predicted"] is None else f"{x['predicted']:.3f}"
        lines.append(f"| {x['seq']} | {x['degrees']} | {x['tokens_per_rank']:,} | {x['peak']:.3f} | {pred} | {err} | "
                     f"{x['kv_measured'] / MIB:.2f} | {x['kv_formula'] / MIB:.2f} | "
                     f"{'ok' if x['parity'] else 'n/a' if x['parity'] is None else 'FAILED'} |")
    errors = [abs(x["error_pct"]) for x in found if x["error_pct"] is not None]
    if errors:
        lines.append(f"\npeak predicted vs measured: mean |error| {statistics.mean(errors):.1f}%, "
                     f"max {max(errors):.1f}% over {len(errors)} cells; K/V bytes equal to the formula in "
                     f"{sum(x['kv_measured'] == x['kv_formula'] for x in found)} of {len(found)} cells")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    args = ap.parse_args(argv)
    print(table(rows(args.runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
