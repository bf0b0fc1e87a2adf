"""Test-only slowdowns for `harness diff`'s attribution: never imported by the harness itself.

On PYTHONPATH, every rank process (``-m harness.run.worker``, or the fork server whose forked ranks
inherit the wrap, ``-m harness.run.fork_server``) wraps ``harness.run.train.train_step``:

* ``HARNESS_TEST_OPTIMIZER_SLEEP_S=S``: the optimizer's ``step`` sleeps S seconds after its update
  (inside the optimizer step, as a slower optimizer would be);
* ``HARNESS_TEST_EXTRA_ALLREDUCE_MIB=M``: each training step ends with one extra ``all_reduce`` of
  M MiB of fp32 over the default process group (a collective a slower commit would add).

Either may be set alone; neither set changes nothing.
"""

import os


def _install() -> None:
    sleep_s = float(os.environ.get("HARNESS_TEST_OPTIMIZER_SLEEP_S", "0"))
    extra_mib = float(os.environ.get("HARNESS_TEST_EXTRA_ALLREDUCE_MIB", "0"))
    with open("/proc/self/cmdline", "rb") as f:
        argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    if (sleep_s <= 0 and extra_mib <= 0) or not {"harness.run.worker", "harness.run.fork_server"} & set(argv):
        return
    import time

    import torch
    import torch.distributed as dist

    import harness.run.train as train

    original = train.train_step
    patched: set[int] = set()
    extra = torch.zeros(int(extra_mib * 2**20 / 4)) if extra_mib > 0 else None

    def slow_optimizer(step):
        def step_then_sleep(*args, **kwargs):
            out = step(*args, **kwargs)
            time.sleep(sleep_s)
            return out
        return step_then_sleep

    def slower_step(ctx, x, y, lr):
        if sleep_s > 0 and id(ctx.optimizer) not in patched:
            ctx.optimizer.step = slow_optimizer(ctx.optimizer.step)
            patched.add(id(ctx.optimizer))
        out = original(ctx, x, y, lr)
        if extra is not None:
            dist.all_reduce(extra)
        return out

    train.train_step = slower_step


_install()
