"""NVTX ranges: enabled/disabled paths on CPU, attribute caching, window without CUDA."""

from __future__ import annotations

import threading
from typing import Any

import nvtx
import pytest
import torch

from harness.measure import nvtx_domain, nvtx_ranges
from harness.measure.nvtx_ranges import PHASES, Ranges, range_overhead_ns


class FakeAttrs:
    def __init__(self, message: str, color: int, category: str, payload: Any) -> None:
        self.message, self.color, self.category, self.payload = message, color, category, payload


class FakeDomain:
    """Records every call the way a live NVTX domain (tool attached) would receive them."""

    def __init__(self) -> None:
        self.built: list[tuple[str, Any]] = []
        self.calls: list[tuple[str, Any]] = []
        self._next_id = 100

    def get_event_attributes(self, message: str, color: int, category: str, payload: Any = None) -> FakeAttrs:
        self.built.append((message, payload))
        return FakeAttrs(message, color, category, payload)

    def push_range(self, attrs: FakeAttrs) -> None:
        self.calls.append(("push", attrs.message))

    def pop_range(self) -> None:
        self.calls.append(("pop", None))

    def start_range(self, attrs: FakeAttrs) -> int:
        self._next_id += 1
        self.calls.append(("start", (attrs.message, attrs.payload, attrs.category)))
        return self._next_id

    def end_range(self, handle: int) -> None:
        self.calls.append(("end", handle))


@pytest.fixture
def fake_domain(monkeypatch: pytest.MonkeyPatch) -> FakeDomain:
    domain = FakeDomain()
    monkeypatch.setattr(nvtx, "get_domain", lambda name: domain)
    return domain


def test_disabled_makes_no_nvtx_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("disabled Ranges must not call nvtx")

    monkeypatch.setattr(nvtx, "get_domain", forbidden)
    monkeypatch.setattr(torch.cuda.profiler, "start", forbidden)
    monkeypatch.setattr(torch.cuda.profiler, "stop", forbidden)
    ranges = Ranges(enabled=False)
    assert not ranges.enabled and not ranges.tool_attached
    ranges.push("forward")
    ranges.pop()
    assert ranges.start("step", payload=3) == 0
    ranges.end(0)
    first, second = ranges.range("backward"), ranges.range("data")
    assert first is second  # one shared no-op object, nothing allocated per call
    with first:
        pass
    ranges.window_start()
    ranges.window_stop()


def test_enabled_without_tool_runs_on_cpu() -> None:
    # Real nvtx, no profiler attached: the domain is nvtx's dummy and every call is a no-op.
    ranges = Ranges(enabled=True)
    assert ranges.enabled and ranges.backend == "nvtx"
    assert ranges.reason == "no NVTX tool attached (run under nsys to record ranges)"
    for step in range(3):
        with ranges.range("step", payload=step):
            ranges.push("forward")
            ranges.pop()
            ranges.end(ranges.start("backward"))
    ranges.window_start()
    ranges.window_stop()


