"""Layers both the dense blocks (:mod:`workloads.model`) and the MoE layer (:mod:`workloads.moe`) use."""

from __future__ import annotations

import math

import torch
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch import nn


def positions_of(seq_shard, local_len: int, device) -> torch.Tensor:
    """Global positions of the ``local_len`` tokens a module sees: ``0..T-1``, or its context-parallel shard's."""
    if seq_shard is None:
        return torch.arange(local_len, device=device)
    return seq_shard.positions(local_len, device)


class SwiGLU(nn.Module):
    """llama3's MLP: ``proj(silu(gate(x)) * up(x))`` (Shazeer 2020), biases where the architecture has them."""

    def __init__(self, d_model: int, d_ff: int, bias: bool = False) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, d_ff, bias=bias)
        self.up = nn.Linear(d_model, d_ff, bias=bias)
        self.proj = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.gate(x)) * self.up(x))


def alibi_slopes(n_heads: int, bias_max: float = 8.0) -> torch.Tensor:
    """ALiBi's per-head slopes (Press et al. 2022, section 3): ``2 ** (-bias_max i / n)`` for heads ``i = 1..n`` when
    n is a power of two; otherwise the slopes of the next power of two, odd ones first, as the paper's code and
    MPT's ``gen_slopes`` take them. (n,) fp32."""
    n = 2 ** math.ceil(math.log2(n_heads))
    slopes = 2.0 ** (-bias_max * torch.arange(1, n + 1, dtype=torch.float32) / n)
    if n != n_heads:
        slopes = torch.cat((slopes[1::2], slopes[::2]))[:n_heads]
    return slopes


def alibi_bias(slopes: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive attention bias of ``slopes`` (H,) for queries at ``q_pos`` (Tq,) over keys at ``k_pos`` (Tk,):
    ``slope x (k - q)`` where ``k <= q``, ``-inf`` after (causal), as (1, H, Tq, Tk): a 4-D mask, which SDPA's fused
    CPU kernel takes (a 3-D one sends it to the math path)."""
    rel = (k_pos[None, :] - q_pos[:, None]).to(torch.float32)  # (Tq, Tk)
    bias = slopes.to(rel.device)[:, None, None] * rel  # (H, Tq, Tk)
    bias = bias.masked_fill(rel > 0, float("-inf"))
    return bias.unsqueeze(0).to(dtype)


class ProjNorm(nn.RMSNorm):
    """RMSNorm over a whole q or k projection (OLMo 2's q/k norms), ``(..., width)``. Under tensor parallel each rank
    holds ``width / tp`` of the projection and of the weight; ``group`` (set by the harness) then sums the squares over
    the tensor-parallel ranks (an all-reduce, autograd's too), so the norm is the whole projection's."""

    group = None
    """The tensor-parallel process group, or None when this rank holds the whole projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return super().forward(x)
        weight = self.weight.to_local() if hasattr(self.weight, "to_local") else self.weight
        width = x.shape[-1] * torch.distributed.get_world_size(self.group)
        squares = dist_fn.all_reduce(x.float().pow(2).sum(-1, keepdim=True), group=self.group)
        eps = self.eps if self.eps is not None else torch.finfo(torch.float32).eps
        return (x.float() * torch.rsqrt(squares / width + eps)).type_as(x) * weight


class _SumGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``group`` (each rank's holds its heads' part)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_grad_over(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` as it is, its gradient summed over ``group`` in backward (None: no group, ``x`` itself): for a tensor
    every tensor-parallel rank computes alike but uses for its own heads only (MLA's shared rotary key)."""
    return x if group is None else _SumGrad.apply(x, group)
