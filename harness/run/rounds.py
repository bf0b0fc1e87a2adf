"""``harness bench --rounds N``: every cell once per round, the order changed each round, the
record from the cell's median round.

A shared machine's speed drifts by tens of percent within minutes (results/reference/machine-drift),
and the steps of one process are not independent samples of it. A sweep that measures each cell
once, in its own stretch of time, puts that drift between cells into every comparison. With
rounds, each cell is measured in N separate stretches spread over the sweep, in a different
order each round (seeded shuffle, or a rotation), so drift lands on every cell alike; the record
is the cell's median round, and the round-to-round spread is kept beside it.

The spread is the distribution-free interval of the median of the round medians: the order
statistics ``(j, n+1-j)`` with the largest ``j`` whose binomial coverage is at least
:data:`harness.measure.intervals.COVERAGE` (with fewer than 4 rounds no pair reaches it, and the full range is used, its
coverage given). Two cells whose intervals overlap are a tie (:mod:`harness.report.ties`).

The rounds done are kept in ``rounds.json`` in the run directory (written atomically after each
cell's round), so ``--resume`` keeps the rounds that finished. Pure but for :class:`RoundState`'s file.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from harness.errors import UsageError
from harness.measure.intervals import median_spread
from harness.records.atomic import write_json_atomic

ORDERS = ("shuffle", "rotate")
STATE_FILE = "rounds.json"


@dataclass(frozen=True)
class RoundsPlan:
    """How many rounds, how each round is ordered, and the shuffle's seed."""

    n: int = 1
    order: str = "shuffle"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n < 1:
            raise UsageError(f"--rounds {self.n}: must be an integer >= 1 (e.g. 5)")
        if self.order not in ORDERS:
            raise UsageError(f"--round-order {self.order!r}: must be one of {', '.join(ORDERS)}")

    def as_dict(self) -> dict:
        return {"n": self.n, "order": self.order, "seed": self.seed}


def round_order(cell_ids: list[str], round_index: int, plan: RoundsPlan) -> list[str]:
    """The cells of round ``round_index`` (0-based): the plan's order rotated by one cell per round,
    or shuffled by a generator seeded from (seed, round), so every node of a sweep walks the same order."""
    if not cell_ids:
        return []
    if plan.order == "rotate":
        k = round_index % len(cell_ids)
        return cell_ids[k:] + cell_ids[:k]
    ids = list(cell_ids)
    random.Random(f"{plan.seed}-{round_index}").shuffle(ids)
    return ids


def median_round(medians: list[float]) -> int:
    """Index of the round whose median is the median of the rounds (the lower middle one when even)."""
    order = sorted(range(len(medians)), key=lambda i: (medians[i], i))
    return order[(len(order) - 1) // 2]


def summary(medians: list[float], plan: RoundsPlan) -> dict:
    """``metrics.rounds``: every round's median step time, the chosen round, and the median's interval
    with its coverage and half-width as % of the median as computed when recorded (the report recomputes
    them from ``medians_s``, so a record keeps its raw rounds whatever rule later reads them)."""
    spread = median_spread(medians)
    return {"n": len(medians), "order": plan.order, "seed": plan.seed, "medians_s": medians,
            "chosen": median_round(medians), "ci_s": [spread["low"], spread["high"]],
            "ci_coverage": round(spread["coverage"], 4), "spread_pct": spread["spread_pct"]}


@dataclass
class RoundState:
    """The rounds a run has finished, per cell: ``{cell_id: {round: facts}}``, kept in ``rounds.json``."""

    path: Path
    plan: RoundsPlan
    done: dict[str, dict[int, dict]] = field(default_factory=dict)

    @classmethod
    def open(cls, out: Path, plan: RoundsPlan, resume: bool) -> RoundState:
        """A fresh state, or on resume the file's (refused when it was another number or order of rounds)."""
        path = out / STATE_FILE
        held = recorded_rounds(out) if resume else None
        if held is None:
            return cls(path, plan)
        if held != plan:
            raise UsageError(f"--resume {out}: the run was measured with --rounds {held.n} --round-order {held.order} "
                             f"(seed {held.seed}), not --rounds {plan.n} --round-order {plan.order} (seed {plan.seed}); "
                             f"resume with the run's own, or start a new --out")
        cells = json.loads(path.read_text())["cells"]
        done = {cid: {int(k): v for k, v in rounds.items()} for cid, rounds in cells.items()}
        return cls(path, plan, done)

    def has(self, cell_id: str, round_index: int) -> bool:
        return round_index in self.done.get(cell_id, {})

    def failed(self, cell_id: str) -> bool:
        return any(r["status"] != "ok" for r in self.done.get(cell_id, {}).values())

    def add(self, cell_id: str, round_index: int, facts: dict) -> None:
        self.done.setdefault(cell_id, {})[round_index] = facts
        write_json_atomic(self.path, {"plan": self.plan.as_dict(),
                                      "cells": {c: {str(k): v for k, v in sorted(r.items())}
                                                for c, r in self.done.items()}})

    def rounds_of(self, cell_id: str) -> dict[int, dict]:
        return dict(sorted(self.done.get(cell_id, {}).items()))


def recorded_rounds(out: Path) -> RoundsPlan | None:
    """The rounds plan a run directory was measured with (its rounds.json), or None."""
    path = out / STATE_FILE
    return RoundsPlan(**json.loads(path.read_text())["plan"]) if path.exists() else None
