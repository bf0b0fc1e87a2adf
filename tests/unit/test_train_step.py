"""The harness's step against a plain training loop: the same ops, the same numbers (issue 62).

A plain step (zero_grad, forward, loss, backward, AdamW step: ``tests/bench/conftest.bare_step``) is what the measured
step must not be slower than; the harness's :func:`harness.run.train.train_step` adds phase ranges and levers, but at
one microbatch it dispatches exactly the plain step's ATen ops (counted under a dispatch mode, not timed), and its
update is bitwise the plain step's. With gradient accumulation each microbatch's loss is scaled by ``1 / grad_accum``.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness.run import train
from tests.bench.bare_loop import bare_step
from tests.bench.conftest import make_context
from workloads.model import lm_loss


class OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _two_sides(grad_accum: int = 1):
    ctx, model, opt, x, y = make_context("tiny", seq_len=16, batch=4, nvtx=True)
    _, bmodel, bopt, _, _ = make_context("tiny", seq_len=16, batch=4, nvtx=False)
    ctx.grad_accum = grad_accum
    return ctx, model, bmodel, bopt, x, y


def test_one_microbatch_runs_exactly_the_plain_steps_ops() -> None:
    ctx, model, bmodel, bopt, x, y = _two_sides()
    for _ in range(2):  # the optimizer's state exists on both sides before counting
        train.train_step(ctx, x, y, 1e-3)
        bare_step(bmodel, bopt, x, y)
    with OpCount() as harness:
        loss, skipped = train.train_step(ctx, x, y, 1e-3)
    with OpCount() as plain:
        plain_loss = bare_step(bmodel, bopt, x, y)
    assert harness.ops == plain.ops, (harness.ops - plain.ops, plain.ops - harness.ops)
    assert not skipped and loss is not None and torch.equal(loss, plain_loss)
    for p, q in zip(model.parameters(), bmodel.parameters(), strict=True):
        assert torch.equal(p, q), "the harness's update is the plain step's, bit for bit"


def test_accumulated_microbatches_average_their_losses() -> None:
    ctx, model, bmodel, bopt, x, y = _two_sides(grad_accum=2)
    with torch.no_grad():
        halves = [lm_loss(model(xc), yc) for xc, yc in zip(x.chunk(2), y.chunk(2))]
    loss, _ = train.train_step(ctx, x, y, 0.0)  # lr 0: the step's gradients stay in .grad, the weights unmoved
    assert loss is not None and torch.allclose(loss, (halves[0] + halves[1]) / 2, rtol=1e-6)
    for group in bopt.param_groups:
        group["lr"] = 0.0
    bare_step(bmodel, bopt, x, y)  # equal halves: the mean of the halves' means is the batch's mean
    for p, q in zip(model.parameters(), bmodel.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-7), "each microbatch's loss scaled by 1/2"
