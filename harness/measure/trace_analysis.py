"""Compute / communication / overlap / idle analysis of torch.profiler traces, one per rank.

Input: Chrome/Perfetto trace JSON (``.json`` or ``.json.gz``) as written by
``prof.export_chrome_trace(path)`` or ``tensorboard_trace_handler(dir, worker_name=f"rank{r}",
use_gzip=True)``. Only complete events (``ph == "X"``, microsecond ``ts``/``dur``) are read.

Classification (column ``kind``: ``compute`` | ``comm`` | ``other``):

* GPU traces (any event with ``cat == "kernel"``): kernels only. A kernel whose name
  contains ``nccl`` (case-insensitive, e.g. ``ncclDevKernel_AllReduce_Sum_f32_RING_LL``)
  is ``comm``, every other kernel is ``compute``; memcpy/memset and all CPU-side events
  are ``other``.
* CPU traces (no kernels, e.g. gloo): host ops.
  ``comm`` = ``cpu_op``/``user_annotation`` events that name a collective: containing
  ``gloo`` (the gloo worker thread's ``gloo:all_reduce``), starting with ``c10d::`` or
  ``record_param_comms``, or naming a collective (all_reduce, all_gather,
  _allgather_base, reduce_scatter, broadcast, send, recv, all_to_all, barrier);
  ``aten::`` ops never count as comm (``aten::broadcast_tensors`` is compute).
  ``compute`` = ``aten::`` ops that are outermost on their thread among aten and comm ops:
  an aten op nested in another aten op is counted by its parent, and aten ops a
  collective runs internally (nested in a comm op) are communication, not compute.
  The heuristic sees host time only: on CPU, gloo does its work on host threads, so this is
  where both compute and communication happen.

Metrics per rank (``analyse_rank``), after Holistic Trace Analysis (HTA,
``hta/analyzers/communication_analysis.py``):

* ``compute_s`` = |U compute|, ``comm_s`` = |U comm| (U = interval union, so concurrent
  streams or threads are not double counted);
* ``overlap_pct`` = 100 * |U compute ∩ U comm| / |U comm| (computation during
  communication, over communication time);
* ``idle_pct`` = 100 * (window - |(U compute ∪ U comm) ∩ window|) / window, with window =
  span of ``ProfilerStep#N`` events when present, else the span of all events;
* ``step_time_s`` = duration of each host-side ``ProfilerStep#N`` (``gpu_user_annotation``
  copies on the GPU timeline are ignored).
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

Interval = tuple[float, float]
US_PER_S = 1e6
STEP_PREFIX = "ProfilerStep#"
_COLLECTIVE_RE = re.compile(
    r"all_?reduce|all_?gather|reduce_?scatter|broadcast|all_?to_?all|barrier|(?<![a-z])(?:send|recv)(?![a-z])"
)
_COMM_PREFIXES = ("c10d::", "record_param_comms")
_HOST_CATS = ("cpu_op", "user_annotation")
_RANK_FILE_RE = re.compile(r"rank(\d+)(?:\D.*)?\.json(?:\.gz)?$")


# ---- interval algebra (pure) -------------------------------------------------------------


def merge_intervals(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted union of ``[start, end)`` intervals; touching intervals merge, empty ones drop."""
    merged: list[Interval] = []
    for start, end in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def total_length(intervals: Iterable[Interval]) -> float:
    """Length of the union of ``intervals``."""
    return sum(end - start for start, end in merge_intervals(intervals))


