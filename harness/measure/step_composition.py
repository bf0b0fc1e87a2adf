"""Where the time of a profiled step goes: an exclusive split of each ``ProfilerStep#N`` per rank.

Input: the events of one rank's torch.profiler trace (:func:`harness.measure.trace_analysis.load_trace`).
Every instant of a step window gets exactly one part, by the first rule that holds:

1. ``optimizer``: inside the optimizer phase (the ``harness:optimizer`` annotation the worker
   opens around ``optimizer.step()`` in profiled steps, or torch's own ``Optimizer.step#...`` /
   ``Optimizer.zero_grad#...``), whatever runs there, waiting included;
2. ``data``: inside the ``harness:data`` annotation (building and moving the batch);
3. ``comm_exposed``: a collective runs and no computation does (split by collective in
   ``comm_exposed_s_by_collective``);
4. ``attention``: computation inside an attention op (SDPA, flash / efficient / fused attention);
5. ``matmul``: computation inside a GEMM (``aten::mm``, ``addmm``, ``bmm``, ``linear``, ...;
   on GPU kernels named ``gemm``, ``xmma``, ``cutlass``, ``nvjet``, ...);
6. ``other_compute``: any other computation;
7. ``idle``: nothing of the above (the host waits, or launches nothing the profiler sees).

The parts sum to the step window exactly; ``comm_overlapped_s`` (a collective running while
computation runs, outside the optimizer and data phases) is hidden time and not one of them.
Computation and communication are :mod:`harness.measure.trace_analysis`'s classification:
on a CPU trace (``source: cpu-ops``) host ops, on a GPU trace (``gpu-kernels``) kernels, with
the phases taken from the GPU-side copies of the annotations (``gpu_user_annotation``).

The split follows Holistic Trace Analysis's temporal breakdown (``hta/analyzers/breakdown_analysis.py``:
compute / non-compute / idle per rank) with the phases and op classes a training step has.
``top_ops`` is the profiler's self-time table (``key_averages()`` sorted by self time), per step.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from harness.measure.trace_analysis import STEP_PREFIX, US_PER_S, is_comm_op_name, load_trace, merge_intervals

PARTS: tuple[str, ...] = ("matmul", "attention", "other_compute", "comm_exposed", "optimizer", "data", "idle")
"""The exclusive parts of a step, in the order tables and stacked bars show them."""
PHASE_PREFIX = "harness:"
OPTIMIZER_PREFIXES = (f"{PHASE_PREFIX}optimizer", "Optimizer.step#", "Optimizer.zero_grad#")
DATA_PREFIXES = (f"{PHASE_PREFIX}data",)
TOP_OPS = 10

_ATTENTION_RE = re.compile(r"scaled_dot_product|flash|efficient_attention|cudnn_attention|attention|fmha|sdpa")
_GEMM_CPU_RE = re.compile(
    r"^aten::(mm|addmm|bmm|baddbmm|addbmm|addmv|mv|matmul|linear|_addmm_activation|einsum|_scaled_mm)$"
)
_GEMM_GPU_RE = re.compile(r"gemm|xmma|cutlass|nvjet|cublas|wgmma|matmul")
_OPTIMIZER_GPU_RE = re.compile(r"multi_tensor_apply|adam", re.IGNORECASE)
CP_COLLECTIVE = "cp_kv"
"""Context parallel's K/V gathers and gradient reduce-scatters (``harness.parallel.cp`` annotates them so)."""
_COLLECTIVES: tuple[tuple[str, re.Pattern[str]], ...] = (
    (CP_COLLECTIVE, re.compile(CP_COLLECTIVE)),
    ("all_reduce", re.compile(r"all_?reduce")),
    ("all_gather", re.compile(r"all_?gather")),
    ("reduce_scatter", re.compile(r"reduce_?scatter")),
    ("all_to_all", re.compile(r"all_?to_?all")),
    ("broadcast", re.compile(r"broadcast")),
    ("barrier", re.compile(r"barrier")),
    ("send", re.compile(r"(?<![a-z])send")),
    ("recv", re.compile(r"(?<![a-z])recv")),
)


# ---- pure helpers --------------------------------------------------------------------------------


def collective_of(name: str) -> str:
    """The collective a comm op names (``c10d::allreduce_`` -> ``all_reduce``), else ``other``."""
    lowered = name.lower()
    for collective, pattern in _COLLECTIVES:
        if pattern.search(lowered):
            return collective
    return "other"


def op_kind(name: str, kernel: bool) -> str:
    """``comm`` (a collective), ``compute`` (an ``aten::`` op, or a kernel that is not NCCL's) or
    ``other`` (framework and autograd bookkeeping, waits, memcpy), by the op's name."""
    if is_comm_op_name(name) or "nccl" in name.lower():
        return "comm"
    return "compute" if kernel or name.startswith("aten::") else "other"


