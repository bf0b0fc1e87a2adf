"""What a rank trains (:class:`Parallelized`), apart from how it is built (:mod:`harness.parallel.parallelize`).

Its own module so that a step's code (:mod:`harness.run.train`, the CI cells, the A/B gate's processes)
imports no DTensor, FSDP or pipelining machinery a one-device cell never uses: about 2 s of imports per
process, which the gate pays in every one of its rounds.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from harness.parallel.pipeline import Pipeline


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
    sequence_parallel: bool = False
    """Whether replicated LayerNorm weights get partial gradients (:func:`harness.parallel.tp.reduce_partial_grads`)."""
    loss_parallel: bool = False
    """Whether the logits are vocabulary-sharded DTensors: the loss and its backward run in :meth:`loss_context`."""
    fp8_linears: list[str] = field(default_factory=list)
    """``fp8``: the linears this rank trains in float8 (their names in the whole model)."""

    def parameters(self):
        for p in self.parts:
            yield from p.parameters()

    def loss_context(self):
        """Where the loss and its backward run: torch's vocabulary-parallel cross-entropy under loss parallel."""
        if not self.loss_parallel:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel  # noqa: PLC0415 (only a tp layout imports DTensor)

        return loss_parallel()
