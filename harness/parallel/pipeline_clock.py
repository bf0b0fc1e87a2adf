"""Each pipeline rank's step split into what it does: forward, backward (whole, or its input- and weight-gradient
parts under a zero-bubble schedule), the gradient reduce, waiting on transfers, and the rest.

torch's schedules run a rank's actions as calls on its ``PipelineStage`` objects (``forward_one_chunk``,
``backward_one_chunk`` with ``full_backward`` False for the input-gradient part, ``backward_weight_one_chunk``,
``perform_reduce_grad``) and wait for each batch of sends and receives in
``torch.distributed.pipelining.schedules._wait_batch_p2p``. :func:`attach` times those calls on this rank's stages
and the waits, so a step's time splits into them and what is left (the schedule's own bookkeeping and posting
the transfers). Wall-clock seconds on the host: on a GPU the calls return before their kernels finish, so the
split is a CPU rank's measurement only (the worker records it there).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from typing import Any

from torch.distributed.pipelining import schedules as _schedules

from harness.parallel.schedules import STAGE_ACTIONS as ACTIONS


class ActionClock:
    """Seconds spent in each of :data:`ACTIONS` since the last :meth:`lap`."""

    def __init__(self) -> None:
        self._spent = dict.fromkeys(ACTIONS, 0.0)

    def charge(self, action: str, seconds: float) -> None:
        self._spent[action] += seconds

    def timed(self, action: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` with its wall time charged to ``action``."""
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.charge(action, time.perf_counter() - t0)
        return run

    def lap(self) -> dict[str, float]:
        """The seconds of each action since the last lap (a step's, when called after each step); restarts."""
        out, self._spent = self._spent, dict.fromkeys(ACTIONS, 0.0)
        return out


_ACTIVE: list[ActionClock] = []
"""The clock the waits are charged to: the last pipeline built in this process (a rank builds one)."""


def _timed_wait(wait: Callable[..., Any]) -> Callable[..., Any]:
    """``_wait_batch_p2p``, charged to the active clock's ``p2p_wait`` (inside the measured step: no wrapper is
    built per call)."""
    @functools.wraps(wait)
    def run(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return wait(*args, **kwargs)
        finally:
            if _ACTIVE:
                _ACTIVE[-1].charge("p2p_wait", time.perf_counter() - t0)
    run.__harness_timed__ = True  # type: ignore[attr-defined]
    return run


def _backward(clock: ActionClock, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``backward_one_chunk``: charged to ``backward`` when whole, ``backward_input`` when only its input part."""
    @functools.wraps(fn)
    def run(*args: Any, full_backward: bool = True, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, full_backward=full_backward, **kwargs)
        finally:
            clock.charge("backward" if full_backward else "backward_input", time.perf_counter() - t0)
    return run


def attach(stages: Iterable[Any]) -> ActionClock:
    """Time every action of ``stages`` (this rank's ``PipelineStage`` objects) and the schedule's waits."""
    clock = ActionClock()
    for stage in stages:
        stage.forward_one_chunk = clock.timed("forward", stage.forward_one_chunk)
        stage.backward_one_chunk = _backward(clock, stage.backward_one_chunk)
        stage.backward_weight_one_chunk = clock.timed("backward_weight", stage.backward_weight_one_chunk)
        stage.perform_reduce_grad = clock.timed("reduce_grad", stage.perform_reduce_grad)
    if not getattr(_schedules._wait_batch_p2p, "__harness_timed__", False):
        _schedules._wait_batch_p2p = _timed_wait(_schedules._wait_batch_p2p)
    _ACTIVE[:] = [clock]
    return clock
