"""Pipeline parallel with ``torch.distributed.pipelining``: stage splitting and schedules.

Stages are contiguous layer ranges: stage 0 also holds the embeddings, the last stage the
final norm and LM head. Interleaved 1F1B (Narayanan et al. 2021) gives each rank ``v = 2``
stages in a loop (rank r holds stages r and r + pp), shrinking the bubble from
``(p - 1) / m`` to ``(p - 1) / (v * m)``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from harness.parallel.presets import stages_per_rank


def layer_ranges(n_layers: int, n_stages: int) -> list[range]:
    """Split layers as evenly as possible; earlier stages take the remainder."""
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def stage_ids(pp_rank: int, pp: int, schedule: str) -> list[int]:
    """Stage indices a rank holds (looped placement for interleaved schedules)."""
    return [pp_rank + k * pp for k in range(stages_per_rank(schedule))]


def build_stage_module(model: nn.Module, stage: int, n_stages: int) -> nn.Module:
    """A copy of ``model`` keeping only this stage's layers (names unchanged) and ends."""
    part = copy.deepcopy(model)
    keep = {str(i) for i in layer_ranges(len(model.blocks), n_stages)[stage]}
    for name in list(part.blocks.keys()):
        if name not in keep:
            del part.blocks[name]
    if stage != 0:
        part.embed = None
    if stage != n_stages - 1:
        part.norm = None
        part.head = None
    return part


@dataclass
class Pipeline:
    schedule: object
    modules: list[nn.Module]
    has_first: bool
    has_last: bool
    n_stages: int

    def step(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        """One forward+backward over all microbatches; returns this rank's microbatch losses."""
        losses: list[torch.Tensor] = []
        if self.has_first and self.has_last:
            self.schedule.step(x, target=y, losses=losses)
        elif self.has_first:
            self.schedule.step(x)
        elif self.has_last:
            self.schedule.step(target=y, losses=losses)
        else:
            self.schedule.step()
        return losses


def build_pipeline(stage_modules: dict[int, nn.Module], n_stages: int, pp_group, device, schedule: str,
                   microbatches: int, loss_fn) -> Pipeline:
    """Wrap this rank's stage modules in ``PipelineStage`` and a schedule.

    ``scale_grads=True`` divides gradients by the microbatch count, so the update equals the
    one from the mean loss over the whole batch (numerical parity with one device).
    """
    stages = [
        PipelineStage(mod, stage_index=sid, num_stages=n_stages, device=device, group=pp_group)
        for sid, mod in sorted(stage_modules.items())
    ]
    if schedule == "interleaved1f1b":
        sched = ScheduleInterleaved1F1B(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)
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
    )
