"""Records -> one DataFrame row per cell: the numbers every table and plot of the report reads.

Pure: returns DataFrames, never prints or plots. Absent metrics are NaN, so a record from any
version of the schema (``schema_version`` 1) loads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from harness.measure.intervals import median_spread
from harness.parallel.presets import SP_NAMED
from harness.records.reader import latest_per_cell
from harness.records.record import pulled_levers
from harness.units import GIB, MIB
from workloads.sizes import size_label

TIME_USE = {
    "time_startup_s": ("launch", "imports", "process_group", "build"),
    "time_warmup_s": ("warmup",),
    "time_measured_s": ("measured",),
    "time_untimed_s": ("extra_steps", "profile", "result"),
    "time_teardown_s": ("teardown",),
    "time_probe_s": ("machine_probe",),
    "time_job_s": ("job",),
}
"""Where a cell's time went (``metrics.overhead.parts_s``, :func:`harness.run.formulas.overhead_parts`),
in the groups the summary names; ``time_job_s`` is a cell without a result (its whole job)."""


FRAME_COLUMNS = [
    "cell_id", "size", "strategy", "precision", "levers", "world_size", "global_batch", "scaling",
    "lr_rule", "status", "error", "tokens_per_s", "tokens_per_s_per_device",
    "step_time_median_s", "step_time_p10_s", "step_time_p90_s", "step_time_cv", "rounds",
    "round_ci_low_s", "round_ci_high_s", "round_spread_pct", "tflops_per_device", "mfu_pct", "mfu_calibrated_pct",
    "peak_mem_gib", "model_state_mib_per_rank", "comm_mib_per_step", "overlap_pct",
    "parity_max_rel_diff", "parity_ok", "parity_reason", "final_loss", "target_loss", "steps_to_target",
    "time_to_target_s", "gns_b_simple", "scaling_efficiency", "device_kind", "device_name", "unstable_reason",
    "mfu_reason", *TIME_USE, "attempts",
]


def get(d: dict[str, Any] | None, *keys: str) -> Any:
    """Nested lookup that returns None when any level is missing or null."""
    for key in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(key)
    return d


def num(value: Any) -> float:
    """Float of a metric; missing, null or non-numeric -> NaN."""
    if isinstance(value, bool) or value is None:
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _cell_row(r: dict[str, Any]) -> dict[str, Any]:
    """Flatten one cell record into a frame row; absent metrics become NaN."""
    cfg, m = r.get("config") or {}, r.get("metrics") or {}
    world_size = num(cfg.get("world_size"))
    tokens_per_s = num(m.get("tokens_per_s"))
    if math.isnan(tokens_per_s):
        tokens_per_s = num(m.get("tokens_per_s_per_device")) * world_size
    return {
        "cell_id": r.get("cell_id"), "size": size_label(cfg), "strategy": strategy_label(cfg),
        "precision": precision_label(cfg), "levers": levers_label(cfg), "world_size": world_size,
        "global_batch": num(cfg.get("global_batch")), "scaling": cfg.get("scaling"),
        "lr_rule": cfg.get("lr_rule"), "status": r.get("status"), "error": r.get("error"),
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": num(m.get("tokens_per_s_per_device")),
        "step_time_median_s": num(get(m, "step_time_s", "median")),
        "step_time_p10_s": num(get(m, "step_time_s", "p10")),
        "step_time_p90_s": num(get(m, "step_time_s", "p90")),
        "step_time_cv": num(get(m, "step_time_s", "cv")),
        **_rounds(m.get("rounds")),
        "tflops_per_device": num(m.get("tflops_per_device")),
        "mfu_pct": num(m.get("mfu_pct")),
        "mfu_calibrated_pct": num(m.get("mfu_calibrated_pct")),
        "peak_mem_gib": num(m.get("peak_mem_gib")),
        "model_state_mib_per_rank": num(m.get("model_state_bytes_per_rank")) / MIB,
        "comm_mib_per_step": num(m.get("comm_bytes_per_step")) / MIB,
        "overlap_pct": num(get(m, "trace", "overlap_pct")),
        "parity_max_rel_diff": num(m.get("parity_max_rel_diff")),
        "parity_ok": get(m, "parity", "ok"), "parity_reason": get(m, "parity", "reason"),
        "final_loss": num(m.get("final_loss")), "target_loss": num(m.get("target_loss")),
        "steps_to_target": num(m.get("steps_to_target")),
        "time_to_target_s": num(m.get("time_to_target_s")),
        "gns_b_simple": num(get(m, "gns", "b_simple")), "scaling_efficiency": math.nan,
        "device_kind": cfg.get("device_kind"), "device_name": get(r, "env", "device_name"),
        "unstable_reason": m.get("unstable_reason"), "mfu_reason": m.get("mfu_reason"),
        **_time_use(get(m, "overhead", "parts_s") or {}),
    }


def _rounds(rounds: dict[str, Any] | None) -> dict[str, float]:
    """``--rounds``: how many, and the interval of the median round (NaN without rounds), recomputed from
    the rounds' medians (``metrics.rounds.medians_s``) by :func:`harness.measure.intervals.median_spread`."""
    medians = [float(x) for x in (rounds or {}).get("medians_s") or [] if x is not None]
    if not medians:
        return {"rounds": math.nan, "round_ci_low_s": math.nan, "round_ci_high_s": math.nan,
                "round_spread_pct": math.nan}
    spread = median_spread(medians)
    return {"rounds": float(len(medians)), "round_ci_low_s": spread["low"], "round_ci_high_s": spread["high"],
            "round_spread_pct": spread["spread_pct"]}


