"""``harness diff A B``: every metric of every cell of two runs side by side, and where the time went.

Cells pair by fingerprint (the gate's pairing, :func:`harness.compare.verdicts._index_cells`), else by cell id
with the fingerprint fields that differ named; cells on one side only are listed, never dropped.
Throughput carries the gate's statistics (ratio of medians, its bootstrap CI, Mann-Whitney U:
:mod:`harness.compare.stats`). When both sides were profiled, the step composition
(``metrics.trace.composition``, :mod:`harness.measure.step_composition`) is differenced part by
part and said in words: ``B: +52.1 ms per step (measured median), of which +49.8 ms optimizer,
+10.2 ms exposed all_reduce``.

Pure: :func:`diff_runs` returns a :class:`RunDiff`; :func:`diff_markdown` formats it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from tabulate import tabulate

from harness.compare.stats import CompareOptions, PairResult, judge_samples
from harness.compare.verdicts import _index_cells, fingerprint_diff, throughput_samples
from harness.measure.step_composition import PARTS
from harness.parallel.schedules import STAGE_ACTIONS
from harness.text import fmt_or
from harness.units import MIB

PART_LABELS = {
    "matmul": "matmul", "attention": "attention", "other_compute": "other compute",
    "comm_exposed": "exposed comm", "optimizer": "optimizer", "data": "data", "idle": "idle",
}
MIN_PART_DELTA_S = 1e-3
"""Parts whose per-step change is below this (and below 5% of the step's change) are not named."""


@dataclass
class CellDiff:
    """One paired cell: both records, the throughput verdict and the composition deltas."""

    cell_id: str
    a: dict[str, Any]
    b: dict[str, Any]
    throughput: PairResult
    note: str = ""
    """Why the pair is by cell id only (fingerprint fields that differ), or ''."""
    parts_delta_s: dict[str, float] = field(default_factory=dict)
    """B - A seconds per profiled step per part (empty unless both sides were profiled)."""
    exposed_delta_s: dict[str, float] = field(default_factory=dict)
    """B - A exposed communication seconds per step, by collective."""
    sentence: str = ""


@dataclass
class RunDiff:
    cells: list[CellDiff]
    only_a: list[str]
    only_b: list[str]


def _metric(record: dict[str, Any], *keys: str) -> float:
    value: Any = record.get("metrics") or {}
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    if value is None or isinstance(value, bool):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def composition(record: dict[str, Any]) -> dict[str, Any] | None:
    """The record's measured step composition, or None when the cell was not profiled."""
    comp = ((record.get("metrics") or {}).get("trace") or {}).get("composition")
    return comp if isinstance(comp, dict) and comp.get("parts_s") else None


def _deltas(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: float(b.get(k, 0.0)) - float(a.get(k, 0.0)) for k in sorted(set(a) | set(b))}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:+.1f} ms"


def attribution(step_delta_s: float, profiled_delta_s: float, parts: dict[str, float],
                exposed: dict[str, float]) -> str:
    """The composition change in words, largest changes first.

    Exposed communication is named by collective (``+10.2 ms exposed all_reduce``); a part is
    named when its change is at least 1 ms or 5% of the profiled step's change.
    """
    floor = max(MIN_PART_DELTA_S, 0.05 * abs(profiled_delta_s))
    named: list[tuple[float, str]] = []
    for part, delta in parts.items():
        if part == "comm_exposed":
            for coll, d in exposed.items():
                if abs(d) >= floor:
                    named.append((d, f"{_ms(d)} exposed {coll}"))
        elif abs(delta) >= floor:
            named.append((delta, f"{_ms(delta)} {PART_LABELS.get(part, part)}"))
    named.sort(key=lambda t: -abs(t[0]))
    head = f"B: {_ms(step_delta_s)} per step (measured median; profiled steps {_ms(profiled_delta_s)})"
    if not named:
        return head + ", no part changed by 1 ms or more"
    return head + ", of which " + ", ".join(text for _, text in named)


