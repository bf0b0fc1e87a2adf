"""One side of the A/B gate as a long-lived process: its imports paid once, each round forked from there.

``python -P ab_server.py ARGS...`` (cwd and ``PYTHONPATH`` the side's checkout) runs pytest's
collection of ``ARGS`` once, which imports torch, the checkout's harness and its CI cells (with
pytest's assertion rewriting, as a normal run would), says ``{"ready": true}`` on stdout, then reads
one JSON request a line on stdin, ``{"json": PATH, "log": PATH}``: for each it forks a child that
runs ``pytest ARGS --benchmark-json=PATH`` with its output in ``log``, and answers
``{"code": exit}`` when the child has exited. EOF on stdin ends the server.

A fresh interpreter per round paid about 6 s of imports (torch, pytest's plugins, ``torch._dynamo``
at the first optimizer step) for 2-3 s of measured steps, on both sides of every round; a forked
child starts from the imported state in about half a second. Every round
still runs in a process of its own, from the same freshly imported state, as with a fresh
interpreter: nothing one round's steps allocate or warm is left for the next.

Run as a script, not imported from :mod:`harness`: the side's own checkout is on ``PYTHONPATH``,
so this file uses only the standard library and pytest, and ``-P`` keeps this file's folder off
``sys.path``. Safe to fork for the reasons :mod:`harness.run.fork_server` gives: collection and
:data:`PRELOAD` run no torch op (no intra-op thread pool), and the server refuses to fork with a
second thread.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

import pytest

PRELOAD = ("torch._dynamo",)
"""Imported after collection, if torch was: torch.optim imports ``torch._dynamo`` when the first
optimizer steps, 1.6 s of every round on this 2-core machine, outside the measured steps but not
outside the round."""


def _threads() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names.append(f.read().strip())
    return names


def _run_round(args: list[str], out_json: str, log: str) -> int:
    """Fork a child that runs pytest on ``args`` once; its exit status."""
    pid = os.fork()
    if pid == 0:
        code = 70  # EX_SOFTWARE: the child died before pytest returned
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            code = int(pytest.main([*args, f"--benchmark-json={out_json}"]))
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def main(args: list[str]) -> int:
    reply = sys.stdout
    sys.stdout = sys.stderr  # pytest's collection prints; stdout carries only the replies
    code = pytest.main([*args, "--collect-only"])
    if code != 0:
        print(f"ab_server: collecting {args} failed (pytest exit {int(code)})", file=sys.stderr)
        return 1
    for name in PRELOAD if "torch" in sys.modules else ():
        importlib.import_module(name)
    if len(threads := _threads()) > 1:
        print(f"ab_server: {len(threads)} threads after the imports ({', '.join(threads)}); "
              "forking a multi-threaded process is unsafe", file=sys.stderr)
        return 1
    print(json.dumps({"ready": True}), file=reply, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        print(json.dumps({"code": _run_round(args, req["json"], req["log"])}), file=reply, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
