"""Command line: ``harness {bench,plan,fit,report,compare,diff,history,gate,calibrate,workloads,trace,slurm}``.

One module per subcommand, each with a ``register(sub)``; the sweep flags they share are in
:mod:`harness.cli.args`. Nothing in the harness imports this package: it is the top layer.
Bad input is one line on stderr naming the value and the fix, exit code 2, before anything
is launched or written.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import NoReturn

from harness.cli import bench, calibrate, compare, diff, fit, gate, history, plan, report, slurm, trace
from harness.cli.args import EXIT_USAGE, spec_from_args
from harness.errors import UsageError
from harness.jobs import Terminated

__all__ = ["build_parser", "main", "spec_from_args"]


class Parser(argparse.ArgumentParser):
    """argparse with its refusals on one line, as the harness's own (the usage is ``--help``'s), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="harness", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for module in (bench, plan, fit, report, compare, diff, history, gate, calibrate, trace, slurm):
        module.register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except UsageError as e:
        print(f"harness {args.cmd}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as e:  # any moment a command did not handle itself: one line, no traceback
        name, code = ("SIGTERM", 128 + signal.SIGTERM) if isinstance(e, Terminated) else ("Ctrl-C", 128 + signal.SIGINT)
        print(f"\nharness {args.cmd}: interrupted ({name})", file=sys.stderr)
        return code
