"""Shared pieces of the benchmark tier: a one-device training context built like the worker's."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import psutil
import pytest
import torch

from harness.measure.nvtx_ranges import Ranges
from harness.parallel.parallelized import Parallelized
from harness.precision import PrecisionPlan
from harness.run import train
from workloads.data import MarkovData
from workloads.model import Decoder
from workloads.sizes import get_size


def make_context(size_name: str, seq_len: int, batch: int, nvtx: bool, seed: int = 0):
    size = replace(get_size(size_name), seq_len=seq_len)
    torch.manual_seed(seed)
    model = Decoder(size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    ctx = train.StepContext(par=Parallelized(parts=[model], model=model, pipeline=None, data_parallel="none"),
                            optimizer=opt, precision=PrecisionPlan("fp32"), scaler=None, device_kind="cpu",
                            grad_accum=1, ranges=Ranges(enabled=nvtx))
    x, y = MarkovData(size.vocab_size, seq_len, seed=seed).batch(0, batch)
    return ctx, model, opt, x, y


def interleaved(fns: dict, rounds: int) -> dict[str, list[float]]:
    """Time each function once per round, alternating, so drift hits all of them alike."""
    out: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            out[k].append(time.perf_counter() - t0)
    return out


def bench_threads(environ=os.environ) -> int:
    """Intra-op threads for a benchmark: ``OMP_NUM_THREADS`` when the caller set it (the A/B gate
    runs one thread per process), else one per physical core (hyperthreads share a core's FPUs)."""
    if environ.get("OMP_NUM_THREADS", "").isdigit() and int(environ["OMP_NUM_THREADS"]) > 0:
        return int(environ["OMP_NUM_THREADS"])
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


@pytest.fixture(autouse=True)
def _one_thread_per_core():
    """Every benchmark starts at the same thread count, whatever an earlier test in the process set."""
    before = torch.get_num_threads()
    torch.set_num_threads(bench_threads())
    yield
    torch.set_num_threads(before)