def _cell_diff(cell_id: str, a: dict[str, Any], b: dict[str, Any], opts: CompareOptions, note: str) -> CellDiff:
    if a.get("status") != "ok" or b.get("status") != "ok":
        result = PairResult("n/a", f"status A {a.get('status')}, B {b.get('status')}")
    else:
        result = judge_samples(throughput_samples(a), throughput_samples(b), opts)
    cell = CellDiff(cell_id, a, b, result, note)
    ca, cb = composition(a), composition(b)
    if ca and cb:
        cell.parts_delta_s = _deltas(ca["parts_s"], cb["parts_s"])
        cell.exposed_delta_s = _deltas(ca.get("comm_exposed_s_by_collective") or {},
                                       cb.get("comm_exposed_s_by_collective") or {})
        step_delta = _metric(b, "step_time_s", "median") - _metric(a, "step_time_s", "median")
        cell.sentence = attribution(step_delta, cb["step_s"] - ca["step_s"], cell.parts_delta_s, cell.exposed_delta_s)
    elif ca or cb:
        cell.sentence = f"step composition only in {'A' if ca else 'B'}: profile both runs (--profile) to compare"
    return cell


def diff_runs(a_records: Sequence[dict[str, Any]], b_records: Sequence[dict[str, Any]],
              opts: CompareOptions | None = None, a_label: str = "A", b_label: str = "B") -> RunDiff:
    """Pair the cells of two runs and difference each pair (module doc)."""
    opts = opts or CompareOptions()
    a_cells, b_cells = _index_cells(a_records, a_label), _index_cells(b_records, b_label)
    b_left = dict(b_cells)
    b_by_id = {r.get("cell_id"): fp for fp, r in b_cells.items()}
    cells, only_a = [], []
    for fp, a in a_cells.items():
        cell_id = str(a.get("cell_id"))
        if fp in b_left:
            cells.append(_cell_diff(cell_id, a, b_left.pop(fp), opts, ""))
        elif cell_id in b_by_id and b_by_id[cell_id] in b_left:
            b = b_left.pop(b_by_id[cell_id])
            note = fingerprint_diff(a.get("fingerprint_fields") or {}, b.get("fingerprint_fields") or {})
            cells.append(_cell_diff(cell_id, a, b, opts, f"paired by cell id: {note}"))
        else:
            only_a.append(cell_id)
    return RunDiff(cells, only_a, [str(r.get("cell_id")) for r in b_left.values()])


def step_spread_pct(diff: RunDiff) -> tuple[int, float, float, float] | None:
    """Over the cells ok on both sides: ``(n, mean, median, max)`` of ``100 |B/A - 1|`` of the median
    step: how far apart the two runs are as a whole (two runs of the same code: the machine's
    run-to-run spread). None when no cell is ok on both sides."""
    d = [100 * abs(_metric(c.b, "step_time_s", "median") / _metric(c.a, "step_time_s", "median") - 1)
         for c in diff.cells if c.a.get("status") == "ok" and c.b.get("status") == "ok"]
    d = [x for x in d if np.isfinite(x)]
    if not d:
        return None
    return len(d), float(np.mean(d)), float(np.median(d)), float(np.max(d))


def round_spread_pct(diff: RunDiff) -> list[tuple[int, int, float, float]]:
    """Both sides measured with ``--rounds``: per round k, ``(k, n, mean, median)`` of ``100 |B_k/A_k - 1|``
    over the cells ok on both sides, each side's round k alone: what two sweeps without rounds, each
    measuring every cell once, would have differed by (rounds at the same position of their sweeps)."""
    pairs = [((c.a["metrics"].get("rounds") or {}).get("medians_s") or [],
              (c.b["metrics"].get("rounds") or {}).get("medians_s") or [])
             for c in diff.cells if c.a.get("status") == "ok" and c.b.get("status") == "ok"]
    n_rounds = min((min(len(a), len(b)) for a, b in pairs), default=0)
    out = []
    for k in range(n_rounds):
        d = [100 * abs(b[k] / a[k] - 1) for a, b in pairs if a[k] and b[k]]
        if d:
            out.append((k + 1, len(d), float(np.mean(d)), float(np.median(d))))
    return out


# ---- presentation ------------------------------------------------------------------------------


def _pair(a: float, b: float, fmt: str) -> str:
    return f"{fmt_or(a, fmt)} -> {fmt_or(b, fmt)}"


def _mfu(record: dict[str, Any]) -> tuple[float, str]:
    mfu = _metric(record, "mfu_pct")
    return (mfu, "") if not math.isnan(mfu) else (_metric(record, "mfu_calibrated_pct"), " (cal.)")


def _parity(record: dict[str, Any]) -> str:
    parity = (record.get("metrics") or {}).get("parity") or {}
    rel = _metric(record, "parity_max_rel_diff")
    if not parity and math.isnan(rel):
        return "n/a"
    ok = parity.get("ok")
    if ok is None:
        return "n/a"
    return f"{'ok' if ok else 'FAIL'} {fmt_or(rel, '.1e')}"


