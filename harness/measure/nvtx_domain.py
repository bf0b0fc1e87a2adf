"""Opening the NVTX domain the harness's ranges go to: the ``nvtx`` package's, ``torch.cuda.nvtx``
without it, or none; and, under a tool that disables the domain (Nsight Systems 2022.4 with
nvtx >= 0.2.12), the package's domain opened without asking the tool.

* With no NVTX tool attached (no ``nsys``), ``nvtx.get_domain`` returns a dummy domain;
  the ranges then skip the NVTX calls (``Ranges.tool_attached`` is False).
* A tool attached (``NVTX_INJECTION64_PATH`` set) that does not answer nvtx >= 0.2.12's
  ``nvtxDomainIsEnabled`` query also gets a dummy domain from ``nvtx.get_domain``; the domain is
  then opened without the query (``_unqueried_domain``), so the ranges reach old and current nsys.
* Without the ``nvtx`` package (a bare torch environment) ranges go through
  ``torch.cuda.nvtx`` on CUDA builds: default domain, message ``harness:<phase>[ <payload>]``,
  no categories.
"""

from __future__ import annotations

import os
from typing import Any

import torch

try:
    import nvtx
except ImportError as _exc:  # declared dependency; a bare torch env still gets ranges via torch
    nvtx = None
    _NVTX_IMPORT_ERROR: str | None = f"{type(_exc).__name__}: {_exc}"
else:
    _NVTX_IMPORT_ERROR = None


def is_dummy_domain(domain: Any) -> bool:
    """True for the stand-in domain nvtx returns when no tool (nsys) is attached."""
    if nvtx is None:
        return False
    dummy_cls = getattr(getattr(nvtx, "_lib", None), "DummyDomain", None)
    return dummy_cls is not None and isinstance(domain, dummy_cls)


class _TorchAttrs:
    """Message holder for the torch backend: phase and payload folded into the text."""

    __slots__ = ("_label", "_payload", "text")

    def __init__(self, domain_name: str, phase: str, payload: int | float | None) -> None:
        self._label = f"{domain_name}:{phase}"
        self.payload = payload

    @property
    def payload(self) -> int | float | None:
        return self._payload

    @payload.setter
    def payload(self, value: int | float | None) -> None:
        self._payload = value
        self.text = self._label if value is None else f"{self._label} {value}"


class _TorchNvtxDomain:
    """The subset of ``nvtx.Domain`` that ``Ranges`` uses, over ``torch.cuda.nvtx``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def get_event_attributes(self, message: str, color: int, category: str, payload: Any = None) -> _TorchAttrs:
        return _TorchAttrs(self.name, message, payload)

    def push_range(self, attrs: _TorchAttrs) -> None:
        torch.cuda.nvtx.range_push(attrs.text)

    def pop_range(self) -> None:
        torch.cuda.nvtx.range_pop()

    def start_range(self, attrs: _TorchAttrs) -> int:
        return int(torch.cuda.nvtx.range_start(attrs.text))

    def end_range(self, handle: int) -> None:
        torch.cuda.nvtx.range_end(handle)


INJECTION_ENV = ("NVTX_INJECTION64_PATH", "NVTX_INJECTION32_PATH")
"""Set by the tool that attaches to NVTX (nsys sets the 64-bit one in the profiled process)."""
UNQUERIED_BACKEND = "nvtx (domain opened without asking the tool)"


def tool_injected(environ: Any = None) -> bool:
    """Whether an NVTX tool library is named in the environment (the process runs under nsys or alike)."""
    env = os.environ if environ is None else environ
    return any(env.get(k) for k in INJECTION_ENV)


def _unqueried_domain(domain_name: str) -> Any:
    """An ``nvtx.Domain`` built without ``nvtxDomainIsEnabled``.

    nvtx >= 0.2.12 asks the attached tool whether each domain is enabled and, when the tool does
    not answer that query (Nsight Systems 2022.4 does not), hands back a no-op domain: every range
    silently vanishes. The ranges themselves use the NVTX calls every nsys release accepts, so the
    domain is opened as nvtx <= 0.2.11 did: the handle created, the query skipped.
    """
    lib = nvtx._lib.lib
    domain = object.__new__(lib.Domain)
    domain.handle = lib.DomainHandle(domain_name)
    lib.Domain.__init__(domain, domain_name)
    return domain


def open_domain(domain_name: str) -> tuple[Any, str, str | None]:
    """(domain, backend, reason): the nvtx domain, else torch.cuda.nvtx, else none."""
    if nvtx is not None:
        domain = nvtx.get_domain(domain_name)
        if not is_dummy_domain(domain):
            return domain, "nvtx", None
        if not tool_injected():
            return domain, "nvtx", "no NVTX tool attached (run under nsys to record ranges)"
        try:
            return _unqueried_domain(domain_name), UNQUERIED_BACKEND, None
        except (AttributeError, TypeError) as exc:  # the package's internals moved: say so, record nothing
            return domain, "nvtx", (f"the attached NVTX tool disabled domain {domain_name!r} and nvtx "
                                    f"{getattr(nvtx, '__version__', '?')} could not open it anyway ({exc}); "
                                    "pip install 'nvtx<0.2.12' or a newer Nsight Systems")
    if torch.cuda.is_available():
        return _TorchNvtxDomain(domain_name), "torch.cuda.nvtx", f"nvtx package not importable ({_NVTX_IMPORT_ERROR})"
    return None, "none", f"nvtx package not importable ({_NVTX_IMPORT_ERROR}) and torch has no CUDA"
