"""Published training runs held against the planner: for each, is the layout expressible in ``harness plan``, does
the planner's "fits" agree with the run (which ran, so it fit), and how far is the predicted throughput.

The rows live in a TOML file (``results/reference/published-layouts/rows.toml``): each quotes its source, gives
the layout as ``plan`` takes it and the published figures, and says whether the layout is expressible (``yes``),
only with something unpriced (``approx: ...``) or not (``no: ...``, why). Nothing here is tuned to them; the
``held-out`` rows choose no rule: each change to the pricing is a mechanism with its own source, applied to every
row alike (their numbers have been printed beside the check rows' since issue 59's second stop).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

from tabulate import tabulate

from harness.errors import UsageError
from harness.model.device_file import device_arg
from harness.model.whatif import CompileGain, plan_at_scale
from harness.text import degrees_label

GOAL_EACH_PCT = 15.0
GOAL_MEAN_PCT = 10.0
"""Throughput within 15% on each expressible row and 10% on their mean (issue 42): reported, not tuned to."""
NO_COMPILE_MEASUREMENT = "no compile measurement on this device in results/gpu"


@dataclass(frozen=True)
class PublishedRow:
    id: str
    group: str
    """``check`` (the rows the issue named) or ``held-out``."""
    source: str
    quote: str
    arch: str
    size: str
    gpus: int
    device: str
    """A preset name, or a device file beside the rows file."""
    precision: str
    strategy: str
    degrees: str
    global_batch: int
    seq_len: int
    ac: str
    expressible: str
    published_tokens_per_s_per_gpu: float
    compile: bool = False
    grad_accum: int = 1
    published_mem_gib: float | None = None
    assumed: str = ""
    rms_norm: str = "fused"
    """``fused`` or ``composite``: the run's torch ran RMSNorm as separate kernels (before torch 2.8's fused one)."""
    pp_schedule: str = "1f1b"
    """A pipelined row's schedule, as ``plan --pp-schedule`` takes it."""
    microbatches: int | None = None
    """A pipelined row's microbatches per step (None: ``plan``'s default)."""
    attention: str = ""
    """The attention kernel's table (``plan --attention-kernel``) where the run's framework runs another than the
    device's flash attention ("" : the device's)."""
    inductor_reductions: float = 1.0
    """Under compile, the share of the bandwidth its torch's Inductor reached in kernels with a norm, softmax or
    loss (``plan --inductor-reductions``): 0.5 for torch of 2024."""

    @property
    def can_plan(self) -> bool:
        return not self.expressible.startswith("no")

    def degrees_dict(self) -> dict[str, int]:
        return {k: int(v) for k, v in (p.split("=") for p in self.degrees.split(","))}


def load_rows(path: Path) -> list[PublishedRow]:
    """The rows of a published-layouts file; a row missing a field or with an unknown one is a UsageError."""
    known = {f.name for f in fields(PublishedRow)}
    out = []
    for i, raw in enumerate(tomllib.loads(path.read_text())["row"]):
        unknown = set(raw) - known
        if unknown:
            raise UsageError(f"{path}: row {i + 1} ({raw.get('id')}): unknown keys {sorted(unknown)}")
        out.append(PublishedRow(**{k: v for k, v in raw.items() if k in known}))
    return out


def predict(row: PublishedRow, folder: Path) -> dict:
    """The planner's row for a published layout (its device from ``folder`` when a file), or {} when not expressible."""
    if not row.can_plan:
        return {}
    device = device_arg(str(folder / row.device) if row.device.endswith(".toml") else row.device,
                        attention=row.attention or None)
    (pred,) = plan_at_scale(f"{row.arch}-{row.size}", device, row.gpus, [row.strategy], precision=row.precision,
                            global_batch=row.global_batch, seq_len=row.seq_len, recompute=row.ac,
                            grad_accum=row.grad_accum, degrees=row.degrees_dict(), pp_schedule=row.pp_schedule,
                            microbatches=row.microbatches,
                            compile=CompileGain(None, NO_COMPILE_MEASUREMENT) if row.compile else None,
                            fused_rms_norm=row.rms_norm == "fused", inductor_reductions=row.inductor_reductions)
    if not pred["valid"]:
        raise UsageError(f"published row {row.id}: marked expressible, but plan refuses it: {pred['reason']}")
    return {"device_gib": device.hbm_gib, "fits": pred["fits"], "peak_gib": pred["peak_mem_gib_per_rank"],
            "tokens_per_s_per_gpu": pred["tokens_per_s_per_device"],
            "error_pct": 100 * (pred["tokens_per_s_per_device"] / row.published_tokens_per_s_per_gpu - 1)}


