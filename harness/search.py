"""The largest integer that passes a monotone test: doubling, then bisection.

Used for ``harness fit --batch auto`` (the largest micro-batch that fits a memory budget); the
test is any ``fits(n) -> bool`` that is true up to some n and false beyond it. Each probe
may be expensive (a measured run), so it costs ``2 log2(answer) + 1`` probes at most, and
never probes a value twice.
"""

from __future__ import annotations

from collections.abc import Callable


def largest_passing(fits: Callable[[int], bool], start: int = 1, limit: int = 1 << 16) -> int | None:
    """The largest ``n`` in ``[start, limit]`` with ``fits(n)``, assuming ``fits`` is monotone
    (true, then false); None when ``fits(start)`` is false.

    ``start, 2 start, 4 start, ...`` until a failure (or ``limit``), then bisection between the
    last pass and the first failure.
    """
    if start < 1 or limit < start:
        raise ValueError(f"need 1 <= start ({start}) <= limit ({limit})")
    if not fits(start):
        return None
    lo, hi = start, None  # lo passes; hi (when known) fails
    while hi is None:
        nxt = min(lo * 2, limit)
        if nxt == lo:
            return lo
        if fits(nxt):
            lo = nxt
        else:
            hi = nxt
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
