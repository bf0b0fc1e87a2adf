"""Test-only faults for ``run_cells(..., inject="tests.distributed._inject:NAME")``: never imported by the harness.

Each function runs in a rank process before its cells, and patches the harness the way a bug in
the product would change it.
"""

from __future__ import annotations

import harness.run.train as train
from harness.measure.timer import StepTimer

SLOW_RANK = 1
SLOW_RANK_EXTRA_S = 0.25


def double_grads(rank: int) -> None:
    """Every gradient doubled after the backward (as a data-parallel sum instead of a mean would)."""
    original = train._forward_backward

    def doubled(ctx, x, y):
        loss = original(ctx, x, y)
        for p in ctx.par.parameters():
            if p.grad is not None:
                p.grad.mul_(2)
        return loss

    train._forward_backward = doubled


def slow_rank(rank: int) -> None:
    """Rank ``SLOW_RANK``'s clock reads every step ``SLOW_RANK_EXTRA_S`` longer than it took.

    A real delay on one rank would not do: the next step's collectives make its peers wait for
    it, and the delay spreads to every rank's time. The record must keep the slowest rank.
    """
    if rank != SLOW_RANK:
        return
    original = StepTimer.stop

    def stop(self) -> float:
        return original(self) + SLOW_RANK_EXTRA_S

    StepTimer.stop = stop
