"""``--batch auto``: per cell, the largest batch per data-parallel rank that fits, by isolated trials.

Each trial is the whole cell (every warmup and measured step, and the untimed counting steps),
launched as its own job (its own torchrun and ranks, so an out-of-memory costs only that trial),
at ``k x split`` sequences per data-parallel rank (``split``: the pipeline's microbatches or the
gradient-accumulation micro-steps, so the batch always divides). ``k`` doubles from 1 until a
trial runs out of memory, then bisects (:func:`harness.search.largest_passing`). The trial at the
batch found is the cell's measurement: no rerun, since a shorter trial under-reads the memory a
longer run reaches (a first version's 1-warmup + 1-step trials found a batch at which the full
cell then ran out of memory). A trial that fails any other way
(crashed, timeout) ends the search: the cell takes that status, since a bigger batch cannot be
told to fit from a smaller one's crash.

Weak scaling only: the batch per device is what is searched, and the global batch follows it.
Under strong scaling the global batch is the fixed work every strategy is compared on (and the
parity reference shares it), so ``auto`` is refused there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from harness.run.launch import Outcome
from harness.scaling import scaled_lr
from harness.search import largest_passing
from harness.spec import CellConfig

MAX_MULTIPLE = 1 << 12
"""The largest ``k`` tried (4096 x split sequences per rank)."""


class TrialFailed(Exception):
    """A trial neither fit nor ran out of memory: the search cannot go on."""

    def __init__(self, outcome: Outcome, rows: int, trials: list[dict]) -> None:
        super().__init__(f"batch auto: the trial at {rows} sequences per rank ended {outcome.status}: {outcome.error}")
        self.outcome = outcome
        self.rows = rows
        self.trials = trials


@dataclass
class BatchSearch:
    rows_per_rank: int | None
    """The largest batch per data-parallel rank that fit (None: not even ``split`` did)."""
    trials: list[dict] = field(default_factory=list)
    """In order: ``{"rows_per_rank", "global_batch", "status", "peak_mem_gib", "wall_s"}``."""
    outcome: Outcome | None = None
    """The trial at ``rows_per_rank``: the cell's measurement."""

    def as_dict(self) -> dict:
        return {"rows_per_rank": self.rows_per_rank, "trials": self.trials,
                "method": "double from 1 x split, then bisect; each trial the whole cell as its own job; "
                          "the trial at the batch found is the cell's measurement"}


def split_of(cfg: CellConfig) -> int:
    """Sequences per rank the batch must be a multiple of: the microbatches (pipelines) or micro-steps."""
    return cfg.microbatches if cfg.layout.dims.pp_enabled else cfg.grad_accum


def trial_config(cfg: CellConfig, rows_per_rank: int) -> CellConfig:
    """The cell at ``rows_per_rank`` sequences per data-parallel rank, its LR rescaled by its rule."""
    gb = rows_per_rank * cfg.layout.dims.dp
    return replace(cfg, global_batch=gb, lr=scaled_lr(cfg.lr_rule, cfg.base_lr, cfg.base_batch, gb))


def search(cfg: CellConfig, run_trial: Callable[[CellConfig, str], Outcome]) -> BatchSearch:
    """The largest fitting batch per rank; ``run_trial(config, name)`` runs one trial job."""
    split = split_of(cfg)
    result = BatchSearch(rows_per_rank=None)
    outcomes: dict[int, Outcome] = {}

    def fits(k: int) -> bool:
        rows = k * split
        trial = trial_config(cfg, rows)
        outcome = run_trial(trial, f"b{rows}")
        peak = (outcome.result or {}).get("metrics", {}).get("peak_mem_gib")
        outcomes[rows] = outcome
        result.trials.append({"rows_per_rank": rows, "global_batch": trial.global_batch, "status": outcome.status,
                              "peak_mem_gib": peak, "wall_s": outcome.wall_s})
        if outcome.status not in ("ok", "oom"):
            raise TrialFailed(outcome, rows, result.trials)
        return outcome.status == "ok"

    k = largest_passing(fits, 1, MAX_MULTIPLE)
    if k is not None:
        result.rows_per_rank = k * split
        result.outcome = outcomes[result.rows_per_rank]
    return result
