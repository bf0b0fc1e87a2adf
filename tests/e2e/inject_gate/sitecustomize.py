"""Test-only slowdown of a candidate checkout for the A/B gate: never imported by the harness itself.

Copied into the root of a candidate worktree, which the gate puts on that side's PYTHONPATH (so
Python imports it at start-up there, and only there). With ``HARNESS_TEST_SLOWDOWN=F`` it wraps
``harness.run.train.train_step`` so each step computes F times its own duration longer (a busy
wait: extra work on the CPU, as a slower commit would add). tests/e2e/test_gate.py puts its folder on
PYTHONPATH for its slower run.
"""

import os


def _install() -> None:
    fraction = float(os.environ.get("HARNESS_TEST_SLOWDOWN", "0"))
    if fraction <= 0:
        return
    import time

    import harness.run.train as train

    original = train.train_step

    def slower_step(ctx, x, y, lr):
        t0 = time.perf_counter()
        out = original(ctx, x, y, lr)
        end = time.perf_counter() + fraction * (time.perf_counter() - t0)
        while time.perf_counter() < end:
            pass
        return out

    train.train_step = slower_step


_install()