def cells_table(diff: RunDiff) -> pd.DataFrame:
    """One row per paired cell, every headline metric as ``A -> B``."""
    rows = []
    for c in diff.cells:
        a, b, t = c.a, c.b, c.throughput
        tok_a, tok_b = _metric(a, "tokens_per_s_per_device"), _metric(b, "tokens_per_s_per_device")
        mfu_a, tag = _mfu(a)
        mfu_b, _ = _mfu(b)
        rows.append({
            "cell": c.cell_id,
            "tok/s/dev A -> B": _pair(tok_a, tok_b, ",.0f"),
            "B/A (95% CI)": "n/a" if math.isnan(t.ratio) else f"{t.ratio:.3f} [{t.ci_low:.3f}, {t.ci_high:.3f}]",
            "MWU p": fmt_or(t.p_value, ".2g"),
            "verdict": t.verdict,
            "step ms A -> B": _pair(_metric(a, "step_time_s", "median") * 1e3, _metric(b, "step_time_s", "median") * 1e3,
                                    ".1f"),
            f"MFU % (PaLM){tag}": _pair(mfu_a, mfu_b, ".1f"),
            "peak GiB": _pair(_metric(a, "peak_mem_gib"), _metric(b, "peak_mem_gib"), ".2f"),
            "comm MiB/step": _pair(_metric(a, "comm_bytes_per_step") / MIB, _metric(b, "comm_bytes_per_step") / MIB,
                                   ".1f"),
            "parity": f"{_parity(a)} -> {_parity(b)}",
        })
    return pd.DataFrame(rows)


def composition_table(cell: CellDiff) -> pd.DataFrame:
    """Per part: A and B ms per profiled step, the change, and each side's share."""
    ca, cb = composition(cell.a) or {}, composition(cell.b) or {}
    rows = []
    for part in sorted(ca.get("parts_s", {}), key=lambda p: PARTS.index(p) if p in PARTS else len(PARTS)):
        sa, sb = ca["parts_s"][part], cb["parts_s"].get(part, 0.0)
        rows.append({"part": PART_LABELS.get(part, part), "A ms": sa * 1e3, "B ms": sb * 1e3,
                     "B - A ms": (sb - sa) * 1e3, "A %": ca["parts_pct"][part], "B %": cb["parts_pct"].get(part)})
    for coll, d in cell.exposed_delta_s.items():
        sa = (ca.get("comm_exposed_s_by_collective") or {}).get(coll, 0.0)
        sb = (cb.get("comm_exposed_s_by_collective") or {}).get(coll, 0.0)
        rows.append({"part": f"  of which exposed {coll}", "A ms": sa * 1e3, "B ms": sb * 1e3, "B - A ms": d * 1e3,
                     "A %": np.nan, "B %": np.nan})
    oa, ob = ca.get("comm_overlapped_s", math.nan), cb.get("comm_overlapped_s", math.nan)
    rows.append({"part": "overlapped comm (hidden, not a part)", "A ms": oa * 1e3, "B ms": ob * 1e3,
                 "B - A ms": (ob - oa) * 1e3, "A %": np.nan, "B %": np.nan})
    rows.append({"part": "profiled step", "A ms": ca.get("step_s", math.nan) * 1e3,
                 "B ms": cb.get("step_s", math.nan) * 1e3,
                 "B - A ms": (cb.get("step_s", math.nan) - ca.get("step_s", math.nan)) * 1e3, "A %": 100.0,
                 "B %": 100.0})
    return pd.DataFrame(rows)


def stage_actions_table(cell: CellDiff) -> pd.DataFrame | None:
    """Each pipeline rank's measured step split (``metrics.pipeline.actions_ms_by_rank``) on both sides, ``A -> B``
    ms per part, with the wait's change in %: where a schedule's or a change's bubble moved, rank by rank. None
    unless both sides measured it (CPU pipeline ranks)."""
    a, b = (((r.get("metrics") or {}).get("pipeline") or {}).get("actions_ms_by_rank") for r in (cell.a, cell.b))
    if not a or not b or len(a) != len(b) or any(x is None for x in (*a, *b)):
        return None
    rows = []
    for rank, (pa, pb) in enumerate(zip(a, b)):
        wait_a, wait_b = pa.get("p2p_wait", 0.0), pb.get("p2p_wait", 0.0)
        rows.append({"rank": rank, **{part: _pair(pa.get(part, 0.0), pb.get(part, 0.0), ".1f")
                                      for part in (*STAGE_ACTIONS, "other")},
                     "wait change %": f"{100 * (wait_b / wait_a - 1):+.0f}" if wait_a > 0 else "n/a"})
    return pd.DataFrame(rows)


