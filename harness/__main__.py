"""``harness`` and ``python -m harness``: Ctrl-C is honoured from the first instant.

Python keeps SIGINT ignored when its parent ignored it, as a non-interactive shell does for a
command it starts with ``&``; the harness is a foreground tool that must stop on Ctrl-C (exit 130)
whoever started it, so the handler is set before anything else, and the CLI (torch and all) is
imported only then: a Ctrl-C while it imports is one line too, never a traceback.
"""

import os
import signal
import sys


def run() -> int:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        from harness.cli import main  # noqa: PLC0415 (heavy: torch; imported after the handler is set)
    except KeyboardInterrupt:
        print("\nharness: interrupted (Ctrl-C) while starting; nothing was run", file=sys.stderr, flush=True)
        # Exit now, skipping the interpreter's finalisation: an interrupt that lands in code an extension
        # runs through PyRun_* while it initialises (torch's) marks it unhandled even though it was caught
        # here, and CPython then ends the process by SIGINT instead of exit 130 (seen once under load).
        # Nothing was opened or started yet, so nothing is left unflushed.
        os._exit(128 + signal.SIGINT)
    try:
        return main()
    except KeyboardInterrupt:  # between the import and the command's own handler (argument parsing)
        print("\nharness: interrupted (Ctrl-C)", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    raise SystemExit(run())
