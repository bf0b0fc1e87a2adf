"""A/B on one machine: the CI cells of a base commit and of the candidate, measured in turn.

``harness gate --base REF`` checks ``REF`` out in a git worktree and runs each tree's own CI
cells (``tests/bench/test_ci_cells.py``, pytest-benchmark) alternately, base-candidate then
candidate-base (ABBA), so drift and a busy neighbour hit both sides alike, as ``asv continuous``
and ``pyperf compare_to`` do. Each tree is imported from its own checkout (``PYTHONPATH``), so
each side measures its own code: one server per side (:mod:`harness.run.ab_server`) imports it
once, and each round runs in a process forked from there. The samples of all rounds are pooled
per cell and judged by the gate's statistics (:mod:`harness.compare`), without normalisation:
both sides share the machine and the time, which is what a normaliser tried to make up for.
With ``max_rounds``, a gate whose verdict is INCONCLUSIVE after its rounds takes the remedy
itself, one round more at a time, and stops as soon as the verdict is decided.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from harness.compare.stats import MIN_SAMPLES
from harness.errors import UsageError
from harness.jobs import REPO
from harness.records.reader import load_benchmark_json

CI_CELLS = "tests/bench/test_ci_cells.py"
CELL_TIMEOUT_S = 600.0
THREADS = 1
"""Threads per measured process. One: a neighbour on one core then slows a step in proportion,
instead of stalling a team of threads at every barrier (measured with 2 threads and a busy
neighbour on this 2-core machine: unchanged reruns at ratios 0.77-1.31)."""


def _git(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=False)


@contextlib.contextmanager
def worktree(ref: str, repo: Path = REPO) -> Iterator[Path]:
    """``ref`` checked out (detached) in a temporary git worktree, removed afterwards."""
    sha = _git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", cwd=repo)
    if sha.returncode != 0:
        raise UsageError(f"--base {ref!r} is not a commit of {repo}; give a git ref such as HEAD~1 or main")
    with tempfile.TemporaryDirectory(prefix="harness-gate-") as tmp:
        path = Path(tmp) / "base"
        added = _git("worktree", "add", "--detach", str(path), sha.stdout.strip(), cwd=repo)
        if added.returncode != 0:
            raise UsageError(f"git worktree add for --base {ref} failed: {added.stderr.strip().splitlines()[-1:]}")
        try:
            yield path
        finally:
            _git("worktree", "remove", "--force", str(path), cwd=repo)


CELL_ARGS = ["-q", "-p", "no:cacheprovider", CI_CELLS, "--benchmark-only", "-k", "not calibration"]
SERVER = Path(__file__).with_name("ab_server.py")
"""Run as a script in each side's checkout (not that side's copy: the base may predate it)."""
START_TIMEOUT_S = 300.0
KILL_AFTER_S = 10.0


class Side:
    """One side's CI cells served by :mod:`harness.run.ab_server`, imported once from ``tree``;
    :meth:`measure` runs one pass of them in a process forked from there."""

    def __init__(self, tree: Path, work: Path, name: str) -> None:
        if not (tree / CI_CELLS).is_file():
            raise UsageError(f"{tree} has no {CI_CELLS}; the A/B gate needs it on both sides")
        self.tree, self.work, self.name, self.rounds = tree, work, name, 0
        # Not an xdist worker's variables (a gate started from a test): pytest-benchmark would disable itself
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
        env = {**inherited, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(THREADS),
               "OPENBLAS_NUM_THREADS": "1"}  # numpy's OpenBLAS would start a thread server: no fork then
        self.log = work / f"{name}-server.log"
        with self.log.open("w") as log:
            # Its own session: a timeout kills the server and the round it forked together.
            self.proc = subprocess.Popen([sys.executable, "-P", str(SERVER), *CELL_ARGS], cwd=tree, env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                         text=True, start_new_session=True)

    def __enter__(self) -> Side:
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.close(kill=exc_type is not None)

    def wait_ready(self) -> None:
        """Wait for the server's imports; both sides start together, and wait before the first round."""
        self._reply("ready", START_TIMEOUT_S, self.log)

    def measure(self) -> list[dict]:
        """One pass of the CI cells; their records (calibration excluded)."""
        out_json, log = self.work / f"{self.name}-{self.rounds}.json", self.work / f"{self.name}-{self.rounds}.log"
        self.rounds += 1
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"json": str(out_json), "log": str(log)}) + "\n")
        self.proc.stdin.flush()
        code = self._reply("code", CELL_TIMEOUT_S, log)
        if code != 0:
            raise RuntimeError(f"CI cells in {self.tree} failed (exit {code}):\n{_tail(log)}")
        return [r for r in load_benchmark_json(out_json) if r["kind"] == "cell"]

    def _reply(self, key: str, timeout_s: float, log: Path):
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close(kill=True)
            why = f"no answer in {timeout_s:.0f} s" if not ready else f"it exited {self.proc.returncode}"
            raise RuntimeError(f"the A/B server of {self.tree} ({why}):\n{_tail(self.log)}{_tail(log)}")
        return json.loads(line)[key]

    def close(self, kill: bool = False) -> None:
        """End the server: EOF on its stdin; its whole session (a round in flight too) when ``kill``
        or when it lingers."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=0 if kill else KILL_AFTER_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-2000:] if path.is_file() else ""


def pool_rounds(rounds: list[list[dict]]) -> list[dict]:
    """Per cell, the first round's record whose samples are the median step time of each round."""
    pooled: dict[str, dict] = {}
    for records in rounds:
        for r in records:
            median = statistics.median(r["samples"]["step_time_s"])
            if r["cell_id"] in pooled:
                pooled[r["cell_id"]]["samples"]["step_time_s"].append(median)
            else:
                pooled[r["cell_id"]] = {**r, "samples": {"step_time_s": [median]}}
    return list(pooled.values())