def _md(df: pd.DataFrame, floatfmt: str = ".1f") -> str:
    return tabulate(df.astype(object).where(df.notna(), None), headers="keys", tablefmt="github", showindex=False,
                    floatfmt=floatfmt, missingval="")


def _run_line(label: str, name: str, records: Sequence[dict[str, Any]]) -> str:
    env = next((r.get("env") or {} for r in records if r.get("kind", "cell") == "cell"), {})
    sha = (env.get("git_sha") or "unknown")[:10] + ("+dirty" if env.get("git_dirty") else "")
    run_id = next((r.get("run_id") for r in records if r.get("run_id")), "unknown run")
    return f"- **{label}**: `{name}` (run {run_id}, commit {sha}, {env.get('device_name') or 'unknown device'})"


def diff_markdown(diff: RunDiff, a_name: str, b_name: str, a_records: Sequence[dict[str, Any]],
                  b_records: Sequence[dict[str, Any]]) -> str:
    """The whole diff as markdown: the cells table, each cell's composition, unmatched cells."""
    out = ["# harness diff: B against A", "", _run_line("A", a_name, a_records), _run_line("B", b_name, b_records), ""]
    out += ["## Cells", ""]
    if diff.cells:
        out += [_md(cells_table(diff)), ""]
        out += ["Throughput: the gate's statistics over per-step samples (ratio of medians B/A, percentile "
                "bootstrap 95% CI, one-sided Mann-Whitney U for B slower); `A -> B` for every other metric.", ""]
        spread = step_spread_pct(diff)
        if spread is not None:
            n, mean, median, top = spread
            out += [f"Median step, B against A, over the {n} cells ok in both: mean |B/A - 1| {mean:.1f}%, "
                    f"median {median:.1f}%, max {top:.1f}%.", ""]
        per_round = round_spread_pct(diff)
        if per_round:
            out += ["One round of each side alone (round k of A against round k of B: what two sweeps without "
                    "`--rounds` would have differed by): " + "; ".join(
                        f"round {k}: mean {mean:.1f}%, median {median:.1f}%" for k, _, mean, median in per_round)
                    + ".", ""]
    else:
        out += ["No cell is in both runs.", ""]
    notes = [f"- `{c.cell_id}`: {c.note}" for c in diff.cells if c.note]
    notes += [f"- `{c.cell_id}`: throughput {c.throughput.reason}" for c in diff.cells
              if c.throughput.verdict not in ("PASS",)]
    if notes:
        out += ["Notes:", "", *notes, ""]
    out += ["## Where the time went", ""]
    profiled = [c for c in diff.cells if c.parts_delta_s]
    for c in diff.cells:
        if not c.parts_delta_s:
            out += [f"- `{c.cell_id}`: {c.sentence or 'neither side profiled: rerun both with --profile'}"]
    for c in profiled:
        source = (composition(c.b) or {}).get("source", "?")
        out += ["", f"### `{c.cell_id}`", "", f"**{c.sentence}**", "",
                f"Per profiled step, mean over ranks, from {source} "
                "(`metrics.trace.composition`; the parts sum to the profiled step):", "",
                _md(composition_table(c)), ""]
    staged = [(c, t) for c in diff.cells if (t := stage_actions_table(c)) is not None]
    if staged:
        out += ["", "## Pipeline stage actions, A -> B", "",
                "Per pipeline rank, ms per measured step (mean): forward, whole backward, a zero-bubble schedule's "
                "input- and weight-gradient parts, the gradient reduce, the waits on sends and receives (the bubble) "
                "and the rest (`metrics.pipeline.actions_ms_by_rank`, CPU ranks)."]
        for c, t in staged:
            out += ["", f"### `{c.cell_id}`", "", _md(t)]
    out += ["", "## Unmatched cells", ""]
    if not diff.only_a and not diff.only_b:
        out += ["None: every cell is in both runs."]
    out += [f"- only in A: `{cid}`" for cid in diff.only_a]
    out += [f"- only in B: `{cid}`" for cid in diff.only_b]
    return "\n".join(out).rstrip() + "\n"