PUBLISHED_TABLE = Path("results/reference/published-layouts/table.md")
"""The committed table (``scripts/published_layouts.py``): what ``plan`` prints of its error reads it."""


def published_error_line(table: Path = PUBLISHED_TABLE) -> str | None:
    """The what-if's throughput error against the published runs it expresses, from the committed table: how far and
    in which direction its predictions run on hardware nobody here measured; None without the table (outside the
    repository)."""
    if not table.is_file():
        return None
    errors = []
    for line in table.read_text().splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 2 and line.startswith("| ") and not line.startswith("| row") and cells[-2] not in ("-", ""):
            try:
                errors.append(float(cells[-2]))
            except ValueError:
                continue
    if not errors:
        return None
    return (f"against {len(errors)} published runs ({table}): predicted tokens/s per GPU mean |error| "
            f"{sum(map(abs, errors)) / len(errors):.1f}%, signed {sum(errors) / len(errors):+.1f}% (docs/op-pricing.md "
            f"says where it runs over)")


def _num(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def published_table(rows: list[PublishedRow], folder: Path) -> str:
    """The markdown table and its summary lines: one row per published run."""
    lines, done = [], []
    for r in rows:
        p = predict(r, folder)
        if p:
            done.append((r, p))
        layout = (f"{r.strategy} {degrees_label(r.degrees_dict())}" if r.strategy else r.degrees) + \
            f", {r.global_batch} x {r.seq_len}, ac {r.ac}" + (", compile" if r.compile else "")
        lines.append([r.id, r.group, f"{r.arch} {r.size}".strip(), r.gpus, r.device, r.precision, layout,
                      r.expressible, "-" if not p else ("yes" if p["fits"] else "NO"),
                      _num(p.get("peak_gib"), ".1f"), _num(r.published_mem_gib, ".1f"),
                      _num(p.get("tokens_per_s_per_gpu"), ",.0f"), f"{r.published_tokens_per_s_per_gpu:,.0f}",
                      _num(p.get("error_pct"), "+.1f")])
    table = tabulate(lines, headers=["row", "group", "model", "GPUs", "device", "precision", "layout", "expressible",
                                     "plan fits", "plan peak GiB", "published GiB", "plan tok/s/GPU",
                                     "published tok/s/GPU", "error %"], tablefmt="github", disable_numparse=True)
    summary = [line for g in ("check", "held-out") for line in _summary(g, [(r, p) for r, p in done if r.group == g],
                                                                       sum(r.group == g for r in rows))]
    return "\n".join([table, "", *summary])


def _errors(label: str, errors: list[float]) -> str:
    if not errors:
        return f"{label}: none"
    within = sum(abs(e) <= GOAL_EACH_PCT for e in errors)
    mean = sum(abs(e) for e in errors) / len(errors)
    return (f"{label}: within {GOAL_EACH_PCT:.0f}% on {within} of {len(errors)}, mean |error| {mean:.1f}% "
            f"(goal {GOAL_MEAN_PCT:.0f}%), signed mean {sum(errors) / len(errors):+.1f}%")


def _summary(group: str, done: list[tuple[PublishedRow, dict]], total: int) -> list[str]:
    """Per group: how many rows plan expresses, whether its "fits" agrees (every published run fit), and the
    throughput error on the fully priced rows apart from those with something unpriced."""
    if not done:
        return [f"- {group}: {total} rows, none expressible"]
    fits = sum(p["fits"] for _, p in done)
    priced = [p["error_pct"] for r, p in done if r.expressible == "yes"]
    approx = [p["error_pct"] for r, p in done if r.expressible != "yes"]
    return [f"- {group}: {total} rows, {len(done)} expressible; plan says fits on {fits} of {len(done)} (every "
            f"published run fit its device)",
            f"  - throughput, {_errors('rows priced in full', priced)}",
            f"  - throughput, {_errors('rows with something unpriced (approx)', approx)}"]
