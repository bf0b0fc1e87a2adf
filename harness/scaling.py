"""Batch-size and learning-rate scaling rules.

* strong scaling: the global batch is fixed, so more devices means less work per device;
* weak scaling: the per-device batch is fixed, so the global batch grows with the device count.

LR rules, relative to ``base_lr`` at ``base_batch`` sequences:
``none``: ``lr = base_lr``; ``linear``: ``lr = base_lr * B / base_batch`` (Goyal et al. 2017);
``sqrt``: ``lr = base_lr * sqrt(B / base_batch)`` (Krizhevsky 2014; Hoffer et al. 2017).
Warmup: linear from ``lr / warmup`` to ``lr`` over ``warmup`` steps (Goyal et al. 2017), then constant.
"""

from __future__ import annotations

import math

from harness.errors import UsageError

SCALINGS = ("strong", "weak")
LR_RULES = ("none", "linear", "sqrt")


def global_batch(scaling: str, batch: int, world: int) -> int:
    """Sequences per optimizer step: ``batch`` is global under strong, per device under weak scaling."""
    if scaling not in SCALINGS:
        raise UsageError(f"unknown scaling {scaling!r}; choose from {', '.join(SCALINGS)}")
    return batch if scaling == "strong" else batch * world


def scaled_lr(rule: str, base_lr: float, base_batch: int, batch: int) -> float:
    if rule not in LR_RULES:
        raise UsageError(f"unknown LR rule {rule!r}; choose from {', '.join(LR_RULES)}")
    if base_batch < 1:
        raise UsageError(f"--base-batch must be >= 1, got {base_batch}")
    ratio = batch / base_batch
    return base_lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]


def lr_at(step: int, lr: float, warmup_steps: int) -> float:
    """LR for 0-based ``step``: ``lr * (step + 1) / warmup_steps`` during warmup, ``lr`` after."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return lr
    return lr * (step + 1) / warmup_steps
