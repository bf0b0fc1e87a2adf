"""What checkpoints cost each cell that saved them (``metrics.checkpoint``, :mod:`harness.run.checkpoint`): the
seconds a save blocks the step, an async save's write beside training, the cost per step at the interval, the bytes
each rank wrote against the model and optimizer state it holds, the write rate, and the restore check; and each cell that started from a save (a restore from another run, or a resume of its own)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tabulate import tabulate

from harness.report.frame import strategy_label
from harness.text import fmt_or
from harness.units import MIB


def checkpoint_rows(records: list[dict[str, Any]] | Any) -> list[list[Any]]:
    """One row per ok cell with ``metrics.checkpoint``."""
    rows = []
    for r in records:
        ck = (r.get("metrics") or {}).get("checkpoint")
        if r.get("kind", "cell") != "cell" or r.get("status") != "ok" or not ck or not ck["saves"]:
            continue
        restore = ck.get("restore") or {}
        written = ck.get("bytes_written_by_rank") or []
        predicted = ((r.get("predicted") or {}).get("checkpoint") or {}).get("save_s")
        write_s = ck.get("background_s_median") if ck["mode"].startswith("async") else ck.get("blocking_s_median")
        rows.append([r.get("cell_id"), strategy_label(r.get("config") or {}), f"{ck['mode']}, every {ck['every']}",
                     str(ck["saves"]), _ms(ck.get("blocking_s_median")), _ms(ck.get("background_s_median")),
                     fmt_or(ck.get("cost_per_step_pct"), ".1f"), ", ".join(f"{b / MIB:.2f}" for b in written),
                     fmt_or(ck.get("written_over_states"), ".3f"), fmt_or(ck.get("write_gib_per_s"), ".3f"),
                     _ms(predicted), fmt_or(write_s / predicted if write_s and predicted else None, ".1f"),
                     _ms(restore.get("load_s")), str(restore.get("steps_replayed", "-")),
                     fmt_or(restore.get("loss_max_abs_diff"), ".1e")])
    return rows


def _ms(seconds: float | None) -> str:
    return fmt_or(None if seconds is None else 1e3 * seconds, ".1f")


def start_rows(records: list[dict[str, Any]] | Any) -> list[list[Any]]:
    """One row per ok cell that started from a checkpoint (``metrics.checkpoint.start``, not ``fresh``)."""
    rows = []
    for r in records:
        start = ((r.get("metrics") or {}).get("checkpoint") or {}).get("start") or {}
        if r.get("kind", "cell") != "cell" or r.get("status") != "ok" or start.get("kind", "fresh") == "fresh":
            continue
        source = Path(start["source"]).parent.parent.name if start.get("source") else "its own save"
        rows.append([r.get("cell_id"), strategy_label(r.get("config") or {}), start["kind"], source,
                     str(start.get("from_step")), _ms(start.get("load_s")), str(start.get("steps_compared", "-")),
                     fmt_or(start.get("loss_max_abs_diff"), ".1e"), str(start.get("attempt", "-")),
                     fmt_or(start.get("restart_s"), ".2f"), fmt_or(start.get("lost_s"), ".2f"),
                     fmt_or(start.get("goodput"), ".3f")])
    return rows


def checkpoint_section(records: list[dict[str, Any]] | Any) -> str | None:
    records = list(records)
    parts = [part for part in (_cost_part(checkpoint_rows(records)), _start_part(start_rows(records))) if part]
    return "\n\n".join(parts) if parts else None


def _start_part(rows: list[list[Any]]) -> str | None:
    return _section("Starting from a checkpoint", rows, [
        "cell", "strategy", "start", "from", "after step", "load ms", "steps compared", "loss diff vs source",
        "attempt", "restart s", "lost s", "goodput"],
        "restore = the state another run saved (`--restore-from`, resharded by DCP into this layout): the cell trains "
        "on the steps after the save, and loss diff is the largest |global loss - the source's at the same step|; "
        "resume = the cell's own save, left by an attempt cut short (Slurm's SIGTERM, a requeue, a crash): restart = "
        "the new attempt's start-up and load before its first step, lost = the cut attempt's time after its save, "
        "goodput = every step's time once over all attempts' wall time.")


def _cost_part(rows: list[list[Any]]) -> str | None:
    return _section("Checkpoints: what a save costs", rows, [
        "cell", "strategy", "saves", "n", "blocking ms", "async write ms", "cost % per step", "MiB written per rank",
        "written / states", "write GiB/s", "predicted write ms", "measured / predicted", "restore ms",
        "steps replayed", "replayed loss diff"],
        "blocking = the median over saves of the slowest rank's wait (sync: the whole write; async: staging, and an "
        "earlier save still writing); async write = from a save's start to its write's end, beside training; cost % "
        "per step = blocking / interval / median step time; written / states = the bytes DCP wrote over the "
        "parameters and optimizer state of one replica (gradients are not saved; a little above 1: DCP's per-item "
        "headers); predicted write = the node's bytes at the write bandwidth the calibration measured on the run "
        "directory's filesystem (a 64 MiB file, fsync-ed: `harness calibrate --storage DIR`), against the measured "
        "write (sync: blocking; async: the background write); restore = load of the newest save with steps after "
        "it, those steps run again on the same batches: "
        "the largest |loss - the first run's loss| (0 when the state came back whole).")


def _section(title: str, rows: list[list[Any]], headers: list[str], legend: str) -> str | None:
    if not rows:
        return None
    return "\n".join([f"## {title}", "", tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True),
                      "", legend])
