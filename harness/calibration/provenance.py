"""Which calibration entries a prediction came from, and a note when a cell's measured step disowns them.

The planner attaches :func:`source` of every entry a prediction used to ``record.predicted``
(key ``calibration``): the store key, a label a person reads, when it was measured, its
repeats' spread, whether it was stored ``unsteady`` (:mod:`harness.calibration.steadiness`) and
the command that measures it again. After each cell, :func:`misprediction_note` holds the
measured median step against the predicted one and, beyond a factor, names those entries. It
reads only the record (and the store, when asked), so it costs microseconds per cell.
"""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path

from harness.calibration import store

MISPREDICTION_FACTOR = 3.0
"""Measured over predicted step time beyond ``[1/3, 3]`` names the calibration: far outside the
model's own error on the CPU references (docs/model-accuracy.md), a calibration that no longer
describes the machine."""
TIME_FORMAT = "%Y-%m-%dT%H:%M:%S%z"
"""How every calibration entry's ``measured_at`` is written."""


def _threads(fp: dict, key: str = "threads") -> str:
    return f" threads={fp[key]}" if fp.get(key) else ""


def label_of(kind: str, fp: dict) -> str:
    """A calibration entry as a person names it, from its fingerprint: ``workload tiny seq 128 fp32 cpu threads=2 x2``."""
    dk = fp.get("device_kind", "?")
    if kind == "workload":
        k = fp.get("concurrent", 1)
        return (f"workload {fp.get('size')} seq {fp.get('seq_len')} {fp.get('dtype')} {dk}{_threads(fp)}"
                f"{f' x{k}' if k and k > 1 else ''}{' compiled' if fp.get('compile') else ''}")
    if kind == "matmul":
        return f"matmul {dk} {fp.get('dtype')}{_threads(fp)}"
    if kind == "comm":
        nodes = fp.get("nnodes", 1)
        return (f"comm {dk} {fp.get('world_size')} ranks{f' x{nodes} nodes' if nodes > 1 else ''} "
                f"{fp.get('backend')}{_threads(fp, 'threads_per_rank')}")
    if kind == "storage":
        return f"storage {fp.get('mount')} ({fp.get('fstype')}) on {fp.get('host')}"
    if kind == "ops":
        return f"ops {dk} {fp.get('device_name')} torch {fp.get('torch')}"
    raise ValueError(f"unknown calibration kind {kind!r}; choose from {', '.join(store.KINDS)}")


def fix_command(kind: str, fp: dict) -> str:
    """The ``harness calibrate`` command that measures this entry again, whatever the store holds."""
    dk = fp.get("device_kind", "cpu")
    threads = f" --threads {fp['threads']}" if dk == "cpu" and fp.get("threads") else ""
    if kind == "workload":
        return (f"harness calibrate --force workload --device {dk} --no-comm --workloads {fp.get('size')} "
                f"--seq-len {fp.get('seq_len')} --dtype {fp.get('dtype')}{threads} --concurrent {fp.get('concurrent', 1)}"
                f"{' --compile' if fp.get('compile') else ''}")
    if kind == "matmul":
        return f"harness calibrate --force matmul --device {dk} --no-comm --dtype {fp.get('dtype')}{threads}"
    if kind == "comm":
        return f"harness calibrate --force comm --device {dk} --gpus {fp.get('world_size')}"
    if kind == "storage":
        return f"harness calibrate --force storage --storage RUN_DIR  (a folder on {fp.get('mount')})"
    if kind == "ops":
        return f"harness calibrate --force ops --device {dk} --no-comm --ops"
    raise ValueError(f"unknown calibration kind {kind!r}; choose from {', '.join(store.KINDS)}")


def source(kind: str, entry: dict) -> dict:
    """What a prediction records of one entry it used (``record.predicted.calibration[i]``)."""
    fp = entry.get("fingerprint") or {}
    spread = entry.get("spread") or {}
    return {"kind": kind, "key": store.key(kind, fp), "label": label_of(kind, fp),
            "measured_at": entry.get("measured_at"), "spread": spread.get("ratio"), "spread_probe": spread.get("probe"),
            "unsteady": bool(entry.get("unsteady")), "fix": fix_command(kind, fp)}