def _as_arrays(intervals: Iterable[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    merged = merge_intervals(intervals)
    return np.array([s for s, _ in merged], dtype=float), np.array([e for _, e in merged], dtype=float)


def _covers(arrays: tuple[np.ndarray, np.ndarray], points: np.ndarray) -> np.ndarray:
    """For each point, whether a merged interval ``[start, end)`` contains it."""
    starts, ends = arrays
    if len(starts) == 0:
        return np.zeros(len(points), dtype=bool)
    idx = np.searchsorted(starts, points, side="right") - 1
    return (idx >= 0) & (points < ends[np.clip(idx, 0, None)])


def split_window(window: tuple[float, float], sets: dict[str, list[tuple[float, float]]],
                 collectives: dict[str, list[tuple[float, float]]]) -> dict[str, Any]:
    """Exclusive split of ``window`` (microseconds) by the rules of the module doc.

    ``sets`` holds interval lists under ``optimizer``, ``data``, ``comm``, ``compute``,
    ``attention`` and ``matmul``; ``collectives`` the comm intervals per collective name (the
    exposed time is given to the first collective, by name, that covers it). Returns microseconds
    per part, ``comm_overlapped`` and ``comm_exposed_by_collective``.
    """
    lo, hi = window
    arrays = {key: _as_arrays(sets.get(key, [])) for key in ("optimizer", "data", "comm", "compute", "attention",
                                                              "matmul")}
    per_coll = {name: _as_arrays(ivs) for name, ivs in sorted(collectives.items())}
    edges = [lo, hi]
    for starts, ends in [*arrays.values(), *per_coll.values()]:
        edges.extend(starts[(starts > lo) & (starts < hi)])
        edges.extend(ends[(ends > lo) & (ends < hi)])
    bounds = np.unique(np.asarray(edges, dtype=float))
    mids, lengths = (bounds[:-1] + bounds[1:]) / 2.0, np.diff(bounds)
    cov = {key: _covers(arr, mids) for key, arr in arrays.items()}
    free = np.ones(len(mids), dtype=bool)
    out: dict[str, Any] = {}

    def take(part: str, mask: np.ndarray) -> np.ndarray:
        nonlocal free
        chosen = free & mask
        out[part] = float(lengths[chosen].sum())
        free = free & ~chosen
        return chosen

    take("optimizer", cov["optimizer"])
    take("data", cov["data"])
    exposed = take("comm_exposed", cov["comm"] & ~cov["compute"])
    out["comm_overlapped"] = float(lengths[free & cov["comm"] & cov["compute"]].sum())
    take("attention", cov["compute"] & cov["attention"])
    take("matmul", cov["compute"] & cov["matmul"])
    take("other_compute", cov["compute"])
    take("idle", np.ones(len(mids), dtype=bool))
    by_coll: dict[str, float] = {}
    left = exposed.copy()
    # context parallel's annotation wraps its c10d calls: it claims their time before their collective name does
    for name, arr in sorted(per_coll.items(), key=lambda kv: kv[0] != CP_COLLECTIVE):
        mine = left & _covers(arr, mids)
        if mine.any():
            by_coll[name] = float(lengths[mine].sum())
        left &= ~mine
    if left.any():
        by_coll["other"] = by_coll.get("other", 0.0) + float(lengths[left].sum())
    out["comm_exposed_by_collective"] = by_coll
    return out


# ---- one rank's trace ------------------------------------------------------------------------------


def _intervals(df: pd.DataFrame) -> list[tuple[float, float]]:
    return list(zip(df["ts_us"].tolist(), (df["ts_us"] + df["dur_us"]).tolist()))


def _named(df: pd.DataFrame, prefixes: tuple[str, ...]) -> pd.Series:
    return df["name"].str.startswith(prefixes)


def step_windows(df: pd.DataFrame, gpu: bool) -> dict[int, tuple[float, float]]:
    """``{N: (start_us, end_us)}`` of each ``ProfilerStep#N``: its GPU-timeline copy on a GPU
    trace when there is one, else the host range."""
    steps = df[df["name"].str.startswith(STEP_PREFIX)]
    device_steps = steps[steps["cat"] == "gpu_user_annotation"]
    use = device_steps if gpu and len(device_steps) else steps[steps["cat"] != "gpu_user_annotation"]
    out: dict[int, tuple[float, float]] = {}
    for name, ts, dur in zip(use["name"], use["ts_us"], use["dur_us"]):
        number = name[len(STEP_PREFIX):]
        if number.isdigit():
            out[int(number)] = (float(ts), float(ts + dur))
    return dict(sorted(out.items()))


def _phase_sets(df: pd.DataFrame, gpu: bool) -> dict[str, list[tuple[float, float]]]:
    comm, compute = df[df["kind"] == "comm"], df[df["kind"] == "compute"]
    if gpu:
        phases = df[df["cat"] == "gpu_user_annotation"]
        kernels = df[df["cat"] == "kernel"]
        optimizer = _intervals(phases[_named(phases, OPTIMIZER_PREFIXES)])
        optimizer += _intervals(kernels[kernels["name"].str.contains(_OPTIMIZER_GPU_RE)])
        data = _intervals(phases[_named(phases, DATA_PREFIXES)]) + _intervals(df[df["cat"] == "gpu_memcpy"])
        attention = compute[compute["name"].str.lower().str.contains(_ATTENTION_RE)]
        matmul = compute[compute["name"].str.lower().str.contains(_GEMM_GPU_RE)]
    else:
        host = df[df["cat"].isin(("cpu_op", "user_annotation"))]
        optimizer = _intervals(host[_named(host, OPTIMIZER_PREFIXES)])
        data = _intervals(host[_named(host, DATA_PREFIXES)])
        aten = df[(df["cat"] == "cpu_op") & df["name"].str.startswith("aten::")]
        attention = aten[aten["name"].str.lower().str.contains(_ATTENTION_RE)]
        matmul = aten[aten["name"].str.match(_GEMM_CPU_RE)]
    return {"optimizer": optimizer, "data": data, "comm": _intervals(comm), "compute": _intervals(compute),
            "attention": _intervals(attention), "matmul": _intervals(matmul)}


def _collective_sets(df: pd.DataFrame) -> dict[str, list[tuple[float, float]]]:
    comm = df[df["kind"] == "comm"]
    out: dict[str, list[tuple[float, float]]] = {}
    for name, ts, dur in zip(comm["name"], comm["ts_us"], comm["dur_us"]):
        out.setdefault(collective_of(name), []).append((float(ts), float(ts + dur)))
    return out


def split_steps(df: pd.DataFrame) -> dict[int, dict[str, Any]]:
    """:func:`split_window` of every ``ProfilerStep#N`` of one rank's events, in microseconds, by N."""
    gpu = bool((df["cat"] == "kernel").any())
    windows = step_windows(df, gpu)
    if not windows:
        raise ValueError("trace has no ProfilerStep# events; profile with a schedule and call prof.step()")
    sets, colls = _phase_sets(df, gpu), _collective_sets(df)
    return {n: {**split_window(window, sets, colls), "window": window} for n, window in windows.items()}


def compose_rank(df: pd.DataFrame) -> dict[str, Any]:
    """Mean over the profiled steps of one rank: ``step_s``, ``parts_s`` ({part: s}, summing to
    ``step_s``), ``comm_overlapped_s``, ``comm_exposed_s_by_collective``, ``steps``, ``source``."""
    splits = split_steps(df)
    n = len(splits)
    parts = dict.fromkeys(PARTS, 0.0)
    overlapped, step_us = 0.0, 0.0
    by_coll: dict[str, float] = {}
    for split in splits.values():
        step_us += split["window"][1] - split["window"][0]
        for part in PARTS:
            parts[part] += split[part]
        overlapped += split["comm_overlapped"]
        for name, us in split["comm_exposed_by_collective"].items():
            by_coll[name] = by_coll.get(name, 0.0) + us
    scale = 1.0 / (n * US_PER_S)
    return {
        "source": "gpu-kernels" if (df["cat"] == "kernel").any() else "cpu-ops",
        "steps": n,
        "step_s": step_us * scale,
        "parts_s": {part: us * scale for part, us in parts.items()},
        "comm_overlapped_s": overlapped * scale,
        "comm_exposed_s_by_collective": {k: v * scale for k, v in sorted(by_coll.items(), key=lambda kv: -kv[1])},
    }


def self_times(df: pd.DataFrame) -> pd.DataFrame:
    """Ops (CPU ``cpu_op`` and comm annotations, or GPU kernels) with ``self_us``: duration minus
    the time of the ops nested directly in them on the same thread (kernels have no nesting)."""
    if (df["cat"] == "kernel").any():
        kernels = df[df["cat"] == "kernel"]
        return kernels.assign(self_us=kernels["dur_us"])
    ops = df[(df["cat"] == "cpu_op") | ((df["cat"] == "user_annotation") & (df["kind"] == "comm"))]
    ops = ops.sort_values(["pid", "tid", "ts_us", "dur_us"], ascending=[True, True, True, False])
    self_us = ops["dur_us"].to_numpy(dtype=float).copy()
    position = {index: i for i, index in enumerate(ops.index)}
    for _, group in ops.groupby(["pid", "tid"], sort=False):
        stack: list[tuple[int, float]] = []  # (row position, end)
        for index, ts, dur in zip(group.index, group["ts_us"], group["dur_us"]):
            end = ts + dur
            while stack and ts >= stack[-1][1]:
                stack.pop()
            if stack:
                self_us[stack[-1][0]] -= dur
            stack.append((position[index], end))
    return ops.assign(self_us=np.clip(self_us, 0.0, None))


def top_ops(frames: dict[int, pd.DataFrame], step_s: float, k: int = TOP_OPS) -> list[dict[str, Any]]:
    """The ``k`` ops with the most self time, per step and per rank (mean over ranks):
    ``name``, ``kind`` (compute / comm / other), ``calls`` per step, ``self_s`` per step, ``share_pct``
    of the profiled step."""
    rows = []
    gpu = False
    for df in frames.values():
        gpu = bool((df["cat"] == "kernel").any())
        n_steps = max(1, len(step_windows(df, gpu)))
        ops = self_times(df[~df["name"].str.startswith(STEP_PREFIX)])
        grouped = ops.groupby("name").agg(calls=("self_us", "size"), self_us=("self_us", "sum"))
        rows.append(grouped.assign(calls=grouped["calls"] / n_steps, self_us=grouped["self_us"] / n_steps))
    table = pd.concat(rows).groupby(level=0).agg(calls=("calls", "sum"), self_us=("self_us", "sum"))
    table[["calls", "self_us"]] /= len(frames)
    table = table.sort_values("self_us", ascending=False).head(k)
    return [{"name": str(name), "kind": op_kind(str(name), gpu), "calls": float(row.calls),
             "self_s": float(row.self_us) / US_PER_S,
             "share_pct": 100.0 * float(row.self_us) / US_PER_S / step_s if step_s > 0 else None}
            for name, row in table.iterrows()]


def _mean_dicts(dicts: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for d in dicts for k in d})
    return {k: sum(d.get(k, 0.0) for d in dicts) / len(dicts) for k in keys}


def composition_from_frames(frames: dict[int, pd.DataFrame],
                            timer_s: dict[int, list[float]] | None = None) -> dict[str, Any]:
    """``metrics.trace.composition`` and ``metrics.trace.top_ops`` of a cell from its ranks' events.

    Cell values are means over ranks (``by_rank`` keeps each rank's); ``parts_pct`` are shares of
    the mean profiled step and sum to 100. ``timer_s`` (rank -> the harness's own step timer over
    the same recorded steps, data included) adds ``timer_step_s`` and ``timer_coverage_pct`` (the
    parts' sum as a share of the timed step), per rank and for the cell: the independent check that
    the composition accounts for the step as the harness measures it.
    """
    if not frames:
        raise ValueError("composition needs at least one rank trace, got none")
    ranks = {rank: compose_rank(df) for rank, df in sorted(frames.items())}
    sources = {r["source"] for r in ranks.values()}
    if len(sources) > 1:
        raise ValueError(f"rank traces mix sources {sorted(sources)}; profile every rank with the same activities")
    step_s = sum(r["step_s"] for r in ranks.values()) / len(ranks)
    parts_s = _mean_dicts([r["parts_s"] for r in ranks.values()])
    composition = {
        "source": sources.pop(),
        "basis": "profiled steps (ProfilerStep#N windows after the measured window), mean over ranks",
        "steps": min(r["steps"] for r in ranks.values()),
        "step_s": step_s,
        "parts_s": {part: parts_s[part] for part in PARTS},
        "parts_pct": {part: 100.0 * parts_s[part] / step_s if step_s > 0 else None for part in PARTS},
        "comm_overlapped_s": sum(r["comm_overlapped_s"] for r in ranks.values()) / len(ranks),
        "comm_exposed_s_by_collective": _mean_dicts([r["comm_exposed_s_by_collective"] for r in ranks.values()]),
        "by_rank": [{"rank": rank, **{k: v for k, v in r.items() if k != "source"}} for rank, r in ranks.items()],
    }
    if timer_s:
        for entry in composition["by_rank"]:
            timed = timer_s[entry["rank"]]
            entry["timer_step_s"] = sum(timed) / len(timed)
            entry["timer_coverage_pct"] = 100.0 * sum(entry["parts_s"].values()) / entry["timer_step_s"]
        composition["timer_step_s"] = sum(e["timer_step_s"] for e in composition["by_rank"]) / len(ranks)
        composition["timer_coverage_pct"] = 100.0 * sum(parts_s.values()) / composition["timer_step_s"]
    return {"composition": composition, "top_ops": top_ops(frames, step_s)}


def composition(paths_by_rank: dict[int, Path]) -> dict[str, Any]:
    """:func:`composition_from_frames` of trace files (``{rank: path}``)."""
    return composition_from_frames({rank: load_trace(path) for rank, path in sorted(paths_by_rank.items())})