def _time_use(parts: dict[str, Any]) -> dict[str, float]:
    if not parts:
        return dict.fromkeys(TIME_USE, math.nan)
    return {col: sum(num(parts.get(p)) for p in names if p in parts) for col, names in TIME_USE.items()}


def strategy_label(cfg: dict[str, Any]) -> str | None:
    """The strategy, with ``(no sp)`` for a layout with tensor parallel but not sequence parallel, where the
    preset's name does not say so (its resolved degrees have tp > 1 and no ``sp``), and a pipeline's schedule
    where it is not 1F1B, the presets' (``pp (zb)``); a cell that checkpoints says how (``fsdp (ckpt async)``)."""
    strategy, degrees = cfg.get("strategy"), cfg.get("degrees") or {}
    tags = [] if strategy in SP_NAMED or degrees.get("tp", 1) < 2 or degrees.get("sp") else ["no sp"]
    if degrees.get("pp", 1) > 1 and cfg.get("pp_schedule", "1f1b") != "1f1b":
        tags.append(cfg["pp_schedule"])
    if cfg.get("checkpoint", "off") != "off":
        tags.append(f"ckpt {cfg['checkpoint']}")
    return f"{strategy} ({', '.join(tags)})" if tags else strategy


def precision_label(cfg: dict[str, Any]) -> str | None:
    """The cell's precision, ``fp8 (emulated)`` where torchao emulated it (a numerics check: its speed is not fp8's)."""
    return "fp8 (emulated)" if cfg.get("fp8_emulate") else cfg.get("precision")


def levers_label(cfg: dict[str, Any]) -> str:
    """The levers a cell pulls, as its id spells them (``compile+ac-full``), or ``eager``."""
    pulled = pulled_levers(cfg)
    parts = (["compile"] if pulled.get("compile") else []) + \
        ([f"ac-{pulled['ac']}"] if "ac" in pulled else []) + ([pulled["optimizer"]] if "optimizer" in pulled else [])
    return "+".join(parts) or "eager"


def _scaling_key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["size"], row["precision"], row["levers"], row["scaling"], row["lr_rule"])


def _fill_scaling_efficiency(rows: list[dict[str, Any]]) -> None:
    """scaling efficiency = tokens/s(N) / (N x tokens/s(1)).

    The 1-device reference is an ok world_size 1 cell with the same size, precision, levers,
    scaling and LR rule: the same strategy if measured, else the fastest such cell.
    """
    singles = [r for r in rows if r["status"] == "ok" and r["world_size"] == 1
               and np.isfinite(r["tokens_per_s"])]
    for row in rows:
        if row["status"] != "ok" or not np.isfinite(row["tokens_per_s"]):
            continue
        refs = [s for s in singles if _scaling_key(s) == _scaling_key(row)]
        same = [s for s in refs if s["strategy"] == row["strategy"]]
        pool = same or refs
        if pool and (ideal := row["world_size"] * max(s["tokens_per_s"] for s in pool)) > 0:
            row["scaling_efficiency"] = row["tokens_per_s"] / ideal  # a zero rate (a damaged record): none


