"""A/B on one machine: the CI cells of a base commit and of the candidate, measured in turn.

``harness gate --base REF`` checks ``REF`` out in a git worktree and runs each tree's own CI
cells (``tests/bench/test_ci_cells.py``, pytest-benchmark) alternately, base-candidate then
candidate-base (ABBA), so drift and a busy neighbour hit both sides alike, as ``asv continuous``
and ``pyperf compare_to`` do. Each tree is imported from its own checkout (``PYTHONPATH``), so
each side measures its own code. The samples of all rounds are pooled per cell and judged by
the gate's statistics (:mod:`harness.compare`), without normalisation: both sides share the
machine and the time, which is what a normaliser tried to make up for.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
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


def measure(tree: Path, out_json: Path) -> list[dict]:
    """One pass of ``tree``'s CI cells, imported from ``tree``; their records (calibration excluded)."""
    if not (tree / CI_CELLS).is_file():
        raise UsageError(f"{tree} has no {CI_CELLS}; the A/B gate needs it on both sides")
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(THREADS)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", CI_CELLS, "--benchmark-only",
           "-k", "not calibration", f"--benchmark-json={out_json}"]
    res = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=CELL_TIMEOUT_S)
    if res.returncode != 0:
        raise RuntimeError(f"CI cells in {tree} failed (exit {res.returncode}):\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    return [r for r in load_benchmark_json(out_json) if r["kind"] == "cell"]


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


def run_ab(base: Path, cand: Path, rounds: int, say=print) -> tuple[list[dict], list[dict]]:
    """Alternate ``rounds`` times (ABBA); the pooled records of each side."""
    if rounds < MIN_SAMPLES:
        raise UsageError(f"--rounds {rounds}: the gate judges one median per round and needs >= {MIN_SAMPLES}")
    sides: dict[str, list[list[dict]]] = {"base": [], "cand": []}
    trees = {"base": base, "cand": cand}
    with tempfile.TemporaryDirectory(prefix="harness-ab-") as tmp:
        for i in range(rounds):
            order = ("base", "cand") if i % 2 == 0 else ("cand", "base")
            for side in order:
                records = measure(trees[side], Path(tmp) / f"{side}-{i}.json")
                sides[side].append(records)
            say(f"round {i + 1}/{rounds} ({order[0]} first): " + ", ".join(
                f"{side} {_median_ms(sides[side][-1]):.1f} ms" for side in ("base", "cand")), flush=True)
    return pool_rounds(sides["base"]), pool_rounds(sides["cand"])


def _median_ms(records: list[dict]) -> float:
    times = sorted(t for r in records for t in r["samples"]["step_time_s"])
    return 1e3 * times[len(times) // 2] if times else float("nan")