def intersect_intervals(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """Intersection of the unions of ``a`` and ``b`` (two-pointer sweep over merged lists)."""
    left, right = merge_intervals(a), merge_intervals(b)
    out: list[Interval] = []
    i = j = 0
    while i < len(left) and j < len(right):
        start, end = max(left[i][0], right[j][0]), min(left[i][1], right[j][1])
        if end > start:
            out.append((start, end))
        if left[i][1] < right[j][1]:
            i += 1
        else:
            j += 1
    return out


def outermost_mask(starts: list[float], ends: list[float]) -> list[bool]:
    """True for intervals not contained in an earlier-starting one (one thread's call stack).

    Inputs must be sorted by (start, -end), so a parent precedes the children it contains.
    """
    mask: list[bool] = []
    outer_end = float("-inf")
    for start, end in zip(starts, ends):
        if start >= outer_end:
            mask.append(True)
            outer_end = end
        else:
            mask.append(False)
            outer_end = max(outer_end, end)
    return mask


# ---- loading and classification ------------------------------------------------------------


def _read_json(path: Path) -> Any:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return json.load(fh)


def is_comm_op_name(name: str) -> bool:
    """Whether a host op/annotation name is a collective (CPU heuristic, see module doc)."""
    lowered = name.lower()
    if lowered.startswith("aten::"):
        return False
    return "gloo" in lowered or lowered.startswith(_COMM_PREFIXES) or bool(_COLLECTIVE_RE.search(lowered))


def _classify_gpu(df: pd.DataFrame) -> pd.Series:
    kind = pd.Series("other", index=df.index)
    kernels = df["cat"] == "kernel"
    nccl = df["name"].str.contains("nccl", case=False, regex=False)
    kind[kernels & nccl] = "comm"
    kind[kernels & ~nccl] = "compute"
    return kind


def _classify_cpu(df: pd.DataFrame) -> pd.Series:
    kind = pd.Series("other", index=df.index)
    host = df["cat"].isin(_HOST_CATS) & ~df["name"].str.startswith(STEP_PREFIX)
    comm = host & df["name"].map(is_comm_op_name)
    aten = (df["cat"] == "cpu_op") & df["name"].str.startswith("aten::")
    kind[comm] = "comm"
    candidates = df[comm | aten].sort_values(["pid", "tid", "ts_us", "dur_us"], ascending=[True, True, True, False])
    for _, group in candidates.groupby(["pid", "tid"], sort=False):
        mask = outermost_mask(group["ts_us"].tolist(), (group["ts_us"] + group["dur_us"]).tolist())
        outer_aten = group.index[mask][~comm[group.index[mask]].to_numpy()]
        kind[outer_aten] = "compute"
    return kind


def events_frame(trace: dict[str, Any]) -> pd.DataFrame:
    """Complete events of a parsed trace dict, classified (see module doc)."""
    rows = [
        (ev.get("name", ""), ev.get("cat", ""), float(ev["ts"]), float(ev.get("dur", 0.0)),
         ev.get("pid"), ev.get("tid"))
        for ev in trace.get("traceEvents", [])
        if ev.get("ph") == "X" and "ts" in ev
    ]
    df = pd.DataFrame(rows, columns=["name", "cat", "ts_us", "dur_us", "pid", "tid"])
    # Traces mix int and str ids ("PyTorch Profiler", "stream 7"); one type keeps groupby sane.
    df["pid"] = df["pid"].astype(str)
    df["tid"] = df["tid"].astype(str)
    gpu = bool((df["cat"] == "kernel").any())
    df["kind"] = _classify_gpu(df) if gpu else _classify_cpu(df)
    df.attrs["source"] = "gpu-kernels" if gpu else "cpu-ops"
    return df


def find_rank_traces(directory: str | Path) -> dict[int, Path]:
    """``{rank: trace}`` for files named ``rank<r>...json[.gz]`` (``worker_name=f"rank{r}"``).

    With several traces per rank (a repeating schedule) the last by name (timestamp) wins.
    """
    found: dict[int, Path] = {}
    for path in sorted(Path(directory).iterdir()):
        match = _RANK_FILE_RE.match(path.name)
        if match:
            found[int(match.group(1))] = path
    return dict(sorted(found.items()))


def load_trace(path: str | Path) -> pd.DataFrame:
    """Complete events of one trace file: name, cat, ts_us, dur_us, pid, tid, kind."""
    path = Path(path)
    trace = _read_json(path)
    if not isinstance(trace, dict) or "traceEvents" not in trace:
        raise ValueError(f"{path} is not a Chrome trace: expected a JSON object with 'traceEvents'")
    df = events_frame(trace)
    df.attrs["path"] = str(path)
    return df


# ---- per-rank and cross-rank analysis ------------------------------------------------------


def _intervals(df: pd.DataFrame) -> list[Interval]:
    return list(zip(df["ts_us"], df["ts_us"] + df["dur_us"]))


def step_durations_s(df: pd.DataFrame) -> dict[int, float]:
    """Host-side ``ProfilerStep#N`` duration in seconds, keyed by N."""
    steps = df[df["name"].str.startswith(STEP_PREFIX) & (df["cat"] != "gpu_user_annotation")]
    out: dict[int, float] = {}
    for name, dur in zip(steps["name"], steps["dur_us"]):
        number = name[len(STEP_PREFIX):]
        if number.isdigit():
            out[int(number)] = max(out.get(int(number), 0.0), dur / US_PER_S)
    return dict(sorted(out.items()))


def _window(df: pd.DataFrame) -> Interval:
    steps = df[df["name"].str.startswith(STEP_PREFIX) & (df["cat"] != "gpu_user_annotation")]
    span = steps if len(steps) else df
    return float(span["ts_us"].min()), float((span["ts_us"] + span["dur_us"]).max())


def analyse_rank(df: pd.DataFrame) -> dict[str, Any]:
    """Compute, communication, overlap and idle of one rank's events (``load_trace`` output).

    Returns seconds for whole-trace totals (``compute_s``, ``comm_s``, ``overlap_s``,
    ``window_s``), percentages (``overlap_pct``: None without comm; ``idle_pct``), ``steps``
    and ``step_time_s`` ({step number: seconds}).
    """
    if df.empty:
        raise ValueError("trace has no complete ('ph': 'X') events; was the profiler window empty?")
    compute = merge_intervals(_intervals(df[df["kind"] == "compute"]))
    comm = merge_intervals(_intervals(df[df["kind"] == "comm"]))
    overlap_us = total_length(intersect_intervals(compute, comm))
    comm_us, compute_us = total_length(comm), total_length(compute)
    window = _window(df)
    window_us = window[1] - window[0]
    busy_us = total_length(intersect_intervals(compute + comm, [window]))
    steps = step_durations_s(df)
    return {
        "source": "gpu-kernels" if (df["cat"] == "kernel").any() else "cpu-ops",
        "compute_s": compute_us / US_PER_S,
        "comm_s": comm_us / US_PER_S,
        "overlap_s": overlap_us / US_PER_S,
        "overlap_pct": 100.0 * overlap_us / comm_us if comm_us > 0 else None,
        "idle_pct": 100.0 * (window_us - busy_us) / window_us if window_us > 0 else None,
        "window_s": window_us / US_PER_S,
        "steps": len(steps),
        "step_time_s": steps,
    }


def rank_skew_s(step_times: dict[int, dict[int, float]]) -> float | None:
    """Mean over steps present on every rank of (slowest - fastest rank's step time)."""
    common = set.intersection(*(set(s) for s in step_times.values())) if step_times else set()
    if not common:
        return None
    spreads = [max(s[n] for s in step_times.values()) - min(s[n] for s in step_times.values()) for n in common]
    return sum(spreads) / len(spreads)


def _mean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def analyse_traces(paths_by_rank: dict[int, Path]) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Per-rank table and the ``metrics.trace`` aggregate of a set of rank traces.

    Aggregate: ``compute_s``/``comm_s`` = mean over ranks of per-profiled-step seconds
    (rank total / its step count), ``overlap_pct``/``idle_pct`` = mean over ranks,
    ``rank_skew_s`` (see ``rank_skew_s``), ``ranks``, ``steps`` (steps common to all ranks),
    ``source``; ``reason`` explains a None.
    """
    if not paths_by_rank:
        raise ValueError("analyse_traces needs at least one rank trace, got none")
    return analyse_frames({rank: load_trace(path) for rank, path in sorted(paths_by_rank.items())})


def analyse_frames(frames_by_rank: dict[int, pd.DataFrame]) -> tuple[pd.DataFrame, dict[str, Any]]:
    """:func:`analyse_traces` of traces already loaded with :func:`load_trace` (read once, analysed twice
    by the worker: here and for the step composition)."""
    results = {rank: analyse_rank(df) for rank, df in sorted(frames_by_rank.items())}
    sources = {r["source"] for r in results.values()}
    if len(sources) > 1:
        raise ValueError(f"rank traces mix sources {sorted(sources)}; profile every rank with the same activities")
    rows = []
    for rank, res in results.items():
        per_step = res["steps"] or None
        rows.append({
            "rank": rank,
            **{k: v for k, v in res.items() if k != "step_time_s"},
            "compute_s_per_step": res["compute_s"] / per_step if per_step else None,
            "comm_s_per_step": res["comm_s"] / per_step if per_step else None,
        })
    table = pd.DataFrame(rows)
    no_steps = [rank for rank, res in results.items() if not res["steps"]]
    common_steps = set.intersection(*(set(r["step_time_s"]) for r in results.values()))
    aggregate: dict[str, Any] = {
        "compute_s": None if no_steps else _mean(table["compute_s_per_step"]),
        "comm_s": None if no_steps else _mean(table["comm_s_per_step"]),
        "overlap_pct": _mean(r["overlap_pct"] for r in results.values()),
        "idle_pct": _mean(r["idle_pct"] for r in results.values()),
        "rank_skew_s": rank_skew_s({rank: r["step_time_s"] for rank, r in results.items()}),
        "ranks": len(results),
        "steps": len(common_steps),
        "source": sources.pop(),
        "reason": None,
    }
    if no_steps:
        aggregate["reason"] = (
            f"rank(s) {no_steps} have no ProfilerStep# events; profile with a schedule and call prof.step()"
        )
    return table, aggregate
