"""Each pipeline rank's measured tensor peak against the memory model's, per schedule, from a run's records.

The model's prediction is recomputed from each record's config with this checkout's model
(:func:`harness.model.memory.stage_peak_bytes`: what the schedule's own action order holds in flight), so a
change to the model is checked against a run measured before it (docs/pipeline-schedules.md).

    python scripts/pp_stage_memory.py results/reference/pp-schedules-cpu-w2
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

from tabulate import tabulate

from harness.model.inventory import coords
from harness.model.memory import stage_peak_bytes
from harness.model.shape import CellShape
from harness.records.reader import load_records
from harness.spec import CellConfig
from harness.units import GIB


def rows(run: Path) -> list[dict]:
    """One row per pipelined cell: its schedule, each pipeline rank's measured and predicted MiB, their error."""
    out = []
    for r in load_records(run):
        if r.get("status") != "ok" or not (r.get("metrics") or {}).get("peak_tensor_gib_per_rank"):
            continue
        cfg = CellConfig.from_dict(r["config"])
        shape = CellShape.of(cfg)
        if not shape.dims.pp_enabled:
            continue
        measured = r["metrics"]["peak_tensor_gib_per_rank"]
        predicted = [stage_peak_bytes(shape, k.pp) / GIB for k in coords(shape.dims)]
        out.append({"cell": r["cell_id"], "schedule": cfg.pp_schedule, "measured": measured, "predicted": predicted,
                    "error_pct": [100 * (p - m) / m for p, m in zip(predicted, measured)]})
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python scripts/pp_stage_memory.py RUN_DIR (a run with pipelined cells)", file=sys.stderr)
        return 2
    found = rows(Path(argv[0]))
    if not found:
        print(f"{argv[0]}: no ok pipelined cell with a per-rank tensor peak (a CPU run records it)", file=sys.stderr)
        return 2
    fmt = lambda xs, f: ", ".join(f.format(x) for x in xs)  # noqa: E731
    print(tabulate([[r["cell"], fmt([1024 * x for x in r["measured"]], "{:.2f}"),
                     fmt([1024 * x for x in r["predicted"]], "{:.2f}"), fmt(r["error_pct"], "{:+.0f}")]
                    for r in found], headers=["cell", "measured MiB per rank", "model MiB", "error %"], tablefmt="github"))
    errors: dict[str, list[float]] = defaultdict(list)
    for r in found:
        errors[r["schedule"]].extend(r["error_pct"])
    print()
    print(tabulate([[s, sum(map(abs, e)) / len(e), len(e)] for s, e in errors.items()],
                   headers=["schedule", "mean |error| %", "ranks"], tablefmt="github", floatfmt=".1f"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
