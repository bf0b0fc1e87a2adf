"""Layers both the dense blocks (:mod:`workloads.model`) and the MoE layer (:mod:`workloads.moe`) use."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def positions_of(seq_shard, local_len: int, device) -> torch.Tensor:
    """Global positions of the ``local_len`` tokens a module sees: ``0..T-1``, or its context-parallel shard's."""
    if seq_shard is None:
        return torch.arange(local_len, device=device)
    return seq_shard.positions(local_len, device)


class SwiGLU(nn.Module):
    """llama3's MLP: ``proj(silu(gate(x)) * up(x))`` (Shazeer 2020), no biases."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, d_ff, bias=False)
        self.up = nn.Linear(d_model, d_ff, bias=False)
        self.proj = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.gate(x)) * self.up(x))