def spread_text(src: dict) -> str:
    if src.get("spread") is None:
        return "spread not recorded"
    return f"repeats spread {src['spread']:.3g}x" + (f" ({src['spread_probe']})" if src.get("spread_probe") else "")


def flag_notes(sources: list[dict]) -> list[str]:
    """One prediction note per unsteady entry among ``sources``: the prediction may be far off, and the fix."""
    return [f"calibration {s['label']} is unsteady ({spread_text(s)}): this prediction may be far off; "
            f"re-measure on a quiet machine: {s['fix']}" for s in sources if s.get("unsteady")]


def age_text(measured_at: str | None, now: float | None = None) -> str:
    """``3 h ago``, ``12 min ago``, ``2 days ago`` for a ``measured_at`` stamp (:data:`TIME_FORMAT`)."""
    if not measured_at:
        return "at an unknown time"
    try:
        then = datetime.strptime(measured_at, TIME_FORMAT).timestamp()
    except ValueError:
        return f"at {measured_at}"
    s = max(0.0, (time.time() if now is None else now) - then)
    for unit, size in (("day", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            n = round(s / size)
            return f"{n} {unit}{'s' if unit == 'day' and n > 1 else ''} ago"
    return f"{s:.0f} s ago"


def _measured_step_s(record: dict) -> float | None:
    """The cell's measured median step time (the key path :mod:`harness.report.model_error` reads)."""
    step = ((record.get("metrics") or {}).get("step_time_s") or {})
    return step.get("median") if isinstance(step, dict) else None


def _refreshed(src: dict, path: Path) -> str:
    """What the store holds now under the source's key, when it differs from what was predicted from."""
    now = store.by_key(src["key"], path)
    if now is None:
        return ", since removed from the store"
    if now.get("measured_at") != src.get("measured_at"):
        return f", since re-measured ({age_text(now.get('measured_at'))}{', unsteady' if now.get('unsteady') else ''})"
    return ""


def misprediction_note(record: dict, store_path: Path | None = None, factor: float = MISPREDICTION_FACTOR,
                       now: float | None = None) -> str | None:
    """One line naming the calibration entries behind a step-time prediction the cell missed by more
    than ``factor`` either way, their age and spread, and the command that re-measures them; None
    when measured / predicted is within ``[1/factor, factor]`` or either is missing.

    ``store_path``: also say whether the store has re-measured an entry since the prediction (one
    cached read of the file); None reads nothing but the record.
    """
    if not factor > 1:
        raise ValueError(f"factor ({factor}) must be > 1, e.g. {MISPREDICTION_FACTOR:g}: the note fires outside "
                         f"[1/factor, factor]")
    predicted = record.get("predicted") or {}
    pred, meas = predicted.get("step_time_s"), _measured_step_s(record)
    if not pred or not meas or pred <= 0 or meas <= 0 or 1 / factor <= meas / pred <= factor:
        return None
    how = f"{pred / meas:.3g}x faster" if meas < pred else f"{meas / pred:.3g}x slower"
    head = (f"{record.get('cell_id', 'cell')}: measured step {meas * 1e3:.4g} ms is {how} than predicted "
            f"({pred * 1e3:.4g} ms; the limit is {factor:g}x)")
    sources = predicted.get("calibration") or []
    if not sources:
        return f"{head}; the prediction names no calibration entry (planned before entries were recorded); " \
               f"re-measure with harness calibrate --force"
    named = ", ".join(f"{s['label']} (measured {age_text(s.get('measured_at'), now)}, {spread_text(s)}"
                      f"{', stored unsteady' if s.get('unsteady') else ''}"
                      f"{_refreshed(s, store_path) if store_path is not None else ''})" for s in sources)
    why = ("calibrated while the machine was busier than now?" if meas < pred else
           "the machine busier now than when calibrated, or a cost the model misses?")
    fixes = " ; ".join(dict.fromkeys(s["fix"] for s in sources))
    return f"{head}; predicted from {named}: {why} Re-measure: {fixes}"
