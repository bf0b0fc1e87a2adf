"""Test-only fault injection for the e2e tests: never imported by the harness itself.

The tests prepend this directory to PYTHONPATH of ``harness bench``; every process the sweep
starts inherits it and Python imports ``sitecustomize`` at start-up. A torchrun rank
(``-m harness.run.worker --cell ...``) or the sweep's fork server (``-m harness.run.fork_server``,
whose forked ranks inherit the wrap) gets ``harness.run.train.train_step`` wrapped; the cell and the
rank are read when a step runs (a forked rank's ``RANK`` and ``HARNESS_CELL_JSON`` are set after the
fork), and on call ``call`` (1 = first step) of the rank an entry of ``HARNESS_TEST_FAULTS`` (a JSON
list) names, the fault happens:

- ``sigkill``: after the forward pass, the rank SIGKILLs itself (its peers block in the
  gradient all-reduce until the launcher notices).
- ``sigstop``: after the forward pass, the rank SIGSTOPs itself (a hang inside a collective).
- ``alloc``: allocate ``gib`` GiB (under ``--mem-cap-gib`` this fails: the cell is ``oom``).

Each fault first writes ``<HARNESS_TEST_FAULT_DIR>/<cell>.<fault>.fired`` (the wall-clock time),
so a test can tell an injected failure from an accidental one.

Entry: ``{"cell": "<cell_id>", "rank": 1, "call": 2, "fault": "sigkill", "gib": 4}``.
"""

import json
import os
import signal
import time


def _argv() -> list[str]:
    # sys.argv is not set yet while site runs; the kernel's copy is.
    with open("/proc/self/cmdline", "rb") as f:
        return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]


def _fire(entry: dict, cell_id: str) -> None:
    marker_dir = os.environ.get("HARNESS_TEST_FAULT_DIR")
    if marker_dir:
        path = os.path.join(marker_dir, f"{cell_id}.{entry['fault']}.fired")
        with open(path, "w") as f:
            f.write(f"{time.time()}\n")
            f.flush()
            os.fsync(f.fileno())
    if entry["fault"] == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif entry["fault"] == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif entry["fault"] == "alloc":
        import torch

        big = torch.empty(int(entry.get("gib", 4) * 1024**3), dtype=torch.uint8)
        big.fill_(1)  # touch it, in case the allocation itself was allowed
    else:
        raise ValueError(f"unknown injected fault {entry['fault']!r}; use sigkill, sigstop or alloc")


def _install() -> None:
    spec = os.environ.get("HARNESS_TEST_FAULTS")
    if not spec:
        return
    argv = _argv()
    if "harness.run.fork_server" not in argv and not ("harness.run.worker" in argv and "--cell" in argv):
        return
    entries = json.loads(spec)

    def cell_id() -> str:
        cell_json = os.environ.get("HARNESS_CELL_JSON") or argv[argv.index("--cell") + 1]
        cell_dir = os.path.dirname(cell_json)
        if os.path.basename(cell_dir).startswith("round"):  # --rounds: cells/<id>/round<k>/cell.json
            cell_dir = os.path.dirname(cell_dir)
        return os.path.basename(cell_dir)

    import harness.run.train as train

    original_step, original_loss = train.train_step, train.lm_loss
    calls = {"n": 0}

    def loss_then_fault(entry):
        def fault(*args, **kwargs):
            loss = original_loss(*args, **kwargs)
            _fire(entry, cell_id())
            return loss
        return fault

    def train_step(ctx, x, y, lr):
        calls["n"] += 1
        rank = int(os.environ.get("RANK", "-1"))
        entry = next((e for e in entries if e["rank"] == rank and e["cell"] == cell_id()), None)
        if entry is None or calls["n"] != entry["call"]:
            return original_step(ctx, x, y, lr)
        if entry["fault"] == "alloc":
            _fire(entry, cell_id())
            return original_step(ctx, x, y, lr)
        # Mid-step: the fault hits after this rank's forward, before its backward's collectives.
        train.lm_loss = loss_then_fault(entry)
        try:
            return original_step(ctx, x, y, lr)
        finally:
            train.lm_loss = original_loss

    train.train_step = train_step


_install()
