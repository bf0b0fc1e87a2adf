"""Harness cost, side by side in one run, judged with a statistical bound (never a wall-clock threshold).

* the harness's step function vs a bare training loop, in one process (target: <= 3% cost, the
  upper end of a bootstrap CI over rounds of alternating steps), and the same bound failing when an
  extra forward pass is injected into the measured step (the check can fail); 31 rounds of 5
  steps a side (15 rounds of 3 gave a CI of [0.959, 1.043] in one CI run), extended by 31 at a
  time, up to 93, while the CI holds the bound (undecided);
* the whole path: ``harness bench`` runs the ``single`` cell through the real launcher (torchrun,
  the worker, the monitor, the timer) against a bare loop of the same model, batch, data and
  thread count in a fresh process and in this one, interleaved round by round (target:
  bare/harness median >= 0.99; asserted: the CI's upper end >= 0.95);
* NVTX ranges on vs off, the harness's step either side (target: <= 1% cost; asserted: the CI's upper end
  <= 3%, as for the step).

Run with ``make bench-ci`` (saves the JSON) or ``pytest tests/bench -s`` to see the ratios.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from harness.run import train
from harness.spec import threads_per_rank
from tests.bench import bare_loop
from tests.bench.bare_loop import bare_step
from tests.bench.conftest import interleaved, make_context

pytestmark = [pytest.mark.slow, pytest.mark.timing]  # statistical benchmarks: make test-slow, alone

REPO = Path(__file__).resolve().parents[2]
STEP_COST_BOUND = 1.03
"""harness/bare step time the upper end of the CI may reach (the docstring's 3%)."""
ROUNDS = 31
MAX_ROUNDS = 93
"""Rounds are added 31 at a time while the CI holds the bound (undecided), up to this: one CI run
measured a median of 1.001 with an upper end of 1.0302 after 31 rounds, and one (with another
process starting and stopping beside it) a median of 1.059 with a CI of [0.991, 1.166] after 62.
Three looks at a 2.5% one-sided level each keep a true 3% cost passing at most ~7.5%."""
STEPS_PER_ROUND = 5
INJECTED_ROUNDS = 15


def paired_ratio_ci(base: list[float], cand: list[float], n_resamples: int = 4000, seed: int = 0,
                    confidence: float = 0.95) -> tuple[float, float, float]:
    """Median of the per-round ratios ``cand_i / base_i`` and its percentile-bootstrap CI.

    Rounds are paired (the two sides ran back to back, so drift hits both alike): the rounds are
    resampled with replacement, and the CI is the spread of the resampled medians.
    """
    ratios = np.asarray(cand) / np.asarray(base)
    rng = np.random.default_rng(seed)
    boot = np.median(ratios[rng.integers(0, len(ratios), size=(n_resamples, len(ratios)))], axis=1)
    tail = (1 - confidence) / 2
    low, high = np.quantile(boot, [tail, 1 - tail])
    return float(np.median(ratios)), float(low), float(high)


def overhead_failure(base: list[float], cand: list[float], bound: float) -> str | None:
    """Why ``cand`` costs more than ``bound`` x ``base`` (the CI's upper end is over it), or None."""
    ratio, low, high = paired_ratio_ci(base, cand)
    if high <= bound:
        return None
    return f"cost ratio {ratio:.3f} (95% CI [{low:.3f}, {high:.3f}]) over {len(base)} rounds: upper end > {bound}"


def _rounds(fns: dict, rounds: int, steps: int = STEPS_PER_ROUND) -> dict[str, list[float]]:
    """Per round, each function's median over ``steps`` calls, the calls alternating step by step
    (ABAB...) and the side that goes first alternating round by round.

    Step by step, not in blocks of ``steps``: on a VM with a third of its CPU stolen, blocks of 5
    gave per-round ratios with a spread (sd) of 0.29-0.32 and a CI of [0.969, 1.049] after 62
    rounds; alternating steps, 0.08-0.13 and [0.976, 1.000] (CI's one failure was [0.998, 1.032]
    after 93 rounds of blocks). A burst of steal now lands on both sides of a round alike.
    """
    out: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        times = interleaved({k: fns[k] for k in order}, steps)
        for k in names:
            out[k].append(statistics.median(times[k]))
    return out


def _judged_rounds(fns: dict, base: str, cand: str, bound: float, rounds: int = ROUNDS) -> dict[str, list[float]]:
    """Rounds of ``fns`` until the bound is decided: ``rounds``, then 31 more while the CI holds it
    (below it at its lower end, above it at its upper end: undecided, whichever side the median is on)."""
    samples = _rounds(fns, rounds)
    while len(samples[base]) < MAX_ROUNDS:
        _, low, high = paired_ratio_ci(samples[base], samples[cand])
        if high <= bound or low > bound:
            break
        for k, v in _rounds(fns, ROUNDS).items():
            samples[k].extend(v)
    return samples


def _report(benchmark, samples: dict[str, list[float]], base: str, cand: str) -> float:
    ratio, low, high = paired_ratio_ci(samples[base], samples[cand])
    benchmark.extra_info.update({f"{k}_step_time_s": v for k, v in samples.items()})
    benchmark.extra_info[f"ratio_{cand}_over_{base}"] = ratio
    benchmark.extra_info[f"ratio_{cand}_over_{base}_ci95"] = [low, high]
    print(f"\n{cand} / {base} median per-round ratio = {ratio:.4f} (95% CI [{low:.4f}, {high:.4f}])")
    return ratio


def _harness_and_bare(extra_forwards: int = 0) -> dict:
    ctx, _, _, x, y = make_context("tiny", seq_len=128, batch=8, nvtx=True)
    _, bmodel, bopt, _, _ = make_context("tiny", seq_len=128, batch=8, nvtx=False)

    def harness_step():
        out = train.train_step(ctx, x, y, 1e-3)
        with torch.no_grad():  # a test-injected slowdown inside the measured step
            for _ in range(extra_forwards):
                ctx.par.model(x)
        return out

    fns = {"bare": lambda: bare_step(bmodel, bopt, x, y), "harness": harness_step}
    for fn in fns.values():  # warmup
        fn()
    return fns


def test_harness_step_vs_bare_loop(benchmark):
    samples = _judged_rounds(_harness_and_bare(), "bare", "harness", STEP_COST_BOUND)
    _report(benchmark, samples, "bare", "harness")
    failure = overhead_failure(samples["bare"], samples["harness"], STEP_COST_BOUND)
    assert failure is None, f"the harness's step costs more than a bare loop's: {failure}"
    benchmark.pedantic(_harness_and_bare()["harness"], rounds=3, iterations=1)


def test_step_cost_bound_fails_with_an_extra_forward_pass(benchmark):
    """The bound above can fail: one extra forward pass per measured step (injected here, not in the product).
    A third more work per step needs fewer rounds to decide than a cost near 3%: 15, before any extension."""
    samples = _judged_rounds(_harness_and_bare(extra_forwards=1), "bare", "harness", STEP_COST_BOUND,
                             rounds=INJECTED_ROUNDS)
    _report(benchmark, samples, "bare", "harness")
    failure = overhead_failure(samples["bare"], samples["harness"], STEP_COST_BOUND)
    assert failure is not None, "an extra forward pass per step went unnoticed"
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)


