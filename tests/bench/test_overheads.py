"""Harness cost, side by side in one run (ratios, not wall-clock thresholds).

* harness step vs a bare training loop on the same model and batch (target: <= 2% cost);
* NVTX ranges on vs off on the ``small`` workload (target: <= 1% cost).

Run with ``make bench-ci`` (saves the JSON) or ``pytest tests/bench -s`` to see the ratios.
"""

from __future__ import annotations

import statistics

from harness.run import train
from tests.bench.conftest import bare_step, interleaved, make_context


def _report(benchmark, samples: dict[str, list[float]], base: str, cand: str) -> float:
    ratio = statistics.median(samples[cand]) / statistics.median(samples[base])
    benchmark.extra_info.update({f"{k}_step_time_s": v for k, v in samples.items()})
    benchmark.extra_info[f"ratio_{cand}_over_{base}"] = ratio
    print(f"\n{cand} / {base} median step time = {ratio:.4f} ({(ratio - 1) * 100:+.2f}%)")
    return ratio


def test_harness_step_vs_bare_loop(benchmark):
    ctx, model, opt, x, y = make_context("tiny", seq_len=128, batch=8, nvtx=True)
    bare_model_ctx = make_context("tiny", seq_len=128, batch=8, nvtx=False)
    _, bmodel, bopt, _, _ = bare_model_ctx
    fns = {"bare": lambda: bare_step(bmodel, bopt, x, y), "harness": lambda: train.train_step(ctx, x, y, 1e-3)}
    for fn in fns.values():  # warmup
        fn()
    samples = interleaved(fns, rounds=15)
    ratio = _report(benchmark, samples, "bare", "harness")
    assert 0.5 < ratio < 2.0, "the two loops must do the same work; a 2x gap means they do not"
    benchmark.pedantic(lambda: train.train_step(ctx, x, y, 1e-3), rounds=5, iterations=1)


def test_nvtx_overhead_small(benchmark):
    on = make_context("small", seq_len=64, batch=1, nvtx=True)
    off = make_context("small", seq_len=64, batch=1, nvtx=False)
    fns = {"nvtx_off": lambda: train.train_step(off[0], off[3], off[4], 1e-4),
           "nvtx_on": lambda: train.train_step(on[0], on[3], on[4], 1e-4)}
    for fn in fns.values():
        fn()
    samples = interleaved(fns, rounds=4)
    ratio = _report(benchmark, samples, "nvtx_off", "nvtx_on")
    assert 0.5 < ratio < 2.0
    benchmark.pedantic(fns["nvtx_on"], rounds=1, iterations=1)
