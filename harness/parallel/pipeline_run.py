"""This rank's pipeline stages in ``torch.distributed.pipelining`` and their schedule (:func:`build_pipeline`).

Split from :mod:`harness.parallel.pipeline` so that a cell without a pipeline never imports torch's pipelining (it
imports ``torch._dynamo``: the worker's import 3.94 s with it, 3.45 s without, on CI's CPU, docs/harness-cost.md);
:mod:`harness.parallel.parallelize` imports this module only where the layout has one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from harness.parallel.pipeline import StageShapes
from harness.parallel.pipeline_clock import ActionClock, attach


class _StaticStage(PipelineStage):
    """A stage whose shapes were given: it skips the warm-up vote, whose answer it knows (STATIC).

    The vote is a point-to-point exchange (torch 2.13 ``PipelineStage._warmup_forward_vote``)
    that a fake process group answers with zeros, i.e. "infer shapes at runtime".
    """

    def _static_vote(self) -> torch.Tensor:
        # torch.tensor (not torch.ones): under ``harness fit``'s FakeTensorMode it stays a constant
        # the schedule can read with ``.item()``.
        return torch.tensor([1], dtype=torch.int32, device=self.device)

    def _warmup_forward_vote(self, has_backward: bool, received_acc: torch.Tensor | None = None) -> torch.Tensor:
        return self._static_vote()

    def _warmup_backward_result(self, received_result: torch.Tensor | None = None) -> torch.Tensor:
        return self._static_vote()


@dataclass
class Pipeline:
    schedule: PipelineScheduleSingle | PipelineScheduleMulti
    modules: list[nn.Module]
    has_first: bool
    has_last: bool
    n_stages: int
    clock: ActionClock
    """Times this rank's stage actions and waits (:mod:`harness.parallel.pipeline_clock`)."""

    def step(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        """One forward+backward over all microbatches; returns this rank's microbatch losses.

        ``return_outputs=False``: the last stage would otherwise keep every microbatch's logits
        until the step ends, to return them merged (nothing here reads them; the losses suffice).
        """
        losses: list[torch.Tensor] = []
        if self.has_first and self.has_last:
            self.schedule.step(x, target=y, losses=losses, return_outputs=False)
        elif self.has_first:
            self.schedule.step(x, return_outputs=False)
        elif self.has_last:
            self.schedule.step(target=y, losses=losses, return_outputs=False)
        else:
            self.schedule.step(return_outputs=False)
        return losses


def build_pipeline(stage_modules: Mapping[int, nn.Module], n_stages: int, pp_group, device, schedule: str,
                   microbatches: int, loss_fn, shapes: StageShapes | None = None) -> Pipeline:
    """Wrap this rank's stage modules in ``PipelineStage`` and a schedule.

    ``scale_grads=True`` divides gradients by the microbatch count, so the update equals the
    one from the mean loss over the whole batch (numerical parity with one device). With
    ``shapes`` the stages are static (no metadata exchange; see :class:`StageShapes`).
    """
    if shapes is None:
        stages = [PipelineStage(mod, stage_index=sid, num_stages=n_stages, device=device, group=pp_group)
                  for sid, mod in sorted(stage_modules.items())]
    else:
        stages = [_StaticStage(mod, stage_index=sid, num_stages=n_stages, device=device, group=pp_group,
                               input_args=shapes.io(sid, n_stages)[0], output_args=shapes.io(sid, n_stages)[1])
                  for sid, mod in sorted(stage_modules.items())]
    sched: PipelineScheduleSingle | PipelineScheduleMulti
    multis = {"interleaved1f1b": ScheduleInterleaved1F1B, "zb": ScheduleInterleavedZeroBubble,
              "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}
    if schedule in multis:
        multi = multis[schedule]
        # the ignore: torch annotates ``stages`` as an invariant list of its private base class
        # (_PipelineStageBase); a list of PipelineStage, a subclass, is what it takes
        sched = multi(stages,  # type: ignore[arg-type]
                      n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)
    else:
        cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        sched = cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)
    ids = sorted(stage_modules)
    return Pipeline(
        schedule=sched,
        modules=[stage_modules[i] for i in ids],
        has_first=0 in ids,
        has_last=n_stages - 1 in ids,
        n_stages=n_stages,
        clock=attach(stages),
    )
