"""Test-only slowdown for the regression-gate e2e test: never imported by the harness itself.

With ``HARNESS_TEST_EXTRA_FORWARDS=N`` set, every rank process (``-m harness.run.worker``) wraps
``harness.run.train.train_step`` so each step also runs N extra no-grad forward passes of the
model on its batch: real extra work in the training step, as a slower commit would add.
"""

import os


def _install() -> None:
    n = int(os.environ.get("HARNESS_TEST_EXTRA_FORWARDS", "0"))
    with open("/proc/self/cmdline", "rb") as f:
        argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    if n <= 0 or "harness.run.worker" not in argv:
        return
    import torch

    import harness.run.train as train

    original = train.train_step

    def slower_step(ctx, x, y, lr):
        out = original(ctx, x, y, lr)
        with torch.no_grad():
            for _ in range(n):
                ctx.par.model(x)
        return out

    train.train_step = slower_step


_install()
