"""Gradient noise scale, the two-batch estimator of McCandlish et al. 2018 (appendix A.1).

With ``|G_B|^2`` the squared norm of a mean gradient over ``B`` samples,
``E|G_B|^2 = |G|^2 + tr(Sigma) / B``. Two batch sizes ``b < B`` give unbiased estimates

    |G|^2     ~ (B |G_B|^2 - b |G_b|^2) / (B - b)
    tr(Sigma) ~ (|G_b|^2 - |G_B|^2) / (1/b - 1/B)

and ``B_simple = tr(Sigma) / |G|^2``. Each estimate is noisy, so both are smoothed with an
EMA before the ratio is taken. Under data parallel the local gradient (before the all-reduce)
is the small batch and the averaged gradient the big one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook


def two_batch_estimates(g_small_sq: float, g_big_sq: float, b_small: float, b_big: float) -> tuple[float, float]:
    """(|G|^2, tr(Sigma)) estimates from one pair of squared norms."""
    if not b_big > b_small > 0:
        raise ValueError(f"need b_big > b_small > 0, got b_small={b_small}, b_big={b_big}")
    g2 = (b_big * g_big_sq - b_small * g_small_sq) / (b_big - b_small)
    trace = (g_small_sq - g_big_sq) / (1.0 / b_small - 1.0 / b_big)
    return g2, trace


def b_simple(g_small_sq: list[float], g_big_sq: list[float], b_small: float, b_big: float, ema: float = 0.9) -> dict:
    """EMA-smoothed ``B_simple`` over a series of steps (bias-corrected EMAs)."""
    if len(g_small_sq) != len(g_big_sq):
        raise ValueError(f"need equal series, got {len(g_small_sq)} and {len(g_big_sq)}")
    # Steps skipped by fp16 loss scaling (inf/NaN gradients) carry no information.
    pairs = [(s, b) for s, b in zip(g_small_sq, g_big_sq) if math.isfinite(s) and math.isfinite(b)]
    if not pairs:
        raise ValueError("need at least one step with finite gradient norms")
    g_small_sq, g_big_sq = [p[0] for p in pairs], [p[1] for p in pairs]
    e_g2 = e_tr = 0.0
    for s, b in zip(g_small_sq, g_big_sq):
        g2, tr = two_batch_estimates(s, b, b_small, b_big)
        e_g2 = ema * e_g2 + (1 - ema) * g2
        e_tr = ema * e_tr + (1 - ema) * tr
    corr = 1 - ema ** len(g_small_sq)
    g2_hat, tr_hat = e_g2 / corr, e_tr / corr
    value = tr_hat / g2_hat if g2_hat > 0 else None
    return {
        "b_simple": value,
        "grad_sq_norm": g2_hat,
        "trace_sigma": tr_hat,
        "b_small": b_small,
        "b_big": b_big,
        "unit": "sequences",
        "ema": ema,
        "reason": None if value is not None else "estimated |G|^2 <= 0: too few steps or too noisy",
    }


@dataclass
class LocalGradNorm:
    """DDP comm-hook state: squared norm of this rank's gradient before the all-reduce."""

    process_group: dist.ProcessGroup
    sq: torch.Tensor | None = None
    history: list[float] = field(default_factory=list)

    def take(self, scale: float = 1.0) -> None:
        """Close a step: store the local squared norm, undoing a loss scale (fp16) if any."""
        self.history.append(float(self.sq) / scale**2 if self.sq is not None else float("nan"))
        self.sq = None


def local_norm_allreduce_hook(state: LocalGradNorm, bucket):
    """Record the local squared gradient norm of the bucket, then average as DDP's default does."""
    # a norm, not pow(2).sum(): no bucket-sized temporary (up to DDP's 25 MiB cap) beside the gradients at their peak
    sq = torch.linalg.vector_norm(bucket.buffer().detach(), dtype=torch.float32) ** 2
    state.sq = sq if state.sq is None else state.sq + sq
    return allreduce_hook(state.process_group, bucket)


def grad_sq_norm(params) -> float:
    total = 0.0
    for p in params:
        if p.grad is not None:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            total += float(g.detach().float().pow(2).sum())
    return total
