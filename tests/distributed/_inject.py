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


FP8_WRONG_SCALE = 4.0


def fp8_wrong_scale(rank: int) -> None:
    """Every float8 scale 4x too large (as an amax taken over one shard instead of the whole tensor can make it):
    every value above a quarter of its tensor's amax saturates at float8's largest."""
    import torchao.float8.float8_scaling_utils as scaling  # noqa: PLC0415 (torchao: the fp8 extra)

    original = scaling.tensor_to_scale

    def too_large(*args, **kwargs):
        return original(*args, **kwargs) * FP8_WRONG_SCALE

    scaling.tensor_to_scale = too_large


FP8_LEFT_OUT = "blocks.1.mlp.fc"


def fp8_unconverted_linear(rank: int) -> None:
    """One MLP linear left out of the float8 conversion (a filter that drops a name)."""
    import harness.precision as precision  # noqa: PLC0415

    original = precision.fp8_eligible
    precision.fp8_eligible = lambda module, fqn: fqn != FP8_LEFT_OUT and original(module, fqn)


def fp8_converted_head(rank: int) -> None:
    """The LM head converted too (a filter that forgets it: torchtitan and this harness keep it in bf16)."""
    import torch  # noqa: PLC0415

    import harness.precision as precision  # noqa: PLC0415

    original = precision.fp8_eligible
    precision.fp8_eligible = lambda module, fqn: original(module, fqn) or (
        isinstance(module, torch.nn.Linear) and fqn == "head")
