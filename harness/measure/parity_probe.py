"""What one optimizer step did to the model, in numbers that can be compared across strategies.

Loss parity cannot see a wrong gradient scale: AdamW normalises its update by the gradient's
own magnitude, so gradients doubled by a sum-instead-of-mean reduction move the loss curve by
about 1e-6. The gradient norm after the first step sees it at once (x2), and the norm of every
parameter tensor after the first update sees a tensor that was not updated, or updated wrongly.

Each rank reports, per parameter name, the squared norms of the *full* tensor (a DTensor shard
or TP slice is gathered with ``full_tensor()``), so the numbers mean the same under every
strategy. Rank 0 merges the ranks' reports by name (pipeline stages hold different names,
replicas the same ones) with :func:`merge`. Gathering costs collectives, so the worker probes
once, after the first step's timer has stopped.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import nn


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


NEAR_EPS = 1e-6
"""A gradient element this small (100 x AdamW's eps) gets an update ``g / (|g| + eps)`` that the rounding of ``g``
moves: where it comes out of cancelling terms (a bias shifted alike at every position, as RoPE's slowest pairs leave
a key bias), its sign and size are rounding noise, and so is that element's first Adam step."""


def _sq(t: torch.Tensor | None) -> float | None:
    if t is None:
        return None
    return float(_full(t.detach()).double().pow(2).sum())


def _near_eps(g: torch.Tensor | None) -> float | None:
    """The share of ``g``'s elements below :data:`NEAR_EPS` in magnitude."""
    if g is None:
        return None
    full = _full(g.detach())
    return float((full.abs() < NEAR_EPS).sum()) / max(1, full.numel())


def tensor_sq_norms(parts: list[nn.Module]) -> dict[str, list[float | None]]:
    """``{name: [||param||^2, ||grad||^2 or None, share of grad elements near Adam's eps or None]}`` of every
    parameter this rank holds.

    Every rank of a DTensor's mesh must call this (the gather is a collective); parts and their
    parameters are walked in module order, which is the same on every rank of that mesh.
    """
    out: dict[str, list[float | None]] = {}
    for part in parts:
        for name, p in part.named_parameters():
            if name not in out:
                out[name] = [_sq(p), _sq(p.grad), _near_eps(p.grad)]
    return out


def merge(per_rank: list[dict[str, list[float | None]]]) -> dict:
    """One model's numbers from every rank's report: the global ``grad_norm`` and ``param_norm``,
    and per tensor ``param_norms``, ``grad_norms`` and ``grad_near_eps`` (the share of its gradient's elements
    below :data:`NEAR_EPS`).

    A name held by several ranks (data-parallel replicas, TP ranks after the gather) is taken
    from the lowest rank. ``grad_norm`` is None when some parameter had no gradient.
    """
    names: dict[str, list[float | None]] = {}
    for report in per_rank:
        for name, v in report.items():
            names.setdefault(name, v)
    params = {name: cast(float, v[0]) for name, v in names.items()}  # a parameter always has its norm
    grads = [v[1] for v in names.values()]
    present = [g for g in grads if g is not None]
    grad_norm = math.sqrt(sum(present)) if grads and len(present) == len(grads) else None
    return {"grad_norm": grad_norm,
            "param_norm": math.sqrt(sum(params.values())),
            "param_norms": {name: math.sqrt(params[name]) for name in sorted(params)},
            "grad_norms": {name: None if v[1] is None else math.sqrt(v[1]) for name, v in sorted(names.items())},
            "grad_near_eps": {name: v[2] for name, v in sorted(names.items()) if len(v) > 2 and v[2]}}