def run_ab(base: Path, cand: Path, rounds: int, say=print, *, max_rounds: int | None = None,
           undecided: Callable[[list[dict], list[dict]], bool] | None = None) -> tuple[list[dict], list[dict]]:
    """``base``'s and ``cand``'s CI cells in :func:`alternate` rounds; the pooled records of each side.

    Each side's cells are served by its own :class:`Side`, so a round pays for its steps, not for
    importing torch; both servers start together and are ready before the first round.
    """
    if rounds < MIN_SAMPLES:
        raise UsageError(f"--rounds {rounds}: the gate judges one median per round and needs >= {MIN_SAMPLES}")
    last = rounds if max_rounds is None else max_rounds
    if last < rounds:
        raise UsageError(f"--max-rounds ({last}) must be >= --rounds ({rounds}); e.g. {2 * rounds}")
    with tempfile.TemporaryDirectory(prefix="harness-ab-") as tmp, contextlib.ExitStack() as stack:
        servers = {name: stack.enter_context(Side(tree, Path(tmp), name)) for name, tree in (("base", base), ("cand", cand))}
        for server in servers.values():
            server.wait_ready()
        return alternate(servers, rounds, last, undecided or (lambda b, c: False), say)


def alternate(servers: dict[str, Side], rounds: int, last: int, undecided: Callable[[list[dict], list[dict]], bool],
              say=print) -> tuple[list[dict], list[dict]]:
    """``rounds`` rounds, base first in even rounds and candidate first in odd ones (ABBA); then one
    round more while ``undecided(base, cand)`` of the pooled records so far, up to ``last`` rounds.
    The pooled records of each side (:func:`pool_rounds`)."""
    sides: dict[str, list[list[dict]]] = {"base": [], "cand": []}
    i = 0
    while i < rounds or (i < last and undecided(pool_rounds(sides["base"]), pool_rounds(sides["cand"]))):
        order = ("base", "cand") if i % 2 == 0 else ("cand", "base")
        for side in order:
            sides[side].append(servers[side].measure())
        i += 1
        why = f", undecided after {i - 1}" if i > rounds else ""
        say(f"round {i}/{rounds if i <= rounds else last} ({order[0]} first{why}): " + ", ".join(
            f"{side} {_median_ms(sides[side][-1]):.1f} ms" for side in ("base", "cand")), flush=True)
    return pool_rounds(sides["base"]), pool_rounds(sides["cand"])


def _median_ms(records: list[dict]) -> float:
    times = sorted(t for r in records for t in r["samples"]["step_time_s"])
    return 1e3 * times[len(times) // 2] if times else float("nan")
