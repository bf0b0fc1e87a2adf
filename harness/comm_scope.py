"""A label for the collectives issued inside a scope, read by the comm counter.

Context parallel's K/V gathers are ``c10d`` all-gathers and reduce-scatters like FSDP's; the code that
issues them wraps the call in ``with comm_label("cp"):`` and
:class:`harness.measure.comm_counter.CommCounter` files the call under that label too. A plain module
global, not a thread-local: autograd may run a backward on its own thread (CUDA), and the call it
wraps is synchronous within the scope.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_current: list[str] = []


@contextlib.contextmanager
def comm_label(name: str) -> Iterator[None]:
    _current.append(name)
    try:
        yield
    finally:
        _current.pop()


def current_label() -> str | None:
    """The innermost label in force, or None."""
    return _current[-1] if _current else None
