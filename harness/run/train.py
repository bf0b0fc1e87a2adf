"""One optimizer step under any strategy and precision, with NVTX phase ranges."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from harness.parallel.expert_load import ExpertLoad
from harness.parallel.parallelized import Parallelized
from harness.precision import PrecisionPlan
from workloads.model import lm_loss


class StepRanges(Protocol):
    """The NVTX phase ranges a step opens (:class:`harness.measure.nvtx_ranges.Ranges`)."""

    def range(self, phase: str, payload: int | float | None = None) -> AbstractContextManager[Any]: ...


@dataclass
class StepContext:
    par: Parallelized
    optimizer: torch.optim.Optimizer
    precision: PrecisionPlan
    scaler: torch.amp.GradScaler | None
    device_kind: str
    grad_accum: int
    ranges: StepRanges
    """:class:`harness.measure.nvtx_ranges.Ranges` (no-op when disabled), or its profiler-annotated wrapper."""
    moe: ExpertLoad | None = None
    """An MoE's balancing step, run after each optimizer step."""
    after_optimizer: Callable[[], None] | None = None
    """Run after each optimizer step: fp8's weight scales for FSDP's float8 all-gather
    (:meth:`harness.precision.PrecisionPlan.after_optimizer_step`)."""


def _sync_context(par: Parallelized, sync: bool) -> AbstractContextManager[Any]:
    """Skip the gradient reduction on all but the last accumulation micro-step (the layout's ``no_sync``)."""
    return contextlib.nullcontext() if sync or par.no_sync is None else par.no_sync()


def _value(loss: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor, detached: loss parallel's is a replicated DTensor (the tensor with ``to_local``)."""
    loss = loss.detach()
    return loss.to_local() if hasattr(loss, "to_local") else loss


def _forward_backward(ctx: StepContext, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
    par, r = ctx.par, ctx.ranges
    if par.pipeline is not None:
        with r.range("forward"), ctx.precision.autocast(ctx.device_kind), par.loss_context():
            # The schedule interleaves forward and backward of microbatches inside one call.
            losses = par.pipeline.step(x, y)
        return torch.stack([_value(l).float() for l in losses]).mean() if losses else None
    if ctx.grad_accum == 1:  # one microbatch: no chunks, no division by 1 and no running sum (3 kernels a step)
        return _microbatch(ctx, x, y, sync=True)
    total = torch.zeros((), device=x.device)
    for i, (xc, yc) in enumerate(zip(x.chunk(ctx.grad_accum), y.chunk(ctx.grad_accum))):
        total += _microbatch(ctx, xc, yc, sync=i == ctx.grad_accum - 1)
    return total


def _microbatch(ctx: StepContext, x: torch.Tensor, y: torch.Tensor, sync: bool) -> torch.Tensor:
    """Forward and backward of one microbatch, its loss scaled by ``1 / grad_accum``; the loss, detached."""
    par, r = ctx.par, ctx.ranges
    assert par.model is not None, "a model without a pipeline is callable"
    with _sync_context(par, sync), par.loss_context():
        with r.range("forward"), ctx.precision.autocast(ctx.device_kind):
            loss = lm_loss(par.model(x), y)
            if ctx.grad_accum > 1:
                loss = loss / ctx.grad_accum
        with r.range("backward"):
            (ctx.scaler.scale(loss) if ctx.scaler is not None else loss).backward()
    return _value(loss)


def train_step(ctx: StepContext, x: torch.Tensor, y: torch.Tensor, lr: float) -> tuple[torch.Tensor | None, bool]:
    """Zero grads, forward+backward (all microbatches), optimizer step.

    Returns (this rank's mean loss or None on pipeline stages without the loss, skipped),
    where ``skipped`` is True when fp16 loss scaling found inf/NaN gradients and skipped the update.
    """
    for group in ctx.optimizer.param_groups:
        group["lr"] = lr
    ctx.optimizer.zero_grad(set_to_none=True)
    loss = _forward_backward(ctx, x, y)
    if ctx.par.after_backward is not None:  # sequence parallel: the norms' partial gradients, summed once
        ctx.par.after_backward()
    skipped = False
    with ctx.ranges.range("optimizer"):
        if ctx.scaler is None:
            ctx.optimizer.step()
        else:
            before = ctx.scaler.get_scale()
            ctx.scaler.step(ctx.optimizer)
            ctx.scaler.update()
            # GradScaler lowers the scale exactly when it skipped the step for inf/NaN gradients.
            skipped = ctx.scaler.get_scale() < before
        if ctx.moe is not None:
            ctx.moe.step()
        if ctx.after_optimizer is not None:
            ctx.after_optimizer()
    return loss, skipped
