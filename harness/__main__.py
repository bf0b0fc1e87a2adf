"""``harness`` and ``python -m harness``: Ctrl-C (and SIGTERM) are honoured from the first instant.

Python keeps SIGINT ignored when its parent ignored it, as a non-interactive shell does for a
command it starts with ``&``; the harness is a foreground tool that must stop on Ctrl-C (exit 130)
whoever started it, so the handler is set before anything else, and the CLI (torch and all) is
imported only then: a Ctrl-C while it imports is one line too, never a traceback. So is a SIGTERM
(exit 143), which a scheduler may send that early: Slurm's time-limit warning can come up to a
minute before the time asked for.
"""

import os
import signal
import sys


class _TerminatedWhileStarting(KeyboardInterrupt):
    """SIGTERM while the CLI imports (a scheduler's warning may come that early)."""


def _raise_terminated(signum, frame) -> None:
    raise _TerminatedWhileStarting


def run() -> int:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    term_before = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        from harness.cli import main  # noqa: PLC0415 (heavy: torch; imported after the handler is set)
    except KeyboardInterrupt as e:
        name, sig = ("SIGTERM", signal.SIGTERM) if isinstance(e, _TerminatedWhileStarting) else ("Ctrl-C", signal.SIGINT)
        print(f"\nharness: interrupted ({name}) while starting; nothing was run", file=sys.stderr, flush=True)
        # Exit now, skipping the interpreter's finalisation: an interrupt that lands in code an extension
        # runs through PyRun_* while it initialises (torch's) marks it unhandled even though it was caught
        # here, and CPython then ends the process by SIGINT instead of exit 130 (seen once under load).
        # Nothing was opened or started yet, so nothing is left unflushed.
        os._exit(128 + sig)
    signal.signal(signal.SIGTERM, term_before)  # from here each command handles SIGTERM its own way
    try:
        return main()
    except KeyboardInterrupt:  # between the import and the command's own handler (argument parsing)
        print("\nharness: interrupted (Ctrl-C)", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    raise SystemExit(run())