# ---- the whole path: the launcher's `single` cell against a bare loop --------------------------

E2E_STEPS, E2E_WARMUP, E2E_ROUNDS = 20, 3, 3
"""Three rounds of 20 steps (issue 43: four of 30 took 130 s): the judged bound is the CI's upper end >= 0.95,
which the bare/harness medians of a healthy launcher (0.97-1.02, results/reference/harness-cost) clear."""
E2E_CELL = ["--device", "cpu", "--gpus", "1", "--sizes", bare_loop.SIZE, "--strategies", "single",
            "--seq-len", str(bare_loop.SEQ_LEN), "--batch", str(bare_loop.BATCH), "--steps", str(E2E_STEPS),
            "--warmup", str(E2E_WARMUP), "--no-calibrate"]
LAUNCHER_FLOOR = 0.95
"""bare/harness median the launcher's cell must reach against a fresh bare process (<= 5% cost)."""


def _launcher_median(out: Path) -> float:
    res = subprocess.run([sys.executable, "-m", "harness", "bench", *E2E_CELL, "--out", str(out)], cwd=REPO,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
    assert res.returncode == 0, f"harness bench exited {res.returncode}: {res.stderr[-2000:]}"
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    (cell,) = [r for r in records if r.get("kind") == "cell"]
    assert cell["status"] == "ok", cell.get("error")
    return cell["metrics"]["step_time_s"]["median"]


def _fresh_process_median(threads: int) -> float:
    res = subprocess.run([sys.executable, "-m", "tests.bench.bare_loop", str(E2E_STEPS), str(E2E_WARMUP),
                          str(threads)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _launcher_rounds(tmp: Path, threads: int) -> dict[str, list[float]]:
    """``E2E_ROUNDS`` rounds of the three sides, the order rotating round by round."""
    samples: dict[str, list[float]] = {"harness": [], "fresh": [], "here": []}
    for r in range(E2E_ROUNDS):
        sides = {"harness": lambda r=r: _launcher_median(tmp / f"round{r}"),
                 "fresh": lambda: _fresh_process_median(threads),
                 "here": lambda: bare_loop.median_step_s(E2E_STEPS, E2E_WARMUP)}
        names = list(sides)
        for side in names[r % 3:] + names[:r % 3]:
            samples[side].append(sides[side]())
    return samples


def _launcher_verdict(samples: dict[str, list[float]], label: str, info: dict) -> tuple[float, list[float]]:
    """The CI's upper end of bare (fresh) / harness and its per-round ratios; prints both sides' ratios and keeps
    them in ``info`` (the benchmark's extra info)."""
    out = {}
    for side in ("fresh", "here"):
        ratio, low, high = paired_ratio_ci(samples["harness"], samples[side])
        per_round = [b / h for b, h in zip(samples[side], samples["harness"])]
        out[side] = (high, per_round)
        info[f"ratio_bare_{side}_over_harness"], info[f"ratio_bare_{side}_over_harness_ci95"] = ratio, [low, high]
        print(f"\n{label}: bare ({side}) / harness median step time = {ratio:.4f} (95% CI [{low:.4f}, {high:.4f}]; "
              f"rounds {', '.join(f'{x:.3f}' for x in per_round)})")
    return out["fresh"]


def test_launcher_single_cell_vs_bare_loop(benchmark, tmp_path):
    """bare/harness median step time per round, three sides, the order rotating round by round.

    ``fresh``: the bare loop in a process of its own, started like the cell's rank (the judged
    ratio). ``here``: the same loop in this long-lived test process, reported beside it: on this
    machine it runs ~5% faster than any fresh process, the launcher's or not.

    A failed verdict is measured once more, as the A/B gate confirms a regression, and fails the test only if the
    second measurement fails too: one fresh-clone CI run measured the cell 15-34% slower in all three rounds
    (0.658, 0.809, 0.850) and the same tier passed on its next run; a real cost fails both.
    """
    threads = threads_per_rank(1)  # what the worker of a one-rank cell sets
    torch.set_num_threads(threads)
    bare_loop.median_step_s(2, 1)  # this process's warmup (imports, allocator)
    samples = _launcher_rounds(tmp_path / "first", threads)
    high, per_round = _launcher_verdict(samples, "first", benchmark.extra_info)
    measured = [per_round]
    if high < LAUNCHER_FLOOR:
        samples = _launcher_rounds(tmp_path / "confirm", threads)
        high, per_round = _launcher_verdict(samples, "confirmation", benchmark.extra_info)
        measured.append(per_round)
    benchmark.extra_info.update({f"{k}_median_step_s": v for k, v in samples.items()})
    benchmark.extra_info["ratio_bare_fresh_over_harness_per_round"] = measured
    assert high >= LAUNCHER_FLOOR, f"the launcher's cell is slower than a bare process by > 5%, twice: {measured}"
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)


def _nvtx_on_and_off() -> dict:
    on = make_context("tiny", seq_len=128, batch=8, nvtx=True)
    off = make_context("tiny", seq_len=128, batch=8, nvtx=False)
    fns = {"nvtx_off": lambda: train.train_step(off[0], off[3], off[4], 1e-4),
           "nvtx_on": lambda: train.train_step(on[0], on[3], on[4], 1e-4)}
    for fn in fns.values():  # warmup
        fn()
    return fns


def test_nvtx_overhead(benchmark):
    """NVTX ranges on against off, the same harness step either side, judged like the step's cost: the CI's upper
    end of on/off at most ``STEP_COST_BOUND``. It was 4 rounds of one `small` step with a (0.5, 2.0) sanity band,
    whose CI spanned [0.26, 4.05] on a busy machine and failed at 2.22; the `tiny` step, alternated step by step
    over 31+ rounds, makes the ranges' share larger and the verdict a bound."""
    fns = _nvtx_on_and_off()
    samples = _judged_rounds(fns, "nvtx_off", "nvtx_on", STEP_COST_BOUND)
    _report(benchmark, samples, "nvtx_off", "nvtx_on")
    failure = overhead_failure(samples["nvtx_off"], samples["nvtx_on"], STEP_COST_BOUND)
    assert failure is None, f"NVTX ranges cost the step more than {STEP_COST_BOUND - 1:.0%}: {failure}"
    benchmark.pedantic(fns["nvtx_on"], rounds=3, iterations=1)