def cells_frame(records: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """One row per cell, its latest record (:func:`~harness.records.reader.latest_per_cell`);
    columns :data:`FRAME_COLUMNS`, ``attempts`` counting the cell's records."""
    latest, attempts = latest_per_cell(list(records))
    rows = [{**_cell_row(r), "attempts": attempts[r.get("cell_id")]} for r in latest if r.get("kind", "cell") == "cell"]
    _fill_scaling_efficiency(rows)
    return pd.DataFrame(rows, columns=FRAME_COLUMNS)


def text(value: Any) -> str:
    """A string field of the frame; None and NaN (pandas fills both) become ``""``."""
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)


def device_title(df: pd.DataFrame) -> str:
    """Device kinds and names that produced the cells, e.g. ``cuda (NVIDIA H200)``."""
    names = []
    for kind, name in df[["device_kind", "device_name"]].itertuples(index=False):
        label = text(kind) or "unknown"
        label += f" ({text(name)})" if text(name) else ""
        if label not in names:
            names.append(label)
    return ", ".join(names) if names else "unknown"


MEMORY_RANK_COLUMNS = ["cell_id", "rank", "peak_mem_gib", "kind", "capacity_gib", "size", "basis", "tensor_gib",
                       "model_state_gib", "predicted_tensor_gib"]


def memory_rank_frame(records: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """One row per (ok cell, rank): ``peak_mem_gib`` of the rank, ``kind`` (cuda_allocated / rss),
    ``capacity_gib`` (device memory, from ``mem_capacity_pct``; NaN on CPU, where ranks share host RAM), and what
    memory_per_rank.png draws of the rank (:func:`harness.report.figures.memory_figure`):

    ``size`` (each its own panel and scale); ``basis``: ``tensor`` (CPU with ``metrics.peak_tensor_gib_per_rank``),
    ``tensor_max`` (CPU with only the max over ranks, ``metrics.peak_tensor_gib``) or ``peak`` (GPU, or a record
    from before tensor bytes: the recorded ``peak_mem_gib`` of its ``kind``); ``tensor_gib``: the rank's live
    tensor peak (the cell's max under ``tensor_max``); ``model_state_gib``: ``metrics.model_state_bytes_by_rank``
    (exact); ``predicted_tensor_gib``: ``predicted.peak_tensor_gib``, the model's max over ranks. The tensor
    columns are NaN under ``peak``."""
    rows = []
    for r in latest_per_cell(list(records))[0]:
        m, cfg = r.get("metrics") or {}, r.get("config") or {}
        per_rank = m.get("peak_mem_gib_per_rank")
        if r.get("kind", "cell") != "cell" or r.get("status") != "ok" or not per_rank:
            continue
        pct, peak = num(m.get("mem_capacity_pct")), num(m.get("peak_mem_gib"))
        capacity = peak / pct * 100.0 if pct > 0 else math.nan
        basis, tensors, states = _memory_basis(cfg, m, len(per_rank))
        predicted = num((r.get("predicted") or {}).get("peak_tensor_gib")) if basis != "peak" else math.nan
        rows += [{"cell_id": r.get("cell_id"), "rank": rank, "peak_mem_gib": num(v), "kind": m.get("peak_mem_kind"),
                  "capacity_gib": capacity, "size": cfg.get("size"), "basis": basis,
                  "tensor_gib": num(tensors[rank]) if basis != "peak" else math.nan,
                  "model_state_gib": num(states[rank]) / GIB if basis != "peak" else math.nan,
                  "predicted_tensor_gib": predicted} for rank, v in enumerate(per_rank)]
    return pd.DataFrame(rows, columns=MEMORY_RANK_COLUMNS)


def _memory_basis(cfg: dict[str, Any], m: dict[str, Any], n: int) -> tuple[str, list, list]:
    """What a cell's per-rank memory is drawn from: ``(basis, tensor GiB per rank, model-state bytes per rank)``."""
    states = m.get("model_state_bytes_by_rank") or []
    tensors = m.get("peak_tensor_gib_per_rank") or []
    if cfg.get("device_kind") == "cuda" or m.get("peak_mem_kind") == "cuda_allocated" or len(states) != n:
        return "peak", [], []
    if len(tensors) == n:
        return "tensor", tensors, states
    if math.isfinite(num(m.get("peak_tensor_gib"))):
        return "tensor_max", [m["peak_tensor_gib"]] * n, states
    return "peak", [], []