def test_a_tool_that_disables_the_domain_still_gets_the_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvtx >= 0.2.12 returns its dummy domain when the attached tool does not answer
    nvtxDomainIsEnabled (Nsight Systems 2022.4): with a tool named in the environment the domain is
    opened without the query, so the ranges reach it (the real capture: tests/nsys)."""
    monkeypatch.delenv("NVTX_INJECTION64_PATH", raising=False)
    monkeypatch.delenv("NVTX_INJECTION32_PATH", raising=False)
    assert not nvtx_domain.tool_injected()
    monkeypatch.setenv("NVTX_INJECTION64_PATH", "/nonexistent/libToolsInjection64.so")
    assert nvtx_domain.tool_injected()
    ranges = Ranges(enabled=True)
    assert ranges.backend == nvtx_domain.UNQUERIED_BACKEND and ranges.reason is None and ranges.tool_attached
    assert type(ranges._domain).__name__ == "Domain"  # the package's real domain, not its dummy
    ranges.window_start(rank=3)  # calls into NVTX, which has no tool loaded here: no-ops, no error
    with ranges.range("step", payload=0):
        ranges.end(ranges.start("forward"))
    ranges.window_stop()
    assert ranges.describe() == {"enabled": True, "tool_attached": True, "backend": nvtx_domain.UNQUERIED_BACKEND,
                                 "reason": None}


def test_the_window_payload_is_the_rank(fake_domain: FakeDomain) -> None:
    ranges = Ranges(enabled=True)
    ranges.window_start(rank=5)
    assert fake_domain.calls[-1] == ("start", ("window", 5, "window"))


def test_attributes_built_once_per_phase(fake_domain: FakeDomain) -> None:
    ranges = Ranges(enabled=True)
    assert ranges.tool_attached
    assert [m for m, _ in fake_domain.built] == list(PHASES)
    for step in range(5):
        with ranges.range("step", payload=step):
            with ranges.range("forward"):
                pass
    # One payload object for "step", built on first use; later steps only overwrite payload.
    assert fake_domain.built[len(PHASES):] == [("step", 0)]
    starts = [args for kind, args in fake_domain.calls if kind == "start" and args[0] == "step"]
    assert [payload for _, payload, _ in starts] == [0, 1, 2, 3, 4]
    assert all(category == "step" for _, _, category in starts)


def test_start_end_pairs_and_push_pop(fake_domain: FakeDomain) -> None:
    ranges = Ranges(enabled=True)
    handle = ranges.start("backward")
    ranges.push("optimizer")
    ranges.pop()
    ranges.end(handle)
    assert fake_domain.calls == [
        ("start", ("backward", None, "backward")),
        ("push", "optimizer"),
        ("pop", None),
        ("end", handle),
    ]


def test_end_from_another_thread(fake_domain: FakeDomain) -> None:
    ranges = Ranges(enabled=True)
    handle = ranges.start("backward")
    worker = threading.Thread(target=ranges.end, args=(handle,))
    worker.start()
    worker.join()
    assert ("end", handle) in fake_domain.calls


def test_pop_without_push_names_the_fix(fake_domain: FakeDomain) -> None:
    ranges = Ranges(enabled=True)
    with pytest.raises(RuntimeError, match="without a matching push"):
        ranges.pop()


def test_unknown_phase_lists_choices(fake_domain: FakeDomain) -> None:
    ranges = Ranges(enabled=True)
    with pytest.raises(ValueError, match="unknown NVTX phase 'forwrd'; choose one of step, data"):
        ranges.start("forwrd")
    with pytest.raises(ValueError, match="unknown NVTX phase 'forwrd'"):
        ranges.start("forwrd", payload=1)


def test_window_is_noop_without_cuda(monkeypatch: pytest.MonkeyPatch, fake_domain: FakeDomain) -> None:
    def forbidden() -> None:
        raise AssertionError("cudaProfilerStart/Stop must not be called without CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda.profiler, "start", forbidden)
    monkeypatch.setattr(torch.cuda.profiler, "stop", forbidden)
    ranges = Ranges(enabled=True)
    ranges.window_start()
    ranges.window_stop()
    kinds = [kind for kind, _ in fake_domain.calls]
    assert kinds == ["start", "end"]  # the window range itself is still emitted


def test_window_calls_cuda_profiler_when_available(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: calls.append("start"))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: calls.append("stop"))
    ranges = Ranges(enabled=True)
    ranges.window_start()
    ranges.window_stop()
    assert calls == ["start", "stop"]


def test_without_nvtx_package_uses_torch_cuda_nvtx(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(nvtx_domain, "nvtx", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: None)
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: None)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda msg: calls.append(("push", msg)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop", None)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_start", lambda msg: calls.append(("start", msg)) or 7)
    monkeypatch.setattr(torch.cuda.nvtx, "range_end", lambda handle: calls.append(("end", handle)))
    ranges = Ranges(enabled=True)
    assert ranges.backend == "torch.cuda.nvtx" and "nvtx package not importable" in ranges.reason
    for step in (0, 1):
        with ranges.range("step", payload=step):
            ranges.push("forward")
            ranges.pop()
    assert calls == [
        ("start", "harness:step 0"), ("push", "harness:forward"), ("pop", None), ("end", 7),
        ("start", "harness:step 1"), ("push", "harness:forward"), ("pop", None), ("end", 7),
    ]


def test_without_nvtx_or_cuda_ranges_are_noops_with_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvtx_domain, "nvtx", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ranges = Ranges(enabled=True)
    assert ranges.backend == "none" and not ranges.tool_attached
    assert "torch has no CUDA" in ranges.reason
    assert ranges.start("step", payload=1) == 0
    ranges.window_start()
    ranges.window_stop()


def test_range_overhead_helper_returns_positive_ns() -> None:
    assert range_overhead_ns(False, n=1000) > 0
    assert range_overhead_ns(True, n=1000) > 0
    with pytest.raises(ValueError, match="n \\(0\\) must be >= 1"):
        range_overhead_ns(True, n=0)


def test_module_exports_domain_name() -> None:
    assert nvtx_ranges.DOMAIN_NAME == "harness"
