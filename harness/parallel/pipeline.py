"""Pipeline parallel with ``torch.distributed.pipelining``: stage splitting and schedules.

Stages are contiguous layer ranges: stage 0 also holds the embeddings, the last stage the
final norm and LM head. Interleaved 1F1B (Narayanan et al. 2021) gives each rank ``v = 2``
stages in a loop (rank r holds stages r and r + pp), shrinking the bubble from
``(p - 1) / m`` to ``(p - 1) / (v * m)``.
"""

from __future__ import annotations

import copy
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

from harness.parallel.dims import ParallelDims
from harness.parallel.pipeline_clock import ActionClock, attach
from harness.parallel.schedules import layer_ranges
from workloads.model import Decoder


def build_stage_module(model: Decoder, stage: int, n_stages: int) -> Decoder:
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


@dataclass(frozen=True)
class StageShapes:
    """What crosses a stage boundary, so stages need no metadata exchange (``harness fit``).

    Under the fake backend every receive leaves its buffer as it was, so the schedule's
    warm-up vote and shape inference (which send metadata between stages) would read zeros.
    With these shapes each stage is built STATIC: its receive buffers come from them.
    """

    rows: int
    """Sequences per microbatch."""
    seq_len: int
    d_model: int
    hidden_seq_shards: int
    """Ways the hidden state between stages is split along the sequence: tp under sequence parallel (each
    tp rank sends its shard, :func:`harness.parallel.tp.apply_tp`), else 1."""
    vocab_size: int
    hidden_dtype: torch.dtype
    """Dtype of the hidden state between stages: FSDP's low-precision ``param_dtype``, else fp32."""
    logits_dtype: torch.dtype
    """Dtype of the last stage's output: the autocast dtype, else fp32."""

    def io(self, stage: int, n_stages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Meta tensors of one stage's input and output."""
        # requires_grad: a stage's received input gets a gradient to send back, its output one to receive
        hidden = torch.empty(self.rows, self.seq_len // self.hidden_seq_shards, self.d_model, dtype=self.hidden_dtype,
                             device="meta", requires_grad=True)
        tokens = torch.empty(self.rows, self.seq_len, dtype=torch.long, device="meta")
        logits = torch.empty(self.rows, self.seq_len, self.vocab_size, dtype=self.logits_dtype, device="meta")
        return (tokens if stage == 0 else hidden), (logits if stage == n_stages - 1 else hidden)


def static_shapes(dims: ParallelDims, rows: int, seq_len: int, d_model: int, vocab_size: int,
                  autocast_dtype: torch.dtype | None, fsdp: bool) -> StageShapes | None:
    """The stage shapes of a cell with ``rows`` sequences per microbatch (None without a pipeline)."""
    if not dims.pp_enabled:
        return None
    low = autocast_dtype
    return StageShapes(rows=rows, seq_len=seq_len, d_model=d_model, vocab_size=vocab_size,
                       hidden_seq_shards=dims.tp if dims.sequence_parallel else 1,
                       hidden_dtype=low if (low is not None and fsdp) else torch.float32,
                       logits_dtype=low or torch.float32)


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
