"""The A/B gate's rounds (harness/run/ab.py): the ABBA order, the extra rounds while undecided, and
each side's server on a checkout whose CI cells are a stand-in that reports its process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness.errors import UsageError
from harness.run.ab import CI_CELLS, Side, alternate, run_ab

# A stand-in for a checkout's CI cells: its "samples" are the process id and how many times the
# module's test ran in that process, so a round carried over from the one before would show.
FAKE_CELLS = """
import os

RUNS = []


def test_ci_tiny_train_step(benchmark):
    RUNS.append(1)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    benchmark.extra_info["step_time_s"] = [float(os.getpid()), float(len(RUNS))]
    assert os.environ.get("FAIL_CELLS") != "1", "told to fail"
"""


class FakeServer:
    """Answers each round with one cell whose samples are ``times[k]`` for its k-th round."""

    def __init__(self, name: str, times: list[list[float]], calls: list[str]) -> None:
        self.name, self.times, self.calls = name, times, calls

    def measure(self) -> list[dict]:
        k = sum(1 for c in self.calls if c == self.name)
        self.calls.append(self.name)
        return [{"cell_id": "c", "kind": "cell", "samples": {"step_time_s": self.times[k]}}]


def _servers(calls: list[str]) -> dict:
    base = [[1.0, 2.0, 9.0], [3.0, 4.0, 5.0], [2.0], [7.0, 1.0], [6.0], [8.0], [5.0, 5.0, 1.0]]
    cand = [[10.0 * t for t in ts] for ts in base]
    return {"base": FakeServer("base", base, calls), "cand": FakeServer("cand", cand, calls)}


def test_rounds_alternate_abba_and_pool_one_median_per_round():
    calls: list[str] = []
    b, c = alternate(_servers(calls), 5, 5, lambda b, c: True, say=lambda *a, **k: None)
    assert calls == ["base", "cand", "cand", "base", "base", "cand", "cand", "base", "base", "cand"]
    # medians by hand: [1, 2, 9] -> 2, [3, 4, 5] -> 4, [2] -> 2, [7, 1] -> 4, [6] -> 6
    assert b[0]["samples"]["step_time_s"] == [2.0, 4.0, 2.0, 4.0, 6.0]
    assert c[0]["samples"]["step_time_s"] == [20.0, 40.0, 20.0, 40.0, 60.0]


def test_undecided_adds_one_round_at_a_time_up_to_the_last():
    seen: list[int] = []

    def undecided(b, c):
        seen.append(len(b[0]["samples"]["step_time_s"]))
        return len(seen) < 2  # undecided after 5 rounds, decided after 6

    calls: list[str] = []
    b, _ = alternate(_servers(calls), 5, 7, undecided, say=lambda *a, **k: None)
    assert seen == [5, 6] and len(b[0]["samples"]["step_time_s"]) == 6
    assert calls[10:] == ["cand", "base"]  # the 6th round is an odd one: candidate first
    calls.clear()
    b, _ = alternate(_servers(calls), 5, 7, lambda b, c: True, say=lambda *a, **k: None)
    assert len(b[0]["samples"]["step_time_s"]) == 7 and len(calls) == 14


def test_max_rounds_below_rounds_is_refused(tmp_path):
    with pytest.raises(UsageError, match=r"--max-rounds \(4\) must be >= --rounds \(5\)"):
        run_ab(tmp_path, tmp_path, 5, max_rounds=4)


def _fake_tree(root: Path) -> Path:
    (root / Path(CI_CELLS).parent).mkdir(parents=True)
    (root / CI_CELLS).write_text(FAKE_CELLS)
    return root


def test_each_round_runs_in_a_fresh_process_forked_from_one_server(tmp_path):
    tree = _fake_tree(tmp_path / "tree")
    with Side(tree, tmp_path, "base") as side:
        side.wait_ready()
        rounds = [side.measure()[0]["samples"]["step_time_s"] for _ in range(2)]
        server = side.proc.pid
    (pid1, runs1), (pid2, runs2) = rounds
    assert runs1 == runs2 == 1.0  # nothing of one round is left in the next
    assert len({int(pid1), int(pid2), server, os.getpid()}) == 4
    assert side.proc.returncode == 0  # EOF on stdin ended it


def test_a_failing_round_names_the_tree_and_its_output(tmp_path, monkeypatch):
    tree = _fake_tree(tmp_path / "tree")
    monkeypatch.setenv("FAIL_CELLS", "1")
    with Side(tree, tmp_path, "cand") as side:
        side.wait_ready()
        with pytest.raises(RuntimeError, match=r"(?s)CI cells in .*tree failed \(exit 1\).*told to fail"):
            side.measure()


def test_a_checkout_without_ci_cells_is_refused(tmp_path):
    with pytest.raises(UsageError, match="has no tests/bench/test_ci_cells.py; the A/B gate needs it on both sides"):
        Side(tmp_path, tmp_path, "base")
