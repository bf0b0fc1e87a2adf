"""What a rank trains (:class:`Parallelized`), apart from how it is built (:mod:`harness.parallel.parallelize`).

Its own module so that a step's code (:mod:`harness.run.train`, the CI cells, the A/B gate's processes)
imports no DTensor, FSDP or pipelining machinery a one-device cell never uses: about 2 s of imports per
process, which the gate pays in every one of its rounds. What a layout adds to the step (sequence parallel's
gradient sum, loss parallel's context) is bound here by :func:`harness.parallel.parallelize.parallelize`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from harness.parallel.pipeline_run import Pipeline


@dataclass
class Parallelized:
    """What a rank trains: the model parts it owns and how to run a step over them."""

    parts: list[nn.Module]
    """Modules whose parameters this rank updates (one per pipeline stage it holds)."""
    model: nn.Module | None
    """Callable model (non-pipeline strategies), possibly DDP-wrapped."""
    pipeline: Pipeline | None
    data_parallel: str
    notes: list[str] = field(default_factory=list)
    no_sync: Callable[[], AbstractContextManager[Any]] | None = None
    """Data parallel's context that skips the gradient reduction (DDP's ``no_sync``, FSDP's gradient sync turned
    off and back on), for all but the last micro-step of gradient accumulation; None without one."""
    after_backward: Callable[[], object] | None = None
    """Run after the backward, before the optimizer: under sequence parallel, the replicated norms' partial
    gradients summed in one all-reduce (:func:`harness.parallel.tp.reduce_partial_grads`), bound when built."""
    loss_parallel: Callable[[], AbstractContextManager[Any]] | None = None
    """Under loss parallel (the logits vocabulary-sharded DTensors) torch's ``loss_parallel`` context, in which the
    loss and its backward run (:meth:`loss_context`); bound when built, so the step imports nothing."""
    fp8_linears: list[str] = field(default_factory=list)
    """``fp8``: the linears this rank trains in float8 (their names in the whole model)."""
    step_parts: Callable[[], dict[str, float]] | None = None
    """The seconds each named part of the step took since the last call (a pipeline's stage actions and waits,
    :meth:`harness.parallel.pipeline_clock.ActionClock.lap`); None where a step has no such parts."""

    def parameters(self):
        for p in self.parts:
            yield from p.parameters()

    def loss_context(self):
        """Where the loss and its backward run: torch's vocabulary-parallel cross-entropy under loss parallel."""
        return self.loss_parallel() if self.loss_parallel is not None else contextlib.nullcontext()
