"""NVTX ranges for the training loop, one domain ``harness`` with a category per phase.

Phases: ``step`` (payload = step index), ``data``, ``forward``, ``backward``, ``optimizer``,
``microbatch`` (pipeline microbatches) and ``window`` (the measured window). Each step also gets
a ``train_step_<n>`` range (``train_step``, category ``step``): step boundaries by message, which
tools that split a timeline into iterations by range name (nsys ``nvtx_sum`` / ``--capture-range``
by name, HTA-style iteration detection) recognise without reading payloads.

Cost model (the reason for the shape of this class):

* Attribute objects (``nvtx.EventAttributes``: registered message, colour, category) are
  built ONCE per phase at construction; a payload range reuses a second per-phase object
  whose ``payload`` field is overwritten before the call (``nvtxDomainRangeStartEx``
  copies the struct, so the next overwrite cannot alter a range already started).
* ``Ranges(enabled=False)`` never touches ``nvtx``; every method returns after one
  attribute test (~50-100 ns), the context manager is a shared no-op object.
* With no NVTX tool attached (no ``nsys``), ``nvtx.get_domain`` returns a dummy domain;
  the ranges then skip the NVTX calls the same way (``tool_attached`` is False).
* A tool attached (``NVTX_INJECTION64_PATH`` set) that does not answer nvtx >= 0.2.12's
  ``nvtxDomainIsEnabled`` query (Nsight Systems 2022.4) also gets a dummy domain from
  ``nvtx.get_domain``; the domain is then opened without the query (``nvtx_domain``), so
  the ranges reach old and current nsys alike.
* Without the ``nvtx`` package (a bare torch environment) ranges go through
  ``torch.cuda.nvtx`` on CUDA builds: default domain, message ``harness:<phase>[ <payload>]``,
  no categories. ``backend`` and ``reason`` say which path ran, for the record.

Two kinds of range:

* ``push``/``pop``: NVTX push/pop ranges, which are per thread by definition; use them for
  phases that begin and end on the same (main) thread.
* ``start``/``end`` and the ``range`` context manager: process-wide start/end ranges, which
  may end on another thread. Backward must use these: autograd runs backward functions on
  its own device threads.

``window_start``/``window_stop`` also bracket the measured steps with
``cudaProfilerStart/Stop`` so ``nsys profile --capture-range=cudaProfilerApi`` records
only measured steps.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType
from typing import Any

import torch
from torch.profiler import record_function

from harness.measure.nvtx_domain import is_dummy_domain, open_domain
from harness.measure.step_composition import PHASE_PREFIX

DOMAIN_NAME = "harness"
STEP_RANGE_PREFIX = "train_step_"
PHASES: tuple[str, ...] = ("step", "data", "forward", "backward", "optimizer", "microbatch", "window",
                           "dispatch", "experts", "combine", "checkpoint")
"""``dispatch``, ``experts``, ``combine``: inside each MoE layer's forward (:class:`workloads.moe.MoE`, attached by
:class:`harness.parallel.expert_load.ExpertLoad`); ``checkpoint``: a save's blocking part, after its step
(:mod:`harness.run.checkpoint`)."""
PHASE_COLORS: dict[str, int] = {
    # ARGB; distinct hues so phases read apart on the nsys timeline.
    "step": 0xFF4C72B0,
    "data": 0xFF8C8C8C,
    "forward": 0xFF55A868,
    "backward": 0xFFC44E52,
    "optimizer": 0xFF8172B2,
    "microbatch": 0xFFCCB974,
    "window": 0xFF64B5CD,
    "dispatch": 0xFFDD8452,
    "experts": 0xFF937860,
    "combine": 0xFFDA8BC3,
    "checkpoint": 0xFF2CA02C,
}


def _unknown_phase(phase: str) -> ValueError:
    return ValueError(f"unknown NVTX phase {phase!r}; choose one of {', '.join(PHASES)}")


class _NullRange:
    """Shared context manager for disabled ranges: no state, no calls."""

    __slots__ = ()

    def __enter__(self) -> _NullRange:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None


_NULL_RANGE = _NullRange()


class _Range:
    """Context manager over ``Ranges.start``/``Ranges.end`` (process-wide range)."""

    __slots__ = ("_ranges", "_phase", "_payload", "_handle")

    def __init__(self, ranges: Ranges, phase: str, payload: int | float | None) -> None:
        self._ranges = ranges
        self._phase = phase
        self._payload = payload
        self._handle = 0

    def __enter__(self) -> _Range:
        self._handle = self._ranges.start(self._phase, self._payload)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._ranges.end(self._handle)


class _StepRange(_Range):
    """Context manager for one ``train_step_<n>`` range (the payload is the step): its message is
    registered once per step."""

    __slots__ = ()

    def __enter__(self) -> _StepRange:
        assert self._payload is not None, "a step range's payload is its step"
        self._handle = self._ranges.start_step(int(self._payload))
        return self


class Ranges:
    """NVTX ranges of the training loop; a no-op when ``enabled`` is False.

    Args:
        enabled: emit NVTX ranges and the cudaProfiler window. When False no ``nvtx``
            function is called at all.
        domain_name: NVTX domain; the harness uses ``harness``.

    Payload ranges (``payload=...``) share one attribute object per phase, so they must
    come from one thread at a time per phase (the step loop); payload-free ranges may be
    used from any thread.
    """

    def __init__(self, enabled: bool, domain_name: str = DOMAIN_NAME) -> None:
        self._enabled = bool(enabled)
        self._live = False
        self._backend = "none"
        self._reason: str | None = "disabled"
        self._domain: Any = None
        self._attrs: dict[str, Any] = {}
        self._payload_attrs: dict[str, Any] = {}
        self._local = threading.local()
        self._window_handle: int | None = None
        if not self._enabled:
            return
        self._domain, self._backend, self._reason = open_domain(domain_name)
        self._live = self._domain is not None and not is_dummy_domain(self._domain)
        if self._live:
            self._attrs = {phase: self._build_attrs(phase, None) for phase in PHASES}

    @property
    def enabled(self) -> bool:
        """Whether ranges and the profiler window are emitted."""
        return self._enabled

    @property
    def tool_attached(self) -> bool:
        """Whether NVTX calls are made: an nvtx tool (e.g. nsys) is attached, or the torch
        backend is in use (it cannot tell, so it always calls)."""
        return self._live

    @property
    def backend(self) -> str:
        """``nvtx`` | ``nvtx (domain opened without asking the tool)`` | ``torch.cuda.nvtx`` | ``none``."""
        return self._backend

    @property
    def reason(self) -> str | None:
        """Why ranges are not recorded (or recorded without domain/categories); None if fully on."""
        return self._reason

    def describe(self) -> dict[str, Any]:
        """For the record: whether ranges were emitted, through which backend, and why not if not."""
        return {"enabled": self._enabled, "tool_attached": self._live, "backend": self._backend,
                "reason": self._reason}

    def _build_attrs(self, phase: str, payload: int | float | None) -> Any:
        # A string category registers its name with nvtxDomainNameCategory once per domain.
        return self._domain.get_event_attributes(
            message=phase, color=PHASE_COLORS[phase], category=phase, payload=payload
        )

    def _attrs_for(self, phase: str, payload: int | float | None) -> Any:
        if payload is None:
            try:
                return self._attrs[phase]
            except KeyError:
                raise _unknown_phase(phase) from None
        attrs = self._payload_attrs.get(phase)
        if attrs is None:
            if phase not in PHASE_COLORS:
                raise _unknown_phase(phase)
            attrs = self._build_attrs(phase, payload)
            self._payload_attrs[phase] = attrs
        else:
            attrs.payload = payload
        return attrs

    def push(self, phase: str, payload: int | float | None = None) -> None:
        """Push a per-thread range (``nvtxDomainRangePushEx``); close it with ``pop``."""
        if not self._live:
            return
        self._domain.push_range(self._attrs_for(phase, payload))
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        stack.append(phase)

    def pop(self) -> None:
        """Pop the innermost range this thread pushed."""
        if not self._live:
            return
        stack = getattr(self._local, "stack", None)
        if not stack:
            raise RuntimeError(
                f"Ranges.pop() on thread {threading.current_thread().name!r} without a "
                "matching push(); push/pop ranges are per thread, use start/end across threads"
            )
        stack.pop()
        self._domain.pop_range()

    def start(self, phase: str, payload: int | float | None = None) -> int:
        """Start a process-wide range (``nvtxDomainRangeStartEx``); returns its handle."""
        if not self._live:
            return 0
        return self._domain.start_range(self._attrs_for(phase, payload))

    def end(self, handle: int) -> None:
        """End the range ``handle`` returned by ``start``, from any thread."""
        if not self._live:
            return
        self._domain.end_range(handle)

    def range(self, phase: str, payload: int | float | None = None) -> _Range | _NullRange:
        """Context manager for a process-wide range: ``with ranges.range("forward"): ...``."""
        if not self._live:
            return _NULL_RANGE
        return _Range(self, phase, payload)

    def start_step(self, step: int) -> int:
        """Start the process-wide ``train_step_<step>`` range; returns its handle for ``end``."""
        if not self._live:
            return 0
        attrs = self._domain.get_event_attributes(
            message=f"{STEP_RANGE_PREFIX}{step}", color=PHASE_COLORS["step"], category="step"
        )
        return self._domain.start_range(attrs)

    def train_step(self, step: int) -> _StepRange | _NullRange:
        """Context manager for the ``train_step_<step>`` range (beside the ``step`` phase range)."""
        if not self._live:
            return _NULL_RANGE
        return _StepRange(self, "step", step)

    def window_start(self, rank: int | None = None) -> None:
        """Open the measured window: cudaProfilerStart (CUDA only), then a ``window`` range whose
        payload is ``rank`` (which process of a report holding several ranks is which)."""
        if not self._enabled:
            return
        if torch.cuda.is_available():
            torch.cuda.profiler.start()
        self._window_handle = self.start("window", payload=rank)

    def window_stop(self) -> None:
        """Close the measured window opened by ``window_start``."""
        if not self._enabled:
            return
        if self._window_handle is not None:
            self.end(self._window_handle)
            self._window_handle = None
        if torch.cuda.is_available():
            torch.cuda.profiler.stop()


class PhaseAnnotations:
    """Wraps the NVTX ``Ranges`` of the step so profiled steps also carry ``harness:<phase>``
    profiler annotations (``record_function``), which :func:`harness.measure.step_composition.compose_rank` reads.

    Used only for the extra profiled steps after the measured window: timed steps never pay
    for an annotation.
    """

    def __init__(self, ranges: Any) -> None:
        self._ranges = ranges

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ranges, name)

    def range(self, phase: str, payload: int | float | None = None) -> _Both:
        return _Both(self._ranges.range(phase, payload), record_function(f"{PHASE_PREFIX}{phase}"))


class _Both:
    """Enters two context managers, leaves them in reverse order."""

    __slots__ = ("_outer", "_inner")

    def __init__(self, outer: Any, inner: Any) -> None:
        self._outer, self._inner = outer, inner

    def __enter__(self) -> _Both:
        self._outer.__enter__()
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._inner.__exit__(*exc)
        self._outer.__exit__(*exc)


def range_overhead_ns(enabled: bool, n: int = 100_000) -> float:
    """Mean cost in ns of one ``start``/``end`` range pair (``forward`` phase), ``n`` pairs.

    Used by the micro-benchmark tier; tests never assert on its value.
    """
    if n < 1:
        raise ValueError(f"n ({n}) must be >= 1; e.g. n=100000")
    ranges = Ranges(enabled)
    start, end = ranges.start, ranges.end
    t0 = time.perf_counter_ns()
    for _ in range(n):
        end(start("forward"))
    return (time.perf_counter_ns() - t0) / n
