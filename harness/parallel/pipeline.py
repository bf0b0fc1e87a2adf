"""Pipeline parallel: stage splitting and the shapes that cross a stage boundary; the stages and schedules of
``torch.distributed.pipelining`` are :mod:`harness.parallel.pipeline_run`'s (imported only where a cell has a
pipeline: that module says why).

Stages are contiguous layer ranges: stage 0 also holds the embeddings, the last stage the
final norm and LM head. Interleaved 1F1B (Narayanan et al. 2021) gives each rank ``v = 2``
stages in a loop (rank r holds stages r and r + pp), shrinking the bubble from
``(p - 1) / m`` to ``(p - 1) / (v * m)``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from harness.parallel.dims import ParallelDims
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
