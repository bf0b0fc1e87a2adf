"""A module tree built on the meta device for its shapes alone, without its initialisers' cost.

A meta tensor holds no values, so initialising one changes nothing; but some in-place ops' meta kernels are written
in Python (``normal_``, what ``nn.Embedding`` and the models' ``reset_parameters`` call; ``erfinv_`` and ``clamp_``,
what ``trunc_normal_`` calls), and the first of them imports torch's decompositions and dynamo: 1.1-1.6 s of a
CLI's start-up on this CPU, measured per op in a fresh process (``uniform_``, ``zero_`` and ``fill_`` are C++ and
free). :func:`on_meta` skips the in-place ops that only write values (:data:`VALUE_ONLY`: what ``nn.init`` calls)
on a meta tensor, so no initialiser pays it; an op that changes a tensor's shape or flags runs as it would.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

VALUE_ONLY = frozenset({"normal_", "uniform_", "trunc_normal_", "erfinv_", "clamp_", "clamp_min_", "clamp_max_", "mul_",
                        "add_", "sub_", "div_", "fill_", "zero_", "copy_", "exponential_", "bernoulli_",
                        "log_normal_", "random_"})
"""In-place ops that write a tensor's values and keep its shape, dtype and device: the initialisers' ops."""


class _NoValuesOnMeta(TorchFunctionMode):
    """Returns a meta tensor as it is from an op of :data:`VALUE_ONLY` (there are no values to write)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        target = args[0] if args else (kwargs or {}).get("tensor")  # nn.init's functions pass it by name
        if getattr(func, "__name__", "") in VALUE_ONLY and isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **(kwargs or {}))


@contextmanager
def on_meta() -> Iterator[None]:
    """Build modules inside on the meta device, their parameters' shapes and dtypes as the real build's, with no
    initialiser run (a meta tensor has no values to initialise)."""
    with torch.device("meta"), _NoValuesOnMeta():
        yield
